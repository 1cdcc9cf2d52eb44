"""Prometheus metrics of a decode worker (`diptych_worker_*`, `diptych_transfer_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from runtime.metrics import FAST_BUCKETS, TTFT_BUCKETS, counter, gauge, histogram
from worker.metrics import WorkerMetrics


class DecodeMetrics(WorkerMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.requests = counter(
            r, "worker", "requests", "Requests by where their prompt was prefilled", ["prefill"]
        )
        self.lora_local = counter(
            r, "worker", "lora_local_prefills",
            "Requests for a LoRA adapter prefilled here because no prefill worker serves "
            "adapters (the prefill pool was open to the request otherwise)",
        )  # fmt: skip
        self.deterministic_local = counter(
            r, "worker", "deterministic_local_prefills",
            "Requests of a --deterministic decode worker prefilled here because a prefill "
            "worker does not run --deterministic (its KV would differ)",
        )  # fmt: skip
        self.refused = counter(
            r, "worker", "requests_refused", "Requests refused because the queue was full"
        )
        self.reasoning_tokens = counter(
            r, "worker", "reasoning_tokens",
            "Thinking tokens generated (reasoning models), as they are: the planner's live "
            "thinking rate",
        )  # fmt: skip
        self.remote_started = counter(r, "worker", "remote_prefills_started", "Published")
        self.remote_finished = counter(
            r,
            "worker",
            "remote_prefills_finished",
            "Remote prefills by outcome (ok, refused, malformed, violation, dead_letter, timeout, "
            "publish_error)",
            ["result"],
        )
        self.remote_routed = counter(
            r, "worker", "remote_prefills_routed",
            "Remote prefills by where they were offered first: holder (the prefill worker "
            "holding most of the prompt) or any (the shared queue)",
            ["to"],
        )  # fmt: skip
        self.remote_released = counter(
            r, "worker", "remote_prefills_released",
            "Preferred remote prefills handed to every prefill worker: wait (not taken in "
            "time) or left (the preferred worker left)",
            ["why"],
        )  # fmt: skip
        for to in ("holder", "any"):
            self.remote_routed.labels(to)
        for why in ("wait", "left"):
            self.remote_released.labels(why)
        self.malformed_notices = counter(
            r, "worker", "malformed_prefill_notices", "Prefill notices that did not decode"
        )
        self.rejected_notices = counter(
            r,
            "worker",
            "rejected_prefill_notices",
            "Prefill notices for a pending request not sent under its write grant",
        )
        self.remote_latency = histogram(
            r, "worker", "remote_prefill_seconds", "Publish to KV adopted", TTFT_BUCKETS
        )
        self.remote_transfer = histogram(
            r,
            "transfer",
            "write_seconds",
            "KV write started (prefill worker's clock) to its notice received",
            FAST_BUCKETS,
        )
        self.transferred_bytes = counter(
            r, "transfer", "received_bytes", "KV bytes written into this worker's blocks"
        )
        self.queue_depth = gauge(r, "worker", "prefill_queue_depth", "Pending remote prefills")
        self.oldest_remote = gauge(
            r, "worker", "remote_prefill_oldest_seconds",
            "Age of the oldest remote prefill this worker waits for (0: none)",
        )  # fmt: skip
        self.running = gauge(r, "worker", "running_requests", "Requests in the batch")
        self.waiting = gauge(r, "worker", "waiting_requests", "Requests queued")
        self.remote_waiting = gauge(
            r, "worker", "remote_waiting_requests", "Requests waiting for remote KV"
        )
        self.kv_usage = gauge(r, "worker", "kv_usage", "Fraction of KV blocks in use")
        self.peer_pulls = counter(
            r, "worker", "kv_peer_pulls",
            "Prefix pulls from another decode worker by outcome: ok, refused (it held none), "
            "timeout, held (this worker held enough), no_room, unknown_peer, malformed",
            ["result"],
        )  # fmt: skip
        for result in ("ok", "refused", "timeout", "held", "no_room", "unknown_peer"):
            self.peer_pulls.labels(result)
        self.peer_pulled_blocks = counter(
            r, "worker", "kv_peer_pulled_blocks", "KV blocks other decode workers wrote here"
        )
        self.peer_pushed_blocks = counter(
            r, "worker", "kv_peer_pushed_blocks", "KV blocks this worker wrote into peers' pools"
        )
        self.peer_pull_seconds = histogram(
            r, "worker", "kv_peer_pull_seconds", "A prefix pull, asked to landed", FAST_BUCKETS
        )

    def remote_share(self) -> float:
        """Share of requests whose prompt was prefilled remotely (for tests and logs)."""
        local = self.requests.labels(prefill="local")._value.get()
        remote = self.requests.labels(prefill="remote")._value.get()
        return remote / (local + remote) if local + remote else 0.0

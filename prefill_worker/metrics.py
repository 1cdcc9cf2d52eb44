"""Prometheus metrics of a prefill worker (`diptych_worker_*`, `diptych_transfer_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from runtime.metrics import FAST_BUCKETS, TTFT_BUCKETS, counter, gauge, histogram
from worker.metrics import WorkerMetrics


class PrefillMetrics(WorkerMetrics):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.prefills = counter(
            r,
            "worker",
            "prefills",
            "Remote prefills by outcome (ok, skipped, refused, failed, duplicate)",
            ["result"],
        )
        self.prefill_seconds = histogram(
            r, "worker", "prefill_seconds", "Fetch to first token", TTFT_BUCKETS
        )
        self.transfer_seconds = histogram(
            r, "transfer", "write_seconds", "KV write into a decode worker", FAST_BUCKETS
        )
        self.transferred_bytes = counter(r, "transfer", "sent_bytes", "KV bytes written")
        self.rank_bytes = counter(
            r, "transfer", "rank_sent_bytes",
            "KV bytes written from each of our tensor-parallel ranks' pools into each of "
            "the decode worker's ranks' pools",
            ["prefill_rank", "decode_rank"],
        )  # fmt: skip
        self.in_flight = gauge(r, "worker", "prefills_in_flight", "Prefills being worked on")

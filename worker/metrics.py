"""The metrics every worker exports; each role adds its own on the same registry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engine.engine_core import EngineSnapshot
from engine.kv_cache.tiers import TierStats
from engine.models.moe import ExpertLoadStats
from runtime.metrics import gauge, info, metric_name, new_registry
from runtime.queue.signing import REJECTIONS

# The transfer agent's counters (`transfer.context.COUNTERS`) that mean a KV transfer
# or a peer went wrong, exported as diptych_transfer_failures_total{reason}.
TRANSFER_FAILURES = (
    "transfers_failed",
    "peers_lost",
    "rejected_unknown_peer",
    "rejected_stale_peer",
    "rejected_auth",
    "rejected_out_of_bounds",
    "rejected_malformed",
    "rejected_duplicate",
    "rejected_after_placement",
    "rejected_grant",
)


class ByReason(Collector):
    """One counter family with a ``reason`` label, read from counts kept elsewhere when
    scraped (the transfer agent's, the queue client's: layers that know nothing of
    Prometheus). Every reason in ``reasons`` is exported, 0 when it has not happened."""

    def __init__(
        self,
        name: tuple[str, str],
        doc: str,
        reasons: tuple[str, ...],
        counts: Callable[[], dict[str, int]],
    ) -> None:
        self._name, self._doc, self._reasons, self._counts = name, doc, reasons, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(metric_name(*self._name), self._doc, labels=["reason"])
        counts = self._counts()
        for reason in self._reasons:
            family.add_metric([reason], counts.get(reason, 0))
        yield family


class Speculation(Collector):
    """The engine's speculative-decoding counters (`engine.spec.lookup.Speculator`),
    read when scraped: verification steps, drafted and accepted tokens, and the
    acceptance rate and accepted tokens per step they imply."""

    def __init__(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        steps, drafted, accepted = self._counts()
        for name, doc, value in (
            ("spec_verify_steps", "Decode steps that verified drafted tokens", steps),
            ("spec_draft_tokens", "Tokens drafted (prompt lookup or the draft model)", drafted),
            ("spec_accepted_tokens", "Drafted tokens the model accepted", accepted),
        ):
            yield CounterMetricFamily(metric_name("worker", name), doc, value=value)
        yield GaugeMetricFamily(
            metric_name("worker", "spec_acceptance_rate"),
            "Share of drafted tokens accepted, since start",
            value=accepted / drafted if drafted else 0.0,
        )
        yield GaugeMetricFamily(
            metric_name("worker", "spec_accepted_per_step"),
            "Drafted tokens accepted per verification step, since start (each step "
            "also emits the model's own next token)",
            value=accepted / steps if steps else 0.0,
        )


class TensorParallel(Collector):
    """A tensor-parallel engine's collectives (`engine.parallel.group.TpGroup`), read
    when scraped: how many, and rank 0's seconds in them (waiting for the slowest rank
    included): what the split costs the steps."""

    def __init__(self, size: int, counts: Callable[[], tuple[int, float, int]]) -> None:
        self._size, self._counts = size, counts

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        n, seconds, nbytes = self._counts()
        yield GaugeMetricFamily(
            metric_name("worker", "tensor_parallel_size"),
            "Ranks the engine's model is split over", value=self._size,
        )
        yield CounterMetricFamily(
            metric_name("worker", "tp_collectives"),
            "All-reduces and gathers the forward passes ran", value=n,
        )
        yield CounterMetricFamily(
            metric_name("worker", "tp_collective_seconds"),
            "Seconds rank 0 spent in them, waiting for the other ranks included", value=seconds,
        )
        yield CounterMetricFamily(
            metric_name("worker", "tp_collective_bytes"),
            "Bytes rank 0 put into them (with --expert-parallel-size, the experts' "
            "all-to-alls and all-gathers included)", value=nbytes,
        )


class ExpertLoad(Collector):
    """A mixture of experts' routing imbalance (`engine.models.moe.expert_load`), read
    when scraped: the last step's and the mean since start, over experts and over
    expert-parallel ranks' shares of them. 1.0 is even routing."""

    def __init__(self, stats: Callable[[], ExpertLoadStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats() or ExpertLoadStats()
        steps = max(s.steps, 1)
        for name, doc, value in (
            ("moe_expert_load_imbalance", "Last step: tokens of the busiest expert over an "
             "even share, averaged over sparse layers", s.last),
            ("moe_expert_load_imbalance_mean", "The same, averaged over steps since start",
             s.total / steps),
            ("moe_rank_load_imbalance", "Last step: tokens of the busiest expert-parallel "
             "rank's experts over an even share (1 without expert parallelism)", s.last_rank),
            ("moe_rank_load_imbalance_mean", "The same, averaged over steps since start",
             s.total_rank / steps),
        ):  # fmt: skip
            yield GaugeMetricFamily(metric_name("worker", name), doc, value=value)
        yield CounterMetricFamily(
            metric_name("worker", "moe_steps"), "Forward passes that routed tokens to experts",
            value=s.steps,
        )
        yield GaugeMetricFamily(
            metric_name("worker", "moe_all_to_all_bytes_last_step"),
            "Last step: bytes rank 0's expert-parallel all-to-alls sent the other ranks "
            "(tokens to their experts and results back, every sparse layer; 0 without "
            "--expert-parallel-size)", value=s.all_to_all_bytes_last,
        )
        yield CounterMetricFamily(
            metric_name("worker", "moe_all_to_all_bytes"),
            "The same since start (over moe_steps: the mean a step)", value=s.all_to_all_bytes,
        )


class KvTierCounts(Collector):
    """The KV tiers under the prefix cache (engine/kv_cache/tiers.py), read when
    scraped: blocks and bytes each tier holds, offloads, restores and their time, disk
    reads, files refused, blocks evicted to nothing."""

    def __init__(self, stats: Callable[[], TierStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats() or TierStats()
        blocks = GaugeMetricFamily(metric_name("worker", "kv_tier_blocks"),
                                   "KV blocks a tier holds", labels=["tier"])  # fmt: skip
        held = GaugeMetricFamily(metric_name("worker", "kv_tier_bytes"),
                                 "Bytes of KV blocks a tier holds", labels=["tier"])  # fmt: skip
        for tier, n in (("host", s.host_blocks), ("disk", s.disk_blocks)):
            blocks.add_metric([tier], n)
            held.add_metric([tier], n * s.block_bytes)
        yield blocks
        yield held
        for name, doc, value in (
            ("kv_tier_offloaded_blocks", "Blocks the device pool evicted into the host tier",
             s.offloaded),
            ("kv_tier_restored_blocks", "Blocks a prefix hit copied back from a tier",
             s.restored),
            ("kv_tier_restore_seconds", "Seconds spent copying them back", s.restore_s),
            ("kv_tier_disk_reads", "Blocks read back from the disk tier, checked", s.disk_hits),
            ("kv_tier_disk_writes", "Blocks written to the disk tier", s.disk_writes),
            ("kv_tier_disk_rejected", "Disk tier files that failed their check (deleted, "
             "the block computed again)", s.disk_rejected),
            ("kv_tier_dropped_blocks", "Blocks evicted from the lowest tier to nothing",
             s.dropped),
        ):  # fmt: skip
            yield CounterMetricFamily(metric_name("worker", name), doc, value=value)


class SessionHoldCounts(Collector):
    """Session holds (engine/kv_cache/sessions.py, `--kv-session-ttl`), read when
    scraped: sessions whose last turn holds its blocks, those blocks, and holds let go
    for room or after the TTL."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._snapshot()
        yield GaugeMetricFamily(metric_name("worker", "kv_sessions_held"),
                                "Sessions whose last finished turn holds its KV blocks",
                                value=s.sessions_held)  # fmt: skip
        yield GaugeMetricFamily(metric_name("worker", "kv_session_blocks"),
                                "KV blocks those turns hold", value=s.session_blocks)  # fmt: skip
        released = CounterMetricFamily(
            metric_name("worker", "kv_sessions_released"),
            "Session holds let go: for a request's room, or after --kv-session-ttl idle",
            labels=["reason"],
        )
        released.add_metric(["room"], s.sessions_released_for_room)
        released.add_metric(["ttl"], s.sessions_expired)
        yield released


class LoraCounts(Collector):
    """LoRA adapters (engine/lora/), read when scraped: per adapter, its requests,
    prompt and generated tokens, copies into a device slot, evictions from one, reads
    from its directory and requests that waited for a slot; whether it is in a slot now."""

    _COUNTERS = (
        ("lora_requests", "Requests for a LoRA adapter", "requests"),
        ("lora_prompt_tokens", "Prompt tokens of a LoRA adapter's requests", "prompt_tokens"),
        ("lora_generated_tokens", "Tokens generated with a LoRA adapter", "generated_tokens"),
        ("lora_loads", "Copies of a LoRA adapter into a device slot", "loads"),
        ("lora_evictions", "Evictions of a LoRA adapter from its device slot", "evictions"),
        ("lora_reads", "Reads of a LoRA adapter from its directory into host memory",
         "host_loads"),
        ("lora_slot_waits", "Requests that waited for a LoRA slot (--max-loras)", "slot_waits"),
    )  # fmt: skip

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._snapshot()
        for name, doc, attr in self._COUNTERS:
            family = CounterMetricFamily(metric_name("worker", name), doc, labels=["adapter"])
            for adapter, stats in sorted(s.loras.items()):
                family.add_metric([adapter], getattr(stats, attr))
            yield family
        resident = GaugeMetricFamily(metric_name("worker", "lora_resident"),
                                     "1 for a LoRA adapter in a device slot now",
                                     labels=["adapter"])  # fmt: skip
        for adapter in s.lora_resident:
            resident.add_metric([adapter], 1)
        yield resident


def process_started() -> float:
    """Unix time this process started (to the second, from /proc), or now where the
    platform does not say."""
    for family in ProcessCollector(registry=None).collect():
        if family.name == "process_start_time_seconds" and family.samples:
            return float(family.samples[0].value)
    return time.time()


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        # how long a worker takes to become ready (process start to registration in
        # discovery: imports, weights, KV pool, warm-up) sets how far ahead a planner
        # must scale; the planner's dashboard shows both per worker
        self.started_at = process_started()
        self.start_time = gauge(
            self.registry, "worker", "start_time_seconds", "Unix time the worker's process started"
        )
        self.start_time.set(self.started_at)
        self.ready_seconds = gauge(
            self.registry,
            "worker",
            "ready_seconds",
            "Seconds from the process's start to its registration in discovery (ready to "
            "serve); 0 until then",
        )
        self.kernels = info(
            self.registry,
            "worker",
            "kernels",
            "Device, dtype, CPU ISA level and the kernel path of each op",
        )
        # read from the engine's last snapshot when scraped (`WorkerRuntime.start`)
        self.kv_used_blocks = gauge(
            self.registry, "worker", "kv_used_blocks", "KV blocks held by requests now"
        )
        self.kv_total_blocks = gauge(self.registry, "worker", "kv_total_blocks", "KV blocks")
        self.prefix_hit_rate = gauge(
            self.registry,
            "worker",
            "prefix_hit_rate",
            "Share of prompt tokens served from this worker's prefix cache",
        )

    def registered(self, now: float | None = None) -> None:
        """The worker joined discovery: record its time to ready."""
        now = time.time() if now is None else now
        self.ready_seconds.set(max(now - self.started_at, 0.0))

    def watch_tensor_parallel(
        self, size: int, counts: Callable[[], tuple[int, float, int]]
    ) -> None:
        """Export a tensor-parallel engine's collectives (`counts`: how many, seconds,
        bytes)."""
        self.registry.register(TensorParallel(size, counts))

    def watch_expert_load(self, stats: Callable[[], ExpertLoadStats | None]) -> None:
        """Export a mixture of experts' routing imbalance (`stats`: the snapshot's)."""
        self.registry.register(ExpertLoad(stats))

    def watch_kv_tiers(self, stats: Callable[[], TierStats | None]) -> None:
        """Export the KV tiers' counts (`stats`: the snapshot's)."""
        self.registry.register(KvTierCounts(stats))

    def watch_sessions(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Export the engine's session holds (`snapshot`: the engine's)."""
        self.registry.register(SessionHoldCounts(snapshot))

    def watch_loras(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Export the LoRA adapters' counters (`snapshot`: the engine's)."""
        self.registry.register(LoraCounts(snapshot))

    def watch_speculation(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        """Export speculative decoding's counters (`counts`: steps, drafted, accepted)."""
        self.registry.register(Speculation(counts))

    def watch_queue(self, rejected: Callable[[], dict[str, int]]) -> None:
        """Export the prefill queue's rejections (`rejected`: its `stats.rejected`)."""
        doc = "Prefill-queue messages and dead letters dropped as not this deployment's"
        self.registry.register(ByReason(("worker", "queue_rejected"), doc, REJECTIONS, rejected))

    def watch_transfer(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the transfer agent's failure counters (`stats`: `Agent.stats`)."""
        doc = "KV transfers that failed and peers' connections or messages refused, by reason"
        name = ("transfer", "failures")
        self.registry.register(ByReason(name, doc, TRANSFER_FAILURES, stats))

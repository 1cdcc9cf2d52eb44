"""The metrics every worker exports; each role adds its own on the same registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from runtime.metrics import gauge, info, metric_name, new_registry

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
)


class TransferFailures(Collector):
    """Reads the agent's counters when scraped (they live in the transfer layer, which
    knows nothing of Prometheus)."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            metric_name("transfer", "failures"),
            "KV transfers that failed and peers' connections or messages refused, by reason",
            labels=["reason"],
        )
        stats = self._stats()
        for reason in TRANSFER_FAILURES:
            family.add_metric([reason], stats.get(reason, 0))
        yield family


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
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

    def watch_transfer(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the transfer agent's failure counters (`stats`: `Agent.stats`)."""
        self.registry.register(TransferFailures(stats))

"""The metrics every worker exports; each role adds its own on the same registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from runtime.metrics import gauge, info, new_registry


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

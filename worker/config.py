"""Settings every worker process has, whatever its role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig


@dataclass
class WorkerConfig:
    """Who the worker is, where its control plane is, its engine and its transfer agent.

    `metrics_port=None` serves no metrics (0: any free port). `queue_ack_wait` and
    `queue_max_deliveries` configure the prefill queue's consumer (JetStream: the
    stream's; embedded: the local queue's), and must agree across the fleet.
    `host` is the address every listener binds (gRPC, metrics, the transfer agent's);
    `advertise_host`, if set, the one written into discovery for others to dial (a pod's
    IP when binding 0.0.0.0).
    `drain_timeout` bounds a graceful stop (SIGTERM, a scale-down): the worker leaves
    discovery at once, takes no new work, and gives what it holds that long to finish.
    """

    worker_id: str = "worker-0"
    namespace: str = "default"
    discovery_url: str = "embedded"
    queue_url: str = "embedded"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    metrics_port: int | None = 0
    transfer_backend: str | tuple[str, ...] = "shm"
    transfer_options: dict[str, Any] = field(default_factory=dict)
    queue_ack_wait: float = 10.0
    queue_max_deliveries: int = 3
    drain_timeout: float = 60.0

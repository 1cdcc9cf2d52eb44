"""Settings every worker process has, whatever its role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from protocol.declare import check_fields, spec

TRANSFER_BACKENDS = ("shm", "tcp", "nixl", "ucx", "auto")


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

    worker_id: str = spec("worker-0", help="this worker's name in discovery")
    namespace: str = "default"
    discovery_url: str = "embedded"
    queue_url: str = "embedded"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = spec("127.0.0.1", help="address to bind and advertise")
    advertise_host: str | None = spec(
        None,
        help="address others dial, written into discovery (default: --host; needed when "
        "--host is 0.0.0.0, e.g. the pod IP on Kubernetes)",
    )
    metrics_port: int | None = spec(0, lo=0, hi=65535, help="Prometheus port (0 = any free)")
    transfer_backend: str | tuple[str, ...] = spec(
        "shm", flag="transfer", choices=TRANSFER_BACKENDS,
        help="KV transfer backend between prefill and decode workers",
    )  # fmt: skip
    transfer_options: dict[str, Any] = field(default_factory=dict)
    queue_ack_wait: float = spec(10.0, lo=0.0, lo_open=True)
    queue_max_deliveries: int = spec(3, lo=1)
    otlp_endpoint: str | None = spec(
        None,
        help="send OpenTelemetry traces of each request (OTLP over HTTP) to this collector, "
        "e.g. http://localhost:4318 (default: OTEL_EXPORTER_OTLP_ENDPOINT if set, else off)",
    )
    drain_timeout: float = spec(
        60.0, lo=0.0,
        help="seconds a stopping worker gives what it holds to finish (after leaving "
        "discovery and taking no new work)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self)

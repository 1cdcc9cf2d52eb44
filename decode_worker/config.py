"""Settings of one decode worker process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import EngineConfig


@dataclass
class DecodeWorkerConfig:
    """A decode worker: its engine, where it registers, and when it disaggregates.

    Remote prefill is tried only when all hold: `remote_prefill` is on, a prefill
    worker is registered, the prefill queue holds fewer than `max_queue_depth`
    requests, and the prompt's uncached part has at least `min_remote_prefill_tokens`.
    A remote prefill not notified by `remote_prefill_timeout` s (its deadline) is
    given up `late_write_grace` s later, when no write can land any more, and the
    prompt is prefilled locally.
    """

    worker_id: str = "decode-0"
    namespace: str = "default"
    discovery_url: str = "embedded"
    queue_url: str = "embedded"
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = 0
    transfer_backend: str | tuple[str, ...] = "shm"
    transfer_options: dict[str, Any] = field(default_factory=dict)
    remote_prefill: bool = True
    min_remote_prefill_tokens: int = 128
    max_queue_depth: int = 64
    remote_prefill_timeout: float = 30.0
    late_write_grace: float = 2.0
    queue_ack_wait: float = 10.0
    queue_max_deliveries: int = 3

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 1:
            raise ValueError("min_remote_prefill_tokens must be >= 1")
        if self.max_queue_depth < 1:
            raise ValueError("max_queue_depth must be >= 1")
        if self.remote_prefill_timeout <= 0 or self.late_write_grace < 0:
            raise ValueError("remote_prefill_timeout must be > 0 and late_write_grace >= 0")

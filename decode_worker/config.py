"""Settings of one decode worker process."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import WorkerConfig


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker: the common worker settings, its gRPC port, and when it disaggregates.

    Remote prefill is tried only when all hold: `remote_prefill` is on, a prefill
    worker is registered, the prefill queue holds fewer than `max_queue_depth`
    requests, the prompt's uncached part has at least `min_remote_prefill_tokens`, and
    it is at least `min_remote_prefill_share` of the prompt or `max_local_prefill_tokens`
    long (`engine.request.RemoteRule`: a worker holding most of a prompt prefills the
    rest itself).
    A remote prefill not notified by `remote_prefill_timeout` s (its deadline) is
    given up `late_write_grace` s later, when no write can land any more, and the
    prompt is prefilled locally.

    With `prefill_affinity` a remote prefill prefers the prefill worker whose cache
    holds most of its prompt (when that saves work), and goes to every prefill worker
    if that one has not taken it within `prefill_affinity_wait` s.
    """

    worker_id: str = "decode-0"
    served_model_name: str | None = None
    port: int = 0
    remote_prefill: bool = True
    min_remote_prefill_tokens: int = 128
    min_remote_prefill_share: float = 0.5
    max_local_prefill_tokens: int = 4096
    max_queue_depth: int = 64
    # Requests queued here beyond those the engine runs before refusing more
    # (RESOURCE_EXHAUSTED); None: no bound.
    max_queued_requests: int | None = 256
    remote_prefill_timeout: float = 30.0
    late_write_grace: float = 2.0
    prefill_affinity: bool = True
    prefill_affinity_wait: float = 1.0

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 1:
            raise ValueError("min_remote_prefill_tokens must be >= 1")
        if not 0.0 <= self.min_remote_prefill_share <= 1.0:
            raise ValueError("min_remote_prefill_share must be in [0, 1]")
        if self.max_local_prefill_tokens < self.min_remote_prefill_tokens:
            raise ValueError("max_local_prefill_tokens must be >= min_remote_prefill_tokens")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1 (or None)")
        if self.max_queue_depth < 1:
            raise ValueError("max_queue_depth must be >= 1")
        if self.prefill_affinity_wait <= 0:
            raise ValueError("prefill_affinity_wait must be > 0")
        if self.remote_prefill_timeout <= 0 or self.late_write_grace < 0:
            raise ValueError("remote_prefill_timeout must be > 0 and late_write_grace >= 0")

"""Settings of one prefill worker process."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import WorkerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    """A prefill worker: the common worker settings and how much it takes at once.

    `max_batch` requests are prefilled concurrently (the engine batches them under
    its token budget); those that prefer this worker (it holds most of their prompt)
    are taken first. A write into a decode worker's blocks is started only while
    `write_margin` s remain before the request's deadline; later, the worker sends
    a refusal instead, so the decode worker can reuse the blocks at once.
    """

    worker_id: str = "prefill-0"
    port: int = 0  # gRPC: its KV events and load for decode workers, and Health
    max_batch: int = 8
    write_margin: float = 1.0
    write_timeout: float = 30.0
    decode_lookup_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.write_margin < 0 or self.write_timeout <= 0:
            raise ValueError("write_margin must be >= 0 and write_timeout > 0")

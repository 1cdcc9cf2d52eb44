"""Settings of one prefill worker process."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.declare import spec
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

    worker_id: str = spec("prefill-0", help="this worker's name in discovery")
    # gRPC: its KV events and load for decode workers, and Health
    port: int = spec(
        0, lo=0, hi=65535, help="gRPC port of its KV events for decode workers (0 = any free)"
    )
    max_batch: int = spec(8, lo=1, help="prompts a prefill worker takes at once")
    write_margin: float = spec(1.0, lo=0.0)
    write_timeout: float = spec(30.0, lo=0.0, lo_open=True)
    decode_lookup_timeout: float = spec(5.0, lo=0.0, lo_open=True)

"""Settings of one decode worker process."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.declare import spec
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

    With `kv_peer_pull`, a request the router sends here while another decode worker
    holds more of its prompt has that worker write those blocks into this one's pool
    (decode_worker/peer_kv.py), given up after `peer_pull_timeout` s.
    """

    worker_id: str = spec("decode-0", help="this worker's name in discovery")
    served_model_name: str | None = spec(None, help="the model's name in this worker's record")
    port: int = spec(0, lo=0, hi=65535, help="gRPC port of the request plane (0 = any free)")
    remote_prefill: bool = spec(
        True, flag="no-remote-prefill", help="always prefill on the decode worker"
    )
    min_remote_prefill_tokens: int = spec(
        128, lo=1, help="prefill remotely only when at least this many prompt tokens are uncached"
    )
    min_remote_prefill_share: float = spec(
        0.5, lo=0.0, hi=1.0,
        help="...and they are at least this share of the prompt (a worker holding most of a "
        "prompt, a conversation's history, prefills the rest itself)",
    )  # fmt: skip
    max_local_prefill_tokens: int = spec(
        4096, lo=1, help="...unless at least this many are uncached: then remotely whatever is held"
    )
    max_queue_depth: int = spec(64, lo=1, help="prefill locally beyond this queue depth")
    # Requests queued here beyond those the engine runs before refusing more
    # (RESOURCE_EXHAUSTED); None: no bound.
    max_queued_requests: int | None = spec(
        256, lo=1,
        help="a decode worker refuses (RESOURCE_EXHAUSTED: the frontend tries another, "
        "then answers 429) a request beyond this many queued behind those it runs",
    )  # fmt: skip
    remote_prefill_timeout: float = spec(
        30.0, lo=0.0, lo_open=True,
        help="seconds before a remote prefill is given up and done locally",
    )  # fmt: skip
    late_write_grace: float = spec(
        2.0, lo=0.0,
        help="seconds past a remote prefill's deadline before its blocks are reused: the "
        "longest a write already in flight may take to land",
    )  # fmt: skip
    prefill_affinity: bool = spec(
        True, flag="no-prefill-affinity",
        help="send every remote prefill to the shared queue, not first to the prefill "
        "worker whose cache holds most of it",
    )  # fmt: skip
    prefill_affinity_wait: float = spec(
        1.0, lo=0.0, lo_open=True,
        help="seconds a remote prefill waits for the prefill worker it prefers before any "
        "may take it",
    )  # fmt: skip

    kv_peer_pull: bool = spec(
        True, flag="no-kv-peer-pull",
        help="compute every prompt block this worker lacks, even when the router says "
        "another decode worker holds it (by default that worker writes it here)",
    )  # fmt: skip
    min_peer_pull_blocks: int = spec(
        1, lo=1, help="pull a prefix from a peer only when it holds at least this many "
        "more blocks of the prompt than this worker",
    )  # fmt: skip
    peer_pull_timeout: float = spec(
        5.0, lo=0.0, lo_open=True,
        help="seconds a prefix pull from a peer may take before the prompt goes on without it",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_local_prefill_tokens < self.min_remote_prefill_tokens:
            raise ValueError("max_local_prefill_tokens must be >= min_remote_prefill_tokens")

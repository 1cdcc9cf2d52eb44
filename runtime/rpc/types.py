"""The request plane's Python types: what the frontend sends and what a decode worker streams.

These are the types roles program against, and (at the end) their mapping to and from
the protobuf messages of diptych_runtime.proto, which only the client and the servicer
call.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from protocol import declare
from protocol.declare import check_request_id, check_token_ids, from_pb, to_pb
from protocol.logprobs import TokenLogprob, TopLogprob
from protocol.lora import AdapterRef
from protocol.outcomes import FinishReason
from protocol.sampling import SamplingParams
from runtime.errors import ControlPlaneError, InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb

MAX_SAMPLING_BYTES = 2 << 20  # a grammar of up to 1 Mi characters, escaped


class ErrorCode(str, enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    UNIMPLEMENTED = "unimplemented"

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return getattr(grpc.StatusCode, self.name)

    @classmethod
    def from_grpc(cls, status: grpc.StatusCode) -> ErrorCode:
        return cls.__members__.get(status.name, cls.INTERNAL)


# A request that failed with one of these may be sent to another worker (or, once tokens
# have streamed, migrated: prompt plus tokens so far replayed elsewhere).
RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED})


class GenerateError(ControlPlaneError):
    """A Generate stream failed; ``code`` says how, ``retryable`` whether elsewhere may work."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    cache_salt: str = ""
    session_id: str = ""  # the conversation a turn belongs to (X-Session-Id or user), "" none
    # Another decode worker the router saw hold more of the prompt than the chosen one,
    # and how many of its blocks: the chosen worker may pull them (decode_worker/peer_kv.py).
    # The decode worker reads them before the engine sees the request ("worker").
    kv_peer: str = field(default="", metadata={"worker": True})
    kv_peer_blocks: int = field(default=0, metadata={"worker": True})
    # The LoRA adapter (protocol/lora.py), both empty for the base model
    lora_name: str = ""
    lora_path: str = ""
    # The W3C trace context of the call (runtime/tracing.py), "" untraced. It travels in
    # the call's metadata, not in the message: the servicer sets it to its own span's.
    traceparent: str = field(default="", compare=False, metadata={"local": True})

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        object.__setattr__(
            self, "prompt_token_ids", check_token_ids("prompt_token_ids", self.prompt_token_ids)
        )
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidInput("sampling must be a SamplingParams")
        p = self.priority
        if isinstance(p, bool) or not isinstance(p, int) or not -(2**31) <= p < 2**31:
            raise InvalidInput(f"priority must be a 32-bit integer, got {p!r}")
        b = self.kv_peer_blocks
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**31:
            raise InvalidInput(f"kv_peer_blocks must be an integer in [0, 2**31), got {b!r}")
        for name in ("cache_salt", "session_id", "kv_peer"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 256:
                raise InvalidInput(f"{name} must be a string of at most 256 characters")
        if not isinstance(self.traceparent, str) or len(self.traceparent) > 64:
            raise InvalidInput("traceparent must be a string of at most 64 characters")
        adapter_of(self.lora_name, self.lora_path)  # validated

    @property
    def lora(self) -> AdapterRef | None:
        return adapter_of(self.lora_name, self.lora_path)


def adapter_of(name: str, path: str) -> AdapterRef | None:
    """The LoRA adapter a message's `lora_name` and `lora_path` carry, checked; None for
    the base model (whose requests never run protocol/lora.py's code)."""
    if not name and not path:
        return None
    return AdapterRef.of(name, path)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    remote_prefill: bool = False
    reasoning_tokens: int = 0  # completion tokens that were thinking (engine/reasoning.py)


@dataclass(frozen=True)
class GenerateChunk:
    """New tokens (possibly several); the last chunk has ``finish_reason`` and ``usage``."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # empty, or one per token id
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ServingStatus(str, enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"
    DRAINING = "draining"  # finishing its requests, takes no new ones


# keys of `LoadReport.extra`: what a hit in the worker's host or disk tier costs against
# computing the block, as it measured (`TierStats.restore_cost`); routers price hits by it
HOST_COST = "kv_restore_cost_host"
DISK_COST = "kv_restore_cost_disk"


@dataclass(frozen=True)
class LoadReport:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    remote_prefills_in_flight: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    active_requests: int = 0  # admitted, not finished (remote prefills waited for too)
    prefill_tokens_pending: int = 0  # prompt tokens still to prefill here
    active_tokens: int = 0  # context of the active requests (prompt + output so far)
    lora_resident: tuple[str, ...] = ()  # LoRA adapters in the worker's device slots

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    def run_slots(self, max_running: int) -> int:
        return run_slots(self.running_requests, self.waiting_requests, max_running)


def run_slots(running: int, waiting: int, max_running: int) -> int:
    """The requests a worker runs, or is about to: while nothing waits, a burst fills
    the free slots up to ``max_running`` at its next step, before a report says so. The
    worker's capacity gate and the frontends' admission both count a request beyond
    these as queued."""
    return running if waiting else max(running, max_running)


@dataclass(frozen=True)
class HealthReport:
    status: ServingStatus
    worker_id: str = ""
    incarnation_id: str = ""
    message: str = ""
    load: LoadReport = field(default_factory=LoadReport)
    requests_in_flight: int = 0  # filled in by the server


# -- worker events ------------------------------------------------------------------------
# KV events carry sequence numbers 1, 2, 3... per incarnation. A subscriber first receives a
# KvSnapshot (the whole cached set, with the sequence of the last event it includes), then
# every later event. Block hashes are chained (each covers its whole prefix), so a router
# only needs set membership to score a prompt's prefix.


@dataclass(frozen=True)
class KvSnapshot:
    incarnation_id: str
    sequence: int
    block_hashes: frozenset[int]  # every block held, in the pool or a tier under it
    # those held only in a tier under the pool, and the tier (protocol.KvTier)
    lower: Mapping[int, int] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class KvStored:
    incarnation_id: str
    sequence: int
    block_hashes: tuple[int, ...]  # in prompt order
    parent_hash: int | None = None  # None: the chain starts at the root
    # where the blocks are now (protocol.KvTier): a block the pool let go of into a tier
    # is stored again with that tier, one restored with the pool's
    tier: int = 0


@dataclass(frozen=True)
class KvRemoved:
    incarnation_id: str
    sequence: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvCleared:
    incarnation_id: str
    sequence: int


@dataclass(frozen=True)
class LoadUpdate:
    incarnation_id: str
    sequence: int  # of the last KV event sent before it
    load: LoadReport


WorkerEvent = KvSnapshot | KvStored | KvRemoved | KvCleared | LoadUpdate


# -- to and from protobuf -------------------------------------------------------------

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_ERROR_TO_PB = {
    code: getattr(pb, f"ERROR_CODE_{code.name}")
    for code in ErrorCode
    if hasattr(pb, f"ERROR_CODE_{code.name}")
}
_ERROR_FROM_PB = {v: k for k, v in _ERROR_TO_PB.items()}
_STATUS_TO_PB = {s: getattr(pb, f"SERVING_STATUS_{s.name}") for s in ServingStatus}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}


# -- Generate -----------------------------------------------------------------------------
def request_to_bytes(req: GenerateRequest) -> bytes:
    msg = to_pb(req, pb.GenerateRequest, sampling=encode_sampling(req.sampling))
    return msg.SerializeToString()


def request_from_bytes(data: bytes, traceparent: str = "") -> GenerateRequest:
    """Parse and validate; raises :class:`InvalidInput` naming what is wrong.
    ``traceparent``: the trace context the call's metadata carried."""
    msg = pb.GenerateRequest()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InvalidInput(f"malformed GenerateRequest ({len(data)} bytes): {e}") from None
    return from_pb(
        GenerateRequest, msg, sampling=decode_sampling(msg.sampling), traceparent=traceparent
    )


def encode_sampling(s: SamplingParams) -> bytes:
    return declare.dumps(s)


def decode_sampling(data: bytes) -> SamplingParams:
    """Validated by the declaration; InvalidInput names the field."""
    if len(data) > MAX_SAMPLING_BYTES:
        raise InvalidInput(f"sampling parameters of {len(data)} bytes are too large")
    try:
        return declare.loads(SamplingParams, data or b"{}", "sampling")  # unset: defaults
    except (TypeError, ValueError) as e:  # the declaration's own checks
        raise InvalidInput(str(e)) from None


def chunk_to_pb(chunk: GenerateChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(token_ids=chunk.token_ids)
    for lp in chunk.logprobs:
        entry = msg.logprobs.add(logprob=lp.logprob, rank=lp.rank)
        for alt in lp.top:
            entry.top.add(token_id=alt.token_id, logprob=alt.logprob)
    if chunk.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[chunk.finish_reason]
    if chunk.usage is not None:
        msg.usage.CopyFrom(usage_to_pb(chunk.usage))
    return msg


def usage_to_pb(u: Usage) -> pb.Usage:
    return to_pb(u, pb.Usage)


def error_to_pb(code: ErrorCode, message: str, usage: Usage | None) -> pb.GenerateResponse:
    msg = chunk_to_pb(GenerateChunk(finish_reason=FinishReason.ERROR, usage=usage))
    msg.error.CopyFrom(
        pb.Error(code=_ERROR_TO_PB.get(code, pb.ERROR_CODE_INTERNAL), message=message)
    )
    return msg


def chunk_from_pb(msg: pb.GenerateResponse) -> GenerateChunk | tuple[ErrorCode, str]:
    """A chunk, or ``(code, message)`` when the worker reported an error."""
    if msg.finish_reason == pb.FINISH_REASON_ERROR or msg.HasField("error"):
        return _ERROR_FROM_PB.get(msg.error.code, ErrorCode.INTERNAL), msg.error.message
    if msg.logprobs and len(msg.logprobs) != len(msg.token_ids):
        raise InvalidInput("a chunk carries one logprob per token or none")
    logprobs = tuple(
        TokenLogprob(
            token, lp.logprob, lp.rank, tuple(TopLogprob(a.token_id, a.logprob) for a in lp.top)
        )
        for token, lp in zip(msg.token_ids, msg.logprobs)
    )
    usage = from_pb(Usage, msg.usage) if msg.HasField("usage") else None
    return GenerateChunk(
        token_ids=tuple(msg.token_ids),
        logprobs=logprobs,
        finish_reason=_FINISH_FROM_PB.get(msg.finish_reason),
        usage=usage,
    )


# -- Health and load ----------------------------------------------------------------------
def load_to_pb(load: LoadReport) -> pb.LoadReport:
    return to_pb(load, pb.LoadReport)


def load_from_pb(msg: pb.LoadReport) -> LoadReport:
    return from_pb(LoadReport, msg)


def health_to_pb(report: HealthReport, in_flight: int) -> pb.HealthResponse:
    return to_pb(
        report, pb.HealthResponse, status=_STATUS_TO_PB[report.status],
        load=load_to_pb(report.load), requests_in_flight=in_flight,
    )  # fmt: skip


def health_from_pb(msg: pb.HealthResponse) -> HealthReport:
    status = _STATUS_FROM_PB.get(msg.status, ServingStatus.NOT_SERVING)
    return from_pb(HealthReport, msg, status=status, load=load_from_pb(msg.load))


# -- Events -------------------------------------------------------------------------------
def event_to_pb(event: WorkerEvent, snapshot_part: int) -> list[pb.WorkerEvent]:
    """One event as wire messages; a snapshot is split into parts of ``snapshot_part``
    hashes so that no message nears the size limit, whatever the cache size."""
    inc, seq = event.incarnation_id, event.sequence
    if isinstance(event, KvSnapshot):
        hashes = sorted(event.block_hashes)
        starts = range(0, max(len(hashes), 1), snapshot_part)
        lower = event.lower
        out = []
        for i in starts:
            part = hashes[i : i + snapshot_part]
            below = [h for h in part if h in lower] if lower else []
            snap = pb.KvSnapshot(
                block_hashes=part, last=i + snapshot_part >= len(hashes),
                lower_hashes=below, lower_tiers=[lower[h] for h in below],
            )  # fmt: skip
            out.append(pb.WorkerEvent(incarnation_id=inc, sequence=seq, snapshot=snap))
        return out
    if isinstance(event, KvStored):
        stored = pb.KvStored(
            block_hashes=event.block_hashes, parent_hash=event.parent_hash, tier=event.tier
        )
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, stored=stored)]
    if isinstance(event, KvRemoved):
        return [
            pb.WorkerEvent(
                incarnation_id=inc,
                sequence=seq,
                removed=pb.KvRemoved(block_hashes=event.block_hashes),
            )
        ]
    if isinstance(event, KvCleared):
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, cleared=pb.KvCleared())]
    if isinstance(event, LoadUpdate):
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, load=load_to_pb(event.load))]
    raise TypeError(f"not a worker event: {type(event).__name__}")


def event_from_pb(msg: pb.WorkerEvent) -> WorkerEvent | None:
    """A non-snapshot event (snapshots are reassembled by the client); None if unknown."""
    inc, seq = msg.incarnation_id, msg.sequence
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        parent = msg.stored.parent_hash if msg.stored.HasField("parent_hash") else None
        return KvStored(inc, seq, tuple(msg.stored.block_hashes), parent, msg.stored.tier)
    if kind == "removed":
        return KvRemoved(inc, seq, tuple(msg.removed.block_hashes))
    if kind == "cleared":
        return KvCleared(inc, seq)
    if kind == "load":
        return LoadUpdate(inc, seq, load_from_pb(msg.load))
    return None

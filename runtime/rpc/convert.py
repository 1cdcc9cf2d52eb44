"""Mapping between the request plane's Python types (``t``) and their protobuf messages (``pb``)."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.rpc import types as t
from runtime.sampling import SamplingParams

_FINISH_TO_PB = {
    t.FinishReason.STOP: pb.FINISH_REASON_STOP,
    t.FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    t.FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    t.FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_ERROR_TO_PB = {
    code: getattr(pb, f"ERROR_CODE_{code.name}")
    for code in t.ErrorCode
    if hasattr(pb, f"ERROR_CODE_{code.name}")
}
_ERROR_FROM_PB = {v: k for k, v in _ERROR_TO_PB.items()}
_STATUS_TO_PB = {s: getattr(pb, f"SERVING_STATUS_{s.name}") for s in t.ServingStatus}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}


# -- Generate -----------------------------------------------------------------------------
def request_to_bytes(req: t.GenerateRequest) -> bytes:
    return pb.GenerateRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=req.sampling.to_proto(),
        priority=req.priority,
        cache_salt=req.cache_salt,
    ).SerializeToString()


def request_from_bytes(data: bytes) -> t.GenerateRequest:
    """Parse and validate; raises :class:`InvalidInput` naming what is wrong."""
    msg = pb.GenerateRequest()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise InvalidInput(f"malformed GenerateRequest ({len(data)} bytes): {e}") from None
    return t.GenerateRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=SamplingParams.from_proto(msg.sampling),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )


def chunk_to_pb(chunk: t.GenerateChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(token_ids=chunk.token_ids)
    for lp in chunk.logprobs:
        entry = msg.logprobs.add(logprob=lp.logprob)
        for alt in lp.top:
            entry.top.add(token_id=alt.token_id, logprob=alt.logprob)
    if chunk.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[chunk.finish_reason]
    if chunk.usage is not None:
        msg.usage.CopyFrom(usage_to_pb(chunk.usage))
    return msg


def usage_to_pb(u: t.Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        remote_prefill=u.remote_prefill,
    )


def error_to_pb(code: t.ErrorCode, message: str, usage: t.Usage | None) -> pb.GenerateResponse:
    msg = chunk_to_pb(t.GenerateChunk(finish_reason=t.FinishReason.ERROR, usage=usage))
    msg.error.CopyFrom(
        pb.Error(code=_ERROR_TO_PB.get(code, pb.ERROR_CODE_INTERNAL), message=message)
    )
    return msg


def chunk_from_pb(msg: pb.GenerateResponse) -> t.GenerateChunk | tuple[t.ErrorCode, str]:
    """A chunk, or ``(code, message)`` when the worker reported an error."""
    if msg.finish_reason == pb.FINISH_REASON_ERROR or msg.HasField("error"):
        return _ERROR_FROM_PB.get(msg.error.code, t.ErrorCode.INTERNAL), msg.error.message
    logprobs = tuple(
        t.TokenLogprob(lp.logprob, tuple(t.TopLogprob(alt.token_id, alt.logprob) for alt in lp.top))
        for lp in msg.logprobs
    )
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = t.Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.remote_prefill)
    return t.GenerateChunk(
        token_ids=tuple(msg.token_ids),
        logprobs=logprobs,
        finish_reason=_FINISH_FROM_PB.get(msg.finish_reason),
        usage=usage,
    )


# -- Health and load ----------------------------------------------------------------------
def load_to_pb(load: t.LoadReport) -> pb.LoadReport:
    return pb.LoadReport(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_used_blocks=load.kv_used_blocks,
        kv_total_blocks=load.kv_total_blocks,
        remote_prefills_in_flight=load.remote_prefills_in_flight,
        extra=load.extra,
    )


def load_from_pb(msg: pb.LoadReport) -> t.LoadReport:
    return t.LoadReport(
        msg.running_requests, msg.waiting_requests, msg.kv_used_blocks, msg.kv_total_blocks,
        msg.remote_prefills_in_flight, dict(msg.extra),
    )  # fmt: skip


def health_to_pb(report: t.HealthReport, in_flight: int) -> pb.HealthResponse:
    return pb.HealthResponse(
        status=_STATUS_TO_PB[report.status],
        worker_id=report.worker_id,
        incarnation_id=report.incarnation_id,
        message=report.message,
        load=load_to_pb(report.load),
        requests_in_flight=in_flight,
    )


def health_from_pb(msg: pb.HealthResponse) -> t.HealthReport:
    return t.HealthReport(
        status=_STATUS_FROM_PB.get(msg.status, t.ServingStatus.NOT_SERVING),
        worker_id=msg.worker_id,
        incarnation_id=msg.incarnation_id,
        message=msg.message,
        load=load_from_pb(msg.load),
        requests_in_flight=msg.requests_in_flight,
    )


# -- Events -------------------------------------------------------------------------------
def event_to_pb(event: t.WorkerEvent, snapshot_part: int) -> list[pb.WorkerEvent]:
    """One event as wire messages; a snapshot is split into parts of ``snapshot_part``
    hashes so that no message nears the size limit, whatever the cache size."""
    inc, seq = event.incarnation_id, event.sequence
    if isinstance(event, t.KvSnapshot):
        hashes = sorted(event.block_hashes)
        starts = range(0, max(len(hashes), 1), snapshot_part)
        return [
            pb.WorkerEvent(
                incarnation_id=inc,
                sequence=seq,
                snapshot=pb.KvSnapshot(
                    block_hashes=hashes[i : i + snapshot_part],
                    last=i + snapshot_part >= len(hashes),
                ),
            )
            for i in starts
        ]
    if isinstance(event, t.KvStored):
        stored = pb.KvStored(block_hashes=event.block_hashes, parent_hash=event.parent_hash)
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, stored=stored)]
    if isinstance(event, t.KvRemoved):
        return [
            pb.WorkerEvent(
                incarnation_id=inc,
                sequence=seq,
                removed=pb.KvRemoved(block_hashes=event.block_hashes),
            )
        ]
    if isinstance(event, t.KvCleared):
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, cleared=pb.KvCleared())]
    if isinstance(event, t.LoadUpdate):
        return [pb.WorkerEvent(incarnation_id=inc, sequence=seq, load=load_to_pb(event.load))]
    raise TypeError(f"not a worker event: {type(event).__name__}")


def event_from_pb(msg: pb.WorkerEvent) -> t.WorkerEvent | None:
    """A non-snapshot event (snapshots are reassembled by the client); None if unknown."""
    inc, seq = msg.incarnation_id, msg.sequence
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        parent = msg.stored.parent_hash if msg.stored.HasField("parent_hash") else None
        return t.KvStored(inc, seq, tuple(msg.stored.block_hashes), parent)
    if kind == "removed":
        return t.KvRemoved(inc, seq, tuple(msg.removed.block_hashes))
    if kind == "cleared":
        return t.KvCleared(inc, seq)
    if kind == "load":
        return t.LoadUpdate(inc, seq, load_from_pb(msg.load))
    return None

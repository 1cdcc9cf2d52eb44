"""The messages of a remote prefill: its request, the notice that ends it, its failure.

* :class:`RemotePrefillRequest` (decode -> prefill queue) and :class:`DeadLetter`
  (prefill queue -> decode) are protobuf (``RemotePrefillRequest`` / ``DeadLetter`` in
  diptych_runtime.proto): a 128k-token prompt packs into ~400 KB, well inside NATS's
  default 1 MiB message limit, where JSON would need ~900 KB. ``schema_version``
  guards against a breaking change: a reader refuses a message newer than it
  understands, with a message saying so.
* :class:`PrefillNotice` (prefill -> decode) is small JSON, sent as the transfer
  layer's notification after the KV it announces:

  - ``ok=True``: the KV of positions ``[num_cached_tokens, prompt length)`` is in the
    decode worker's blocks, and ``first_token`` (with its logprob when asked) was
    sampled from the prompt's last position.
  - ``ok=False``: nothing was written and nothing will be (the deadline passed, the
    layout did not match...): the decode worker may reuse the blocks at once.

  ``traceparent`` (optional, left out when empty) is the W3C trace context of the
  prefill worker's transfer span, under which the decode worker's adopt span goes; a
  reader of version 3 without it ignores it, so it needed no new version.
  ``prefill_s`` is the prefill worker's compute time; ``write_started_at`` the
  wall-clock time (``time.time()``, the clock request deadlines are already in) at
  which it started the write, so the receiver measures write + delivery as
  ``now - write_started_at``. Version 2 (``"v": 2``) replaced ``transfer_s``, which
  could only be encoded before the write it measured. A notice of another version, or
  one that does not decode, raises :class:`MalformedNotice` carrying the request id
  when that much could be read, so the receiver can settle that one request.
"""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from protocol.declare import (
    check_request_id,
    check_token_ids,
    check_worker_id,
    from_pb,
    json_object,
    to_pb,
)
from protocol.logprobs import TokenLogprob
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams
from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.rpc.types import adapter_of, decode_sampling, encode_sampling

# 2: sampling parameters as protocol.SamplingParams's JSON (a message of its own in 1).
# A new optional field (traceparent) is no new version: older readers skip it.
SCHEMA_VERSION = 2
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class RemotePrefillRequest:
    """Ask the prefill pool to compute a prompt's KV into the decode worker's blocks.

    ``dst_block_ids`` is the decode worker's block table for the whole prompt (entry ``i``
    holds positions ``[i*B, (i+1)*B)`` for its block size ``B``); the prefill worker writes
    positions ``num_cached_tokens`` and later, samples the first token with ``sampling``,
    and must not touch the blocks after ``deadline`` (unix seconds).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    decode_worker_id: str
    decode_incarnation_id: str
    transfer_agent: str
    dst_block_ids: tuple[int, ...]
    num_cached_tokens: int
    deadline: float
    kv_layout_hash: str
    cache_salt: str = ""
    published_at: float = field(default_factory=time.time)
    kv_grant: str = ""  # the decode worker's write grant over the blocks written
    # the W3C trace context of the request's decode-side span: a redelivery carries the
    # same, so every delivery's spans join the one trace ("": untraced)
    traceparent: str = ""
    # the LoRA adapter to prefill with (protocol/lora.py), both empty for the base model
    lora_name: str = ""
    lora_path: str = ""

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        ids = check_token_ids("prompt_token_ids", self.prompt_token_ids)
        object.__setattr__(self, "prompt_token_ids", ids)
        blocks = check_token_ids("dst_block_ids", self.dst_block_ids)  # same range rules
        object.__setattr__(self, "dst_block_ids", blocks)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidInput("sampling must be a SamplingParams")
        check_worker_id(self.decode_worker_id, "decode_worker_id")
        for name in ("decode_incarnation_id", "transfer_agent", "kv_layout_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 1 <= len(value) <= 256:
                raise InvalidInput(f"{name} must be a non-empty string (<= 256 chars)")
        n = self.num_cached_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(ids):
            raise InvalidInput(
                f"num_cached_tokens must be in [0, {len(ids)}) (at least one prompt token "
                f"is left to prefill), got {n!r}"
            )
        if len(blocks) > len(ids):
            raise InvalidInput(
                f"{len(blocks)} dst_block_ids for a {len(ids)}-token prompt: more blocks "
                "than tokens"
            )
        for name in ("deadline", "published_at"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidInput(f"{name} must be a unix time in seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise InvalidInput(f"{name} must be a positive finite unix time, got {value!r}")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > 256:
            raise InvalidInput("cache_salt must be a string of at most 256 characters")
        if not isinstance(self.kv_grant, str) or len(self.kv_grant) > 64:
            raise InvalidInput("kv_grant must be a string of at most 64 characters")
        _check_traceparent(self.traceparent)
        adapter_of(self.lora_name, self.lora_path)  # validated

    @property
    def lora(self) -> AdapterRef | None:
        return adapter_of(self.lora_name, self.lora_path)

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.deadline

    def encode(self) -> bytes:
        return to_pb(
            self, pb.RemotePrefillRequest,
            schema_version=SCHEMA_VERSION, sampling=encode_sampling(self.sampling),
        ).SerializeToString()  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> RemotePrefillRequest:
        msg = _parse(pb.RemotePrefillRequest, data, "RemotePrefillRequest")
        _check_version(msg.schema_version, "RemotePrefillRequest")
        if msg.schema_version < 2:
            raise InvalidInput(
                f"RemotePrefillRequest schema_version {msg.schema_version} carries its sampling "
                "parameters in a form this worker no longer reads; upgrade the decode workers"
            )
        return from_pb(cls, msg, sampling=decode_sampling(msg.sampling))


class DeadLetterReason(enum.IntEnum):
    MAX_DELIVERIES = pb.DEAD_LETTER_REASON_MAX_DELIVERIES
    TERMINATED = pb.DEAD_LETTER_REASON_TERMINATED
    DEADLINE = pb.DEAD_LETTER_REASON_DEADLINE


@dataclass(frozen=True)
class DeadLetter:
    """Sent to the publishing decode worker when its request will never be prefilled."""

    request_id: str
    decode_worker_id: str
    reason: DeadLetterReason
    detail: str = ""
    num_deliveries: int = 0
    failed_at: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return to_pb(
            self, pb.DeadLetter, schema_version=SCHEMA_VERSION, reason=int(self.reason),
            detail=self.detail[:4096],
        ).SerializeToString()  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> DeadLetter:
        msg = _parse(pb.DeadLetter, data, "DeadLetter")
        _check_version(msg.schema_version, "DeadLetter")
        try:
            reason = DeadLetterReason(msg.reason)
        except ValueError:
            raise InvalidInput(f"DeadLetter has an unknown reason {msg.reason}") from None
        return from_pb(
            cls, msg, reason=reason, request_id=check_request_id(msg.request_id),
            decode_worker_id=check_worker_id(msg.decode_worker_id, "decode_worker_id"),
        )  # fmt: skip


def _check_traceparent(value: object) -> None:
    if not isinstance(value, str) or len(value) > 64:
        raise InvalidInput("traceparent must be a string of at most 64 characters")


def _parse(kind: type[M], data: bytes, name: str) -> M:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{name} must be bytes, got {type(data).__name__}")
    msg = kind()
    try:
        msg.ParseFromString(bytes(data))
    except DecodeError as e:
        raise InvalidInput(f"malformed {name} ({len(data)} bytes): {e}") from None
    return msg


def _check_version(version: int, name: str) -> None:
    if version == 0:
        raise InvalidInput(f"{name} has no schema_version: not a Diptych message")
    if version > SCHEMA_VERSION:
        raise InvalidInput(
            f"{name} schema_version {version} is newer than this worker understands "
            f"({SCHEMA_VERSION}); upgrade the prefill workers"
        )


# -- the notice that ends a remote prefill -----------------------------------------

NOTICE_VERSION = 3  # 3: the logprob as protocol.TokenLogprob's compact list
MAX_NOTICE_BYTES = 64 * 1024


class MalformedNotice(InvalidInput):
    """A notice that does not decode; ``request_id`` is its id when that was readable."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class PrefillNotice:
    request_id: str
    ok: bool
    first_token: int = -1
    logprob: TokenLogprob | None = None
    error: str = ""
    prefill_worker_id: str = ""
    prefill_s: float = 0.0
    write_started_at: float = 0.0
    transferred_bytes: int = 0
    traceparent: str = ""

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        _check_traceparent(self.traceparent)
        if not isinstance(self.ok, bool):
            raise InvalidInput("ok must be a boolean")
        if self.ok and (isinstance(self.first_token, bool) or self.first_token < 0):
            raise InvalidInput("a successful prefill notice needs a first_token >= 0")
        for name in ("prefill_s", "write_started_at"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidInput(f"{name} must be a finite number >= 0, got {value!r}")
        if self.transferred_bytes < 0:
            raise InvalidInput("transferred_bytes must be >= 0")
        if self.logprob is not None and self.logprob.token_id != self.first_token:
            raise InvalidInput("the logprob is of another token than first_token")

    def encode(self) -> bytes:
        d: dict[str, Any] = {
            "v": NOTICE_VERSION,
            "request_id": self.request_id,
            "ok": self.ok,
            "first_token": self.first_token,
            "logprob": None if self.logprob is None else self.logprob.to_plain(),
            "error": self.error,
            "prefill_worker_id": self.prefill_worker_id,
            "prefill_s": self.prefill_s,
            "write_started_at": self.write_started_at,
            "transferred_bytes": self.transferred_bytes,
        }
        if self.traceparent:
            d["traceparent"] = self.traceparent
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> PrefillNotice:
        """Parse and validate; raises :class:`MalformedNotice` with the reason."""
        d = json_object(data, "prefill notice", MAX_NOTICE_BYTES, MalformedNotice)
        rid = d.get("request_id")
        rid = rid if isinstance(rid, str) else None
        if d.get("v") != NOTICE_VERSION:
            raise MalformedNotice(
                f"prefill notice of version {d.get('v')!r}, expected {NOTICE_VERSION}", rid
            )
        try:
            return cls(
                request_id=_typed(d, "request_id", str),
                ok=_typed(d, "ok", bool),
                first_token=_typed(d, "first_token", int, -1),
                logprob=None if d.get("logprob") is None else TokenLogprob.from_plain(d["logprob"]),
                error=_typed(d, "error", str, ""),
                prefill_worker_id=_typed(d, "prefill_worker_id", str, ""),
                prefill_s=float(_typed(d, "prefill_s", (int, float), 0.0)),
                write_started_at=float(_typed(d, "write_started_at", (int, float), 0.0)),
                transferred_bytes=_typed(d, "transferred_bytes", int, 0),
                traceparent=_typed(d, "traceparent", str, ""),
            )
        except (InvalidInput, KeyError, TypeError, ValueError) as e:
            raise MalformedNotice(f"malformed prefill notice: {e}", rid) from None


def _typed(d: dict[str, Any], key: str, kind: type | tuple[type, ...], *default: Any) -> Any:
    if key not in d and default:
        return default[0]
    value = d[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{key} has the wrong type ({type(value).__name__})")
    return value

"""The prefill queue's payloads: a remote-prefill request and the notice of its failure.

Encoded as protobuf (``RemotePrefillRequest`` / ``DeadLetter`` in diptych_runtime.proto):
a 128k-token prompt packs into ~400 KB, well inside NATS's default 1 MiB message limit,
where JSON would need ~900 KB. ``schema_version`` guards against a breaking change: a
reader refuses a message newer than it understands, with a message saying so.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.sampling import SamplingParams
from runtime.validation import check_request_id, check_token_ids, check_worker_id

SCHEMA_VERSION = 1
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

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.deadline

    def encode(self) -> bytes:
        return pb.RemotePrefillRequest(
            schema_version=SCHEMA_VERSION,
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling.to_proto(),
            decode_worker_id=self.decode_worker_id,
            decode_incarnation_id=self.decode_incarnation_id,
            transfer_agent=self.transfer_agent,
            dst_block_ids=self.dst_block_ids,
            num_cached_tokens=self.num_cached_tokens,
            deadline=self.deadline,
            cache_salt=self.cache_salt,
            kv_layout_hash=self.kv_layout_hash,
            published_at=self.published_at,
        ).SerializeToString()

    @classmethod
    def decode(cls, data: bytes) -> RemotePrefillRequest:
        msg = _parse(pb.RemotePrefillRequest, data, "RemotePrefillRequest")
        _check_version(msg.schema_version, "RemotePrefillRequest")
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=tuple(msg.prompt_token_ids),
            sampling=SamplingParams.from_proto(msg.sampling),
            decode_worker_id=msg.decode_worker_id,
            decode_incarnation_id=msg.decode_incarnation_id,
            transfer_agent=msg.transfer_agent,
            dst_block_ids=tuple(msg.dst_block_ids),
            num_cached_tokens=msg.num_cached_tokens,
            deadline=msg.deadline,
            kv_layout_hash=msg.kv_layout_hash,
            cache_salt=msg.cache_salt,
            published_at=msg.published_at,
        )


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
        return pb.DeadLetter(
            schema_version=SCHEMA_VERSION,
            request_id=self.request_id,
            decode_worker_id=self.decode_worker_id,
            reason=int(self.reason),  # type: ignore[arg-type]
            detail=self.detail[:4096],
            num_deliveries=self.num_deliveries,
            failed_at=self.failed_at,
        ).SerializeToString()

    @classmethod
    def decode(cls, data: bytes) -> DeadLetter:
        msg = _parse(pb.DeadLetter, data, "DeadLetter")
        _check_version(msg.schema_version, "DeadLetter")
        try:
            reason = DeadLetterReason(msg.reason)
        except ValueError:
            raise InvalidInput(f"DeadLetter has an unknown reason {msg.reason}") from None
        return cls(
            request_id=check_request_id(msg.request_id),
            decode_worker_id=check_worker_id(msg.decode_worker_id, "decode_worker_id"),
            reason=reason,
            detail=msg.detail,
            num_deliveries=msg.num_deliveries,
            failed_at=msg.failed_at,
        )


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

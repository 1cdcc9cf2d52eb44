"""The request plane's Python types: what the frontend sends and what a decode worker streams.

These are the types roles program against; ``convert.py`` maps them to and from the
protobuf messages of diptych_runtime.proto.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from runtime.errors import ControlPlaneError, InvalidInput
from runtime.sampling import SamplingParams
from runtime.validation import check_request_id, check_token_ids


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # aborted through DecodeWorkerClient.abort()
    ERROR = "error"  # only on the wire: the client raises GenerateError instead


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
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > 256:
            raise InvalidInput("cache_salt must be a string of at most 256 characters")


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # of the sampled token
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    remote_prefill: bool = False


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


@dataclass(frozen=True)
class LoadReport:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    remote_prefills_in_flight: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


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
    block_hashes: frozenset[int]


@dataclass(frozen=True)
class KvStored:
    incarnation_id: str
    sequence: int
    block_hashes: tuple[int, ...]  # in prompt order
    parent_hash: int | None = None  # None: the chain starts at the root


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

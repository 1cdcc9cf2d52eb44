"""The request plane: gRPC between the frontend and decode workers."""

from protocol.logprobs import TokenLogprob, TopLogprob
from protocol.outcomes import FinishReason
from runtime.rpc.client import DecodeWorkerClient, GenerateStream, connect_worker, follow_events
from runtime.rpc.limits import ClientOptions, ServerLimits
from runtime.rpc.server import DecodeWorkerServer, GenerateHandler, KvEventPublisher, WorkerHandler
from runtime.rpc.types import (
    RETRYABLE,
    ErrorCode,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    HealthReport,
    KvCleared,
    KvRemoved,
    KvSnapshot,
    KvStored,
    LoadReport,
    LoadUpdate,
    ServingStatus,
    Usage,
    WorkerEvent,
)

__all__ = [
    "RETRYABLE",
    "ClientOptions",
    "DecodeWorkerClient",
    "DecodeWorkerServer",
    "ErrorCode",
    "FinishReason",
    "GenerateChunk",
    "GenerateError",
    "GenerateHandler",
    "GenerateRequest",
    "GenerateStream",
    "HealthReport",
    "KvCleared",
    "KvEventPublisher",
    "KvRemoved",
    "KvSnapshot",
    "KvStored",
    "LoadReport",
    "LoadUpdate",
    "ServerLimits",
    "ServingStatus",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WorkerEvent",
    "WorkerHandler",
    "connect_worker",
    "follow_events",
]

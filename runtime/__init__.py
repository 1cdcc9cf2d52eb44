"""Diptych's control plane: discovery, the prefill queue, the request plane, metrics.

Nothing here is role-specific, and nothing internal is imported. The public names below
load their submodule on first use, so ``import runtime.config`` does not pull in gRPC,
NATS and etcd clients.

* discovery: :func:`make_discovery` -> :class:`Discovery` (``register``, ``list``,
  ``watch``), records are :class:`WorkerInfo` with a :class:`KvLayout`.
* prefill queue: :func:`make_prefill_queue` -> :class:`PrefillQueue` (``publish``,
  ``fetch`` -> :class:`Delivery`, ``dead_letters``), messages are
  :class:`RemotePrefillRequest` and :class:`DeadLetter`.
* request plane: :class:`GenerateHandler` served by :class:`DecodeWorkerServer`, used
  through :class:`DecodeWorkerClient`; :class:`KvEventPublisher` feeds the Events stream.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.config import (
        BackendUrl,
        RuntimeConfig,
        make_discovery,
        make_prefill_queue,
        parse_url,
    )
    from runtime.discovery import (
        Discovery,
        DiscoveryEvent,
        DiscoveryOptions,
        EventKind,
        Registration,
    )
    from runtime.errors import (
        BackendUnavailable,
        ConfigError,
        ControlPlaneError,
        InvalidInput,
        NotConnected,
        PayloadTooLarge,
    )
    from runtime.queue import (
        DeadLetter,
        DeadLetterReason,
        Delivery,
        PrefillQueue,
        PublishResult,
        QueueDepth,
        QueueFull,
        QueueOptions,
        RemotePrefillRequest,
    )
    from runtime.rpc import (
        ClientOptions,
        DecodeWorkerClient,
        DecodeWorkerServer,
        ErrorCode,
        FinishReason,
        GenerateChunk,
        GenerateError,
        GenerateHandler,
        GenerateRequest,
        GenerateStream,
        HealthReport,
        KvCleared,
        KvEventPublisher,
        KvRemoved,
        KvSnapshot,
        KvStored,
        LoadReport,
        LoadUpdate,
        ServerLimits,
        ServingStatus,
        TokenLogprob,
        TopLogprob,
        Usage,
        WorkerEvent,
    )
    from runtime.sampling import (
        SamplingParams,
    )
    from runtime.worker_info import (
        KvLayout,
        TransferInfo,
        WorkerInfo,
        compute_layout_hash,
        new_incarnation_id,
    )

__all__ = [
    "BackendUnavailable",
    "BackendUrl",
    "ClientOptions",
    "ConfigError",
    "ControlPlaneError",
    "DeadLetter",
    "DeadLetterReason",
    "DecodeWorkerClient",
    "DecodeWorkerServer",
    "Delivery",
    "Discovery",
    "DiscoveryEvent",
    "DiscoveryOptions",
    "ErrorCode",
    "EventKind",
    "FinishReason",
    "GenerateChunk",
    "GenerateError",
    "GenerateHandler",
    "GenerateRequest",
    "GenerateStream",
    "HealthReport",
    "InvalidInput",
    "KvCleared",
    "KvEventPublisher",
    "KvLayout",
    "KvRemoved",
    "KvSnapshot",
    "KvStored",
    "LoadReport",
    "LoadUpdate",
    "NotConnected",
    "PayloadTooLarge",
    "PrefillQueue",
    "PublishResult",
    "QueueDepth",
    "QueueFull",
    "QueueOptions",
    "Registration",
    "RemotePrefillRequest",
    "RuntimeConfig",
    "SamplingParams",
    "ServerLimits",
    "ServingStatus",
    "TokenLogprob",
    "TopLogprob",
    "TransferInfo",
    "Usage",
    "WorkerEvent",
    "WorkerInfo",
    "compute_layout_hash",
    "make_discovery",
    "make_prefill_queue",
    "new_incarnation_id",
    "parse_url",
]

_MODULE_OF = {
    "BackendUrl": "runtime.config",
    "RuntimeConfig": "runtime.config",
    "make_discovery": "runtime.config",
    "make_prefill_queue": "runtime.config",
    "parse_url": "runtime.config",
    "Discovery": "runtime.discovery",
    "DiscoveryEvent": "runtime.discovery",
    "DiscoveryOptions": "runtime.discovery",
    "EventKind": "runtime.discovery",
    "Registration": "runtime.discovery",
    "BackendUnavailable": "runtime.errors",
    "ConfigError": "runtime.errors",
    "ControlPlaneError": "runtime.errors",
    "InvalidInput": "runtime.errors",
    "NotConnected": "runtime.errors",
    "PayloadTooLarge": "runtime.errors",
    "DeadLetter": "runtime.queue",
    "DeadLetterReason": "runtime.queue",
    "Delivery": "runtime.queue",
    "PrefillQueue": "runtime.queue",
    "PublishResult": "runtime.queue",
    "QueueDepth": "runtime.queue",
    "QueueFull": "runtime.queue",
    "QueueOptions": "runtime.queue",
    "RemotePrefillRequest": "runtime.queue",
    "ClientOptions": "runtime.rpc",
    "DecodeWorkerClient": "runtime.rpc",
    "DecodeWorkerServer": "runtime.rpc",
    "ErrorCode": "runtime.rpc",
    "FinishReason": "runtime.rpc",
    "GenerateChunk": "runtime.rpc",
    "GenerateError": "runtime.rpc",
    "GenerateHandler": "runtime.rpc",
    "GenerateRequest": "runtime.rpc",
    "GenerateStream": "runtime.rpc",
    "HealthReport": "runtime.rpc",
    "KvCleared": "runtime.rpc",
    "KvEventPublisher": "runtime.rpc",
    "KvRemoved": "runtime.rpc",
    "KvSnapshot": "runtime.rpc",
    "KvStored": "runtime.rpc",
    "LoadReport": "runtime.rpc",
    "LoadUpdate": "runtime.rpc",
    "ServerLimits": "runtime.rpc",
    "ServingStatus": "runtime.rpc",
    "TokenLogprob": "runtime.rpc",
    "TopLogprob": "runtime.rpc",
    "Usage": "runtime.rpc",
    "WorkerEvent": "runtime.rpc",
    "SamplingParams": "runtime.sampling",
    "KvLayout": "runtime.worker_info",
    "TransferInfo": "runtime.worker_info",
    "WorkerInfo": "runtime.worker_info",
    "compute_layout_hash": "runtime.worker_info",
    "new_incarnation_id": "runtime.worker_info",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""What a worker implements to serve gRPC: every worker its health and its KV and load
events (`WorkerHandler`: a prefill worker serves just these); a decode worker the
request plane on top (`GenerateHandler`: Generate and Abort).

Cancellation contract: when the client cancels, disconnects or its deadline passes, the
server closes the handler's iterator (``GeneratorExit`` inside ``generate``) and then calls
``abort(request_id)``; it also calls ``abort`` after a handler error. An engine that hooks
only one of the two still frees the request. The Abort RPC calls ``abort`` and ends the
stream with ``FinishReason.ABORT`` at the next chunk, or after ``abort_grace_s`` if the
handler does not end it.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from runtime.rpc.types import GenerateChunk, GenerateRequest, HealthReport, WorkerEvent


class WorkerHandler(abc.ABC):
    """What every worker serves; the server calls it from its event loop."""

    @abc.abstractmethod
    async def health(self) -> HealthReport: ...

    def events(self) -> AsyncIterator[WorkerEvent]:
        """KV and load events for routers, e.g. ``KvEventPublisher.subscribe()``."""
        raise NotImplementedError


class GenerateHandler(WorkerHandler):
    """What a decode worker implements: the request plane."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's tokens; the last chunk has ``finish_reason`` (and should
        carry ``usage``). Raise :class:`GenerateError` to fail the request with a code.

        Yield every token already produced in one chunk rather than one chunk each: when a
        client reads slower than the engine decodes, chunks then grow instead of queueing,
        and the per-message cost of gRPC is paid once per read, not once per token."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its resources; called once the stream is cancelled or
        aborted, possibly after the request already finished (then do nothing)."""

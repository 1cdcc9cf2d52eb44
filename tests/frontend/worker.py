"""A small decode worker for the frontend tests: the real engine behind the request plane.

:class:`EngineHandler` serves ``runtime.rpc`` Generate streams from an
:class:`engine.AsyncEngine`; several handlers (several "workers", each with its own gRPC
server and discovery record) may share one engine, so the model is loaded once. The
lead's decode worker replaces this in the end-to-end tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from decode_worker.worker import new_request, to_chunk
from engine import AsyncEngine
from runtime.rpc import (
    ErrorCode,
    GenerateChunk,
    GenerateError,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    KvEventPublisher,
    LoadReport,
    ServingStatus,
    WorkerEvent,
)
from runtime.worker_info import new_incarnation_id


class EngineHandler(GenerateHandler):
    def __init__(self, engine: AsyncEngine, worker_id: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.incarnation_id = new_incarnation_id()
        self.publisher = KvEventPublisher(self.incarnation_id)
        self.started: list[str] = []  # request ids, in arrival order
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.fail: Exception | None = None  # raised by the next requests, to test errors
        self.delay_s = 0.0  # before each chunk: a slow worker, for long streams

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        rid = request.request_id
        if self.fail is not None:
            raise self.fail
        try:
            stream = await self.engine.submit(new_request(request))
        except ValueError as e:
            raise GenerateError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        self.started.append(rid)
        self.active.add(rid)
        self._publish_load()
        first = True
        try:
            async for out in stream:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                # the first chunk tells the cached prefix early
                yield to_chunk(out, remote_prefill=False, with_usage=first)
                first = False
        finally:
            stream.close()
            self.active.discard(rid)
            self._publish_load()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.engine.abort(request_id)

    async def health(self) -> HealthReport:
        return HealthReport(ServingStatus.SERVING, self.worker_id, self.incarnation_id)

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.publisher.subscribe()

    def _publish_load(self) -> None:
        self.publisher.update_load(LoadReport(running_requests=len(self.active)))

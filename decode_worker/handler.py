"""The decode worker's request plane: Generate over the engine, with remote prefill."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from decode_worker.convert import engine_params, to_chunk
from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import RemotePrefill
from engine import AsyncEngine
from engine.async_engine import EngineDeadError
from runtime.rpc.events import KvEventPublisher
from runtime.rpc.handler import GenerateHandler
from runtime.rpc.types import (
    ErrorCode,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    HealthReport,
    LoadReport,
    ServingStatus,
    WorkerEvent,
)

log = logging.getLogger(__name__)


class DecodeHandler(GenerateHandler):
    def __init__(
        self,
        engine: AsyncEngine,
        remote: RemotePrefill,
        events: KvEventPublisher,
        metrics: DecodeMetrics,
        worker_id: str,
        incarnation_id: str,
        min_remote_prefill_tokens: int,
    ) -> None:
        self.engine = engine
        self.remote = remote
        self.events_pub = events
        self.metrics = metrics
        self.worker_id = worker_id
        self.incarnation_id = incarnation_id
        self.min_remote = min_remote_prefill_tokens
        self.draining = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self.draining:
            raise GenerateError(ErrorCode.UNAVAILABLE, "this worker is draining")
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            params = engine_params(request.sampling)
            plan = None
            if self.remote.wanted() and len(prompt) >= self.min_remote:
                q, plan = await self.engine.plan_remote(
                    rid,
                    prompt,
                    params,
                    priority=request.priority,
                    cache_salt=request.cache_salt or None,
                    min_uncached=self.min_remote,
                )
            else:
                q = self.engine.add_request(
                    rid,
                    prompt,
                    params,
                    priority=request.priority,
                    cache_salt=request.cache_salt or None,
                )
        except ValueError as e:
            code = ErrorCode.ALREADY_EXISTS if "already in use" in str(e) else None
            raise GenerateError(code or ErrorCode.INVALID_ARGUMENT, str(e)) from None
        except EngineDeadError as e:
            raise GenerateError(ErrorCode.UNAVAILABLE, str(e)) from None
        remote = plan is not None
        self.metrics.requests.labels(prefill="remote" if remote else "local").inc()
        if plan is not None:
            await self.remote.start(request, plan)
        try:
            first = True
            async for out in self.engine.stream(rid, q):
                if out.error:
                    raise GenerateError(ErrorCode.INTERNAL, out.error)
                # usage rides on the first chunk too: a client that stops early (a stop
                # string) still learns the prompt and cached token counts
                yield to_chunk(out, remote, with_usage=first)
                first = False
        except EngineDeadError as e:
            raise GenerateError(ErrorCode.UNAVAILABLE, str(e)) from None
        except RuntimeError as e:  # the engine step failed for this request
            raise GenerateError(ErrorCode.INTERNAL, str(e)) from None

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def health(self) -> HealthReport:
        if not self.engine.alive:
            status = ServingStatus.NOT_SERVING
        elif self.draining:
            status = ServingStatus.DRAINING
        else:
            status = ServingStatus.SERVING
        return HealthReport(
            status=status,
            worker_id=self.worker_id,
            incarnation_id=self.incarnation_id,
            load=self.load(),
        )

    def load(self) -> LoadReport:
        s = self.engine.snapshot
        return LoadReport(
            running_requests=s.running,
            waiting_requests=s.waiting,
            kv_used_blocks=s.kv_used_blocks,
            kv_total_blocks=s.kv_total_blocks,
            remote_prefills_in_flight=len(self.remote.pending),
        )

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.events_pub.subscribe()

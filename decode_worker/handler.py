"""The decode worker's request plane: Generate over the engine, with remote prefill.

One request, top to bottom (`generate`):

    admit      EngineCore.submit: validate, match the prefix cache, and either pin the
               prompt's blocks for a remote prefill (a plan) or queue it to prefill here
    prefill    with a plan: publish it and wait for its outcome (RemotePrefill.prefill),
               which adopts the KV and first token or releases the blocks to prefill here
    stream     the engine's outputs as GenerateChunks until the request finishes
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import RemotePrefill
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.request import DuplicateRequestError
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
from worker.convert import new_request, to_chunk

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
    ) -> None:
        self.engine = engine
        self.remote = remote
        self.events_pub = events
        self.metrics = metrics
        self.worker_id = worker_id
        self.incarnation_id = incarnation_id
        self.draining = False

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if self.draining:
            raise GenerateError(ErrorCode.UNAVAILABLE, "this worker is draining")
        try:
            stream = await self.engine.submit(
                new_request(request), remote_min_uncached=self.remote.min_uncached()
            )
        except DuplicateRequestError as e:
            raise GenerateError(ErrorCode.ALREADY_EXISTS, str(e)) from None
        except ValueError as e:
            raise GenerateError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        except EngineDeadError as e:
            raise GenerateError(ErrorCode.UNAVAILABLE, str(e)) from None
        try:
            remote = False
            if stream.remote_plan is not None:
                remote = await self.remote.prefill(request, stream.remote_plan)
            self.metrics.requests.labels(prefill="remote" if remote else "local").inc()
            first = True
            async for out in stream:
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
        finally:
            stream.close()

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

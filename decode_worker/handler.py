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
        # For routers, sent at once when they change (a step's report comes later):
        # requests admitted and not finished, and the prompt tokens still to prefill here.
        self.active = 0
        self.prefill_pending = 0

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
        prompt_len = len(request.prompt_token_ids)
        plan = stream.remote_plan
        # prompt tokens this worker will prefill for the request: none while remote
        here = 0 if plan is not None else prompt_len - stream.cached_tokens
        self._load_changed(1, here)
        try:
            remote = False
            if plan is not None:
                remote = await self.remote.prefill(request, plan)
                if not remote:  # fell back: the prompt is prefilled here after all
                    here = prompt_len - plan.num_cached_tokens
                    self._load_changed(0, here)
            self.metrics.requests.labels(prefill="remote" if remote else "local").inc()
            first = True
            async for out in stream:
                if out.error:
                    raise GenerateError(ErrorCode.INTERNAL, out.error)
                if here:
                    self._load_changed(0, -here)
                    here = 0
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
            self._load_changed(-1, -here)

    def _load_changed(self, requests: int, prefill_tokens: int) -> None:
        self.active += requests
        self.prefill_pending += prefill_tokens
        self.events_pub.update_load(self.load())

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
            active_requests=self.active,
            prefill_tokens_pending=max(self.prefill_pending, 0),
        )

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.events_pub.subscribe()

"""A small decode worker for the frontend tests: the real engine behind the request plane.

:class:`EngineHandler` serves ``runtime.rpc`` Generate streams from an
:class:`engine.AsyncEngine`; several handlers (several "workers", each with its own gRPC
server and discovery record) may share one engine, so the model is loaded once. The
lead's decode worker replaces this in the end-to-end tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine import AsyncEngine
from engine import SamplingParams as EngineSampling
from runtime.rpc import (
    ErrorCode,
    FinishReason,
    GenerateChunk,
    GenerateError,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    KvEventPublisher,
    LoadReport,
    ServingStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerEvent,
)
from runtime.sampling import SamplingParams
from runtime.worker_info import new_incarnation_id

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def engine_params(p: SamplingParams) -> EngineSampling:
    return EngineSampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        logprobs=p.top_logprobs if p.logprobs else None,
    )


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

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        rid = request.request_id
        if self.fail is not None:
            raise self.fail
        try:
            queue = self.engine.add_request(
                rid, list(request.prompt_token_ids), engine_params(request.sampling)
            )
        except ValueError as e:
            raise GenerateError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        self.started.append(rid)
        self.active.add(rid)
        self._publish_load()
        want_logprobs = request.sampling.logprobs
        first = True
        try:
            async for out in self.engine.stream(rid, queue):
                logprobs: tuple[TokenLogprob, ...] = ()
                if want_logprobs and out.new_logprobs:
                    logprobs = tuple(
                        TokenLogprob(lp.logprob, tuple(TopLogprob(t, v) for t, v in lp.top))
                        for lp in out.new_logprobs
                    )
                usage = None
                if first or out.finished:  # the first chunk tells the cached prefix early
                    usage = Usage(
                        out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens
                    )
                first = False
                finish = _FINISH[out.finish_reason] if out.finished and out.finish_reason else None
                yield GenerateChunk(tuple(out.new_token_ids), logprobs, finish, usage)
        finally:
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

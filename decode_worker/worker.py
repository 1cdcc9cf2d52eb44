"""A decode worker process: the worker runtime, remote prefill, and the gRPC server.

Start-up order matters for the invariants: the runtime allocates the KV pool through
the transfer agent (so prefill workers can write into it) before the engine exists
and follows the prefill pool (only registered prefill agents may write); the worker
subscribes to its dead letters before it publishes anything, and registers in
discovery last, once it can serve.

The decode worker's request plane: Generate over the engine, with remote prefill.

One request, top to bottom (`generate`):

    admit      EngineCore.submit: validate, match the prefix cache, and either pin the
               prompt's blocks for a remote prefill (a plan) or queue it to prefill here
    prefill    with a plan: publish it and wait for its outcome (RemotePrefill.prefill),
               which adopts the KV and first token or releases the blocks to prefill here
    stream     the engine's outputs as GenerateChunks until the request finishes
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import KW_ONLY, dataclass, field

from decode_worker.config import DecodeWorkerConfig
from decode_worker.metrics import DecodeMetrics
from decode_worker.peer_kv import PeerKv
from decode_worker.remote_prefill import PrefillAffinity, RemotePrefill
from engine.async_engine import AsyncEngine, EngineDeadError, EngineStream
from engine.engine_core import EngineCore
from engine.request import DuplicateRequestError, NewRequest, RequestOutput
from protocol.kv_layout import KvTier
from protocol.outcomes import FinishReason
from runtime.discovery.members import RoleMembers
from runtime.rpc.handler import GenerateHandler
from runtime.rpc.limits import ServerLimits
from runtime.rpc.server import DecodeWorkerServer, KvEventPublisher
from runtime.rpc.types import (
    DISK_COST,
    HOST_COST,
    ErrorCode,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    HealthReport,
    LoadReport,
    ServingStatus,
    Usage,
    WorkerEvent,
    run_slots,
)
from runtime.tracing import Span
from runtime.worker_info import WorkerInfo
from worker.assembly import WorkerRole, WorkerRuntime


@dataclass(eq=False)
class DecodeHandler(GenerateHandler):
    engine: AsyncEngine
    remote: RemotePrefill
    events_pub: KvEventPublisher
    metrics: DecodeMetrics
    worker_id: str
    incarnation_id: str
    _: KW_ONLY
    max_queued: int | None = None  # beyond the engine's running requests
    max_active: int = ServerLimits().max_inflight_requests  # a bound on the memory held
    max_running: int = 0  # the engine's batch (max_num_seqs): free slots are not a queue
    peer_kv: PeerKv | None = None  # prefix pulls from other decode workers, when on
    draining: bool = field(default=False, init=False)
    # For routers, sent at once when they change (a step's report comes later):
    # requests admitted and not finished, and the prompt tokens still to prefill here.
    active: int = field(default=0, init=False)
    prefill_pending: int = field(default=0, init=False)
    active_tokens: int = field(default=0, init=False)  # their context: prompt and output

    def _admit(self) -> None:
        """This worker's one capacity gate (the request plane and the engine only check
        what a request is): draining, or full (requests queued behind those running,
        or in flight at all), it refuses at once and the frontend tries another worker
        (RESOURCE_EXHAUSTED; with every worker full, a 429)."""
        if self.draining:
            raise GenerateError(ErrorCode.UNAVAILABLE, "this worker is draining")
        s = self.engine.snapshot
        queued = self.active - run_slots(s.running, s.waiting, self.max_running)
        if self.max_queued is not None and queued >= self.max_queued:
            why = f"{queued} requests queued (its bound is {self.max_queued})"
        elif self.active >= self.max_active:
            why = f"{self.active} requests in flight (its bound is {self.max_active})"
        else:
            return
        self.metrics.refused.inc()
        raise GenerateError(ErrorCode.RESOURCE_EXHAUSTED, f"this worker has {why}")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._admit()
        ids = request.prompt_token_ids
        n = len(ids)
        # The request counts in the load routers see from its arrival, not from its
        # admission between two engine steps: a router in another frontend learns of it
        # one network hop after it was sent here. Its prefill is estimated from the
        # cache until the engine's own match says.
        salt = request.cache_salt or None
        lora = request.lora
        share = _Share(self, n, n - self.engine.snapshot.prefix_hit(ids, salt, lora))
        try:
            if request.kv_peer and self.peer_kv is not None:  # before the prefix match
                await self.peer_kv.pull(request)
            try:
                stream = await self.engine.submit(
                    new_request(request), remote_min_uncached=self.remote.rule(lora)
                )
            except DuplicateRequestError as e:
                raise GenerateError(ErrorCode.ALREADY_EXISTS, str(e)) from None
            except ValueError as e:
                raise GenerateError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
            except EngineDeadError as e:
                raise GenerateError(ErrorCode.UNAVAILABLE, str(e)) from None
            # closed at once when the caller stops early: that aborts the request
            async with contextlib.aclosing(self._stream(request, stream, share)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            share.end()

    async def _stream(
        self, request: GenerateRequest, stream: EngineStream, share: _Share
    ) -> AsyncGenerator[GenerateChunk, None]:
        n = len(request.prompt_token_ids)
        plan = stream.remote_plan
        share.prefill_here(0 if plan is not None else n - stream.cached_tokens)  # remote: none
        adopt: Span | None = None  # the remote prefill's adopt span, until the first token
        try:
            if plan is not None:
                adopt = await self.remote.prefill(request, plan)
                if adopt is None:  # fell back: the prompt is prefilled here after all
                    share.prefill_here(n - plan.num_cached_tokens)
            remote = adopt is not None
            self.metrics.requests.labels(prefill="remote" if remote else "local").inc()
            first = True
            # thinking tokens counted so far: from the first output on (a migrated
            # request's earlier thinking was counted by the worker that generated it)
            thought: int | None = None
            async for out in stream:
                if thought is None:
                    thought = max(out.num_reasoning_tokens - len(out.new_token_ids), 0)
                self.metrics.reasoning_tokens.inc(max(out.num_reasoning_tokens - thought, 0))
                thought = out.num_reasoning_tokens
                if out.error:
                    bad = out.error_is_request
                    code = ErrorCode.INVALID_ARGUMENT if bad else ErrorCode.INTERNAL
                    raise GenerateError(code, out.error)
                share.prefill_here(0)
                share.generated(len(out.new_token_ids))
                if first and adopt is not None:
                    adopt.end()
                # usage rides on the first chunk too: a client that stops early (a stop
                # string) still learns the prompt and cached token counts
                yield to_chunk(out, remote, with_usage=first)
                first = False
        except EngineDeadError as e:
            raise GenerateError(ErrorCode.UNAVAILABLE, str(e)) from None
        except RuntimeError as e:  # the engine step failed for this request
            raise GenerateError(ErrorCode.INTERNAL, str(e)) from None
        finally:
            if adopt is not None:
                adopt.end()
            stream.close()

    def _load_changed(self, requests: int, prefill_tokens: int, tokens: int) -> None:
        self.active_tokens += tokens
        if requests or prefill_tokens:  # output tokens go out with the step's report
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
        extra = {}
        if s.kv_tiers is not None:  # what a hit in a tier costs here, once measured
            for key, tier in ((HOST_COST, KvTier.HOST), (DISK_COST, KvTier.DISK)):
                cost = s.kv_tiers.restore_cost(tier)
                if cost is not None:
                    extra[key] = min(cost, 1.0)
        return LoadReport(
            running_requests=s.running,
            waiting_requests=s.waiting,
            kv_used_blocks=s.kv_used_blocks,
            kv_total_blocks=s.kv_total_blocks,
            remote_prefills_in_flight=len(self.remote.pending),
            active_requests=self.active,
            prefill_tokens_pending=max(self.prefill_pending, 0),
            active_tokens=max(self.active_tokens, 0),
            extra=extra,
            lora_resident=s.lora_resident,
        )

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.events_pub.subscribe()


class _Share:
    """One request's part of the load the handler reports: it counts from arrival to
    end, with its context (prompt and output so far) and the prompt tokens this worker
    still has to prefill for it (none once its first token is out)."""

    def __init__(self, handler: DecodeHandler, prompt: int, prefill: int) -> None:
        self._handler = handler
        self._prefill = max(prefill, 0)
        self._tokens = prompt
        handler._load_changed(1, self._prefill, prompt)

    def prefill_here(self, tokens: int) -> None:
        tokens = max(tokens, 0)
        if tokens != self._prefill:
            self._handler._load_changed(0, tokens - self._prefill, 0)
            self._prefill = tokens

    def generated(self, tokens: int) -> None:
        self._tokens += tokens
        self._handler._load_changed(0, 0, tokens)

    def end(self) -> None:
        self._handler._load_changed(-1, -self._prefill, -self._tokens)
        self._prefill = self._tokens = 0


log = logging.getLogger(__name__)


class DecodeWorker(WorkerRole):
    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.metrics = DecodeMetrics()
        self.rt = WorkerRuntime(config, "decode", self.metrics, moves_kv=config.remote_prefill)
        self.info: WorkerInfo | None = None
        self.handler: DecodeHandler | None = None
        self.server: DecodeWorkerServer | None = None
        self.affinity: PrefillAffinity | None = None
        self.peer_kv: PeerKv | None = None

    @property
    def prefill_workers(self) -> RoleMembers:
        return self.rt.peers

    async def start(self) -> WorkerInfo:
        cfg, rt = self.config, self.rt
        await rt.start()
        rt.core.record_kv_events()
        self.events = KvEventPublisher(rt.incarnation)
        self.remote = RemotePrefill(rt, cfg, self.metrics)
        if cfg.prefill_affinity and cfg.remote_prefill:
            self.affinity = PrefillAffinity(
                rt.discovery, rt.kv_format, rt.core.layout.block_size,
                subscriber=f"decode {cfg.worker_id}", on_leave=self.remote.preferred_left,
            )  # fmt: skip
            self.affinity.start()
            self.remote.affinity = self.affinity
        if cfg.kv_peer_pull and len(rt.pools) == rt.core.layout.tp_size:
            self.peer_kv = PeerKv(rt, cfg, self.metrics)
            self.peer_kv.start()
            self.remote.peer_kv = self.peer_kv
        elif cfg.kv_peer_pull:
            log.info("prefix pulls from other decode workers are off: this worker's KV pool "
                     "is split over ranks a transfer cannot reach")  # fmt: skip
        self.remote.start_loops()
        rt.engine.add_step_hook(self._after_step)
        self.handler = DecodeHandler(
            rt.engine, self.remote, self.events, self.metrics, cfg.worker_id, rt.incarnation,
            max_queued=cfg.max_queued_requests, max_running=cfg.engine.max_num_seqs,
            peer_kv=self.peer_kv,
        )  # fmt: skip
        self.server = DecodeWorkerServer(
            self.handler, f"{cfg.host}:{cfg.port}", worker_id=cfg.worker_id, tracer=rt.tracer
        )
        address = rt.advertised(await self.server.start())
        self.info = rt.record(
            cfg.served_model_name or rt.core.source.name,
            grpc_address=address,
            max_running=cfg.engine.max_num_seqs,
            max_queued=cfg.max_queued_requests,
        )
        await rt.register(self.info)
        log.info("decode worker %s serving at %s", cfg.worker_id, address)
        return self.info

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then shut down: leave discovery (the frontends route no new request
        here), refuse new calls as UNAVAILABLE (a frontend that chose this worker just
        before it left retries elsewhere), and give running streams, with the remote
        prefills they wait for, `grace` s (the config's `drain_timeout`) to finish."""
        await self.rt.leave()
        if self.handler is not None:
            self.handler.draining = True
        if self.server is not None:
            await self.server.stop(self.config.drain_timeout if grace is None else grace)
        if hasattr(self, "remote"):
            await self.remote.close()
        if self.affinity is not None:
            await self.affinity.close()
        if self.peer_kv is not None:
            await self.peer_kv.close()
        await self.rt.close()

    def _after_step(self, core: EngineCore) -> None:
        """On the engine thread after each step: KV events and load figures."""
        self.events.publish(core.drain_kv_events())
        m, s = self.metrics, self.rt.engine.snapshot  # refreshed just before the hooks
        m.running.set(s.running)
        m.waiting.set(s.waiting)
        m.remote_waiting.set(s.remote_waiting)
        m.kv_usage.set(s.kv_usage)
        if self.handler is not None:
            self.events.update_load(self.handler.load())


# The engine/wire seam: both sides share the leaf types (`protocol`: sampling parameters,
# logprobs, finish reasons), so these only regroup fields.


def new_request(request: GenerateRequest) -> NewRequest:
    """A Generate request as the engine takes it."""
    return NewRequest(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        priority=request.priority,
        cache_salt=request.cache_salt or None,
        session_id=request.session_id or None,
        lora=request.lora,
    )


def to_chunk(out: RequestOutput, remote_prefill: bool, with_usage: bool = False) -> GenerateChunk:
    """An engine output as the request plane's chunk; usage on the last (or when asked)."""
    finish = FinishReason(out.finish_reason) if out.finished and out.finish_reason else None
    usage = None
    if out.finished or with_usage:
        usage = Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            remote_prefill=remote_prefill,
            reasoning_tokens=out.num_reasoning_tokens,
        )
    return GenerateChunk(
        token_ids=tuple(out.new_token_ids),
        logprobs=tuple(out.new_logprobs or ()),
        finish_reason=finish,
        usage=usage,
    )

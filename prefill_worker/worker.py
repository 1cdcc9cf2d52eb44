"""A prefill worker process: fetch remote prefills, compute, write KV, notify, ack.

For each delivery (up to `max_batch` at once, batched by the engine):

    checks     the decode worker is registered with the same incarnation and KV layout,
               the deadline has not passed                       -> else term (dead letter)
    prefill    the prompt through this worker's engine (its own prefix cache), sampling
               the first token; the request's blocks are held after it finishes
    claim      `claim_completion`: of two deliveries of one request only one goes on,
               so a decode worker's blocks are written at most once
    write      the blocks of positions >= num_cached_tokens into the decode worker's
               blocks, with the notice as the notification (delivered after the data);
               refused, with a not-ok notice, once the deadline is too close. Pools
               split over tensor-parallel ranks (either side, any sizes) take one
               write a rank of ours, each carrying the heads of every decode rank
               it serves (`rank_writes`), and the notice after all of them
    ack        after the notice; the held blocks are released

A heartbeat (`in_progress`) runs while a delivery is worked on. A failure before
the claim hands the delivery back (nak) for another worker; after the claim the
decode worker's deadline covers it. While the queue's server is away (a restart), the
claim is retried until the deadline leaves no time to write, so the prefill goes on
as soon as the server is back; an ack lost to an outage is left to the redelivery,
which finds the request done.

The worker publishes its prefix cache (KV events) and its load over gRPC
(`PrefillEvents`, the same Events service and messages a decode worker serves the
frontends) so that decode workers can prefer it for prompts it holds; those requests
it fetches before the shared ones. It serves no Generate: it takes its work from the
queue (a Generate call is UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from engine.request import NewRequest, RequestOutput
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.metrics import PrefillMetrics
from protocol.sampling import SamplingParams
from runtime.discovery.members import RoleMembers
from runtime.errors import BackendUnavailable
from runtime.queue import Delivery, RemotePrefillRequest
from runtime.queue.messages import PrefillNotice
from runtime.rpc.handler import WorkerHandler
from runtime.rpc.server import DecodeWorkerServer, KvEventPublisher
from runtime.rpc.types import HealthReport, LoadReport, ServingStatus, WorkerEvent
from runtime.tracing import NO_SPAN
from runtime.worker_info import DETERMINISTIC_KEY, WorkerInfo
from transfer import RankWrite, rank_writes
from worker.assembly import WorkerRole, WorkerRuntime

log = logging.getLogger(__name__)

CLAIM_RETRY_S = 0.25  # between claims while the queue's server is away


class PrefillEvents(WorkerHandler):
    def __init__(self, publisher: KvEventPublisher, worker_id: str, incarnation_id: str) -> None:
        self.publisher = publisher
        self.worker_id = worker_id
        self.incarnation_id = incarnation_id
        self.draining = False
        self.alive = True
        self.in_flight = 0  # prefills being worked on
        self.prefill_pending = 0  # their prompt tokens not in this worker's cache

    async def health(self) -> HealthReport:
        if not self.alive:
            status = ServingStatus.NOT_SERVING
        elif self.draining:
            status = ServingStatus.DRAINING
        else:
            status = ServingStatus.SERVING
        return HealthReport(status, self.worker_id, self.incarnation_id, load=self.load())

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.publisher.subscribe()

    def load(self) -> LoadReport:
        return LoadReport(
            active_requests=self.in_flight, prefill_tokens_pending=max(self.prefill_pending, 0)
        )

    def started(self, prefill_tokens: int) -> None:
        self._changed(1, prefill_tokens)

    def finished(self, prefill_tokens: int) -> None:
        self._changed(-1, -prefill_tokens)

    def _changed(self, prefills: int, tokens: int) -> None:
        self.in_flight += prefills
        self.prefill_pending += tokens
        self.publisher.update_load(self.load())


class PrefillWorker(WorkerRole):
    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        self.metrics = PrefillMetrics()
        self.rt = WorkerRuntime(config, "prefill", self.metrics)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def decode_workers(self) -> RoleMembers:
        return self.rt.peers

    async def start(self) -> WorkerInfo:
        rt, cfg = self.rt, self.config
        await rt.start()
        self.layout = rt.core.layout
        rt.core.record_kv_events()
        self.events = PrefillEvents(KvEventPublisher(rt.incarnation), cfg.worker_id,
                                    rt.incarnation)  # fmt: skip
        rt.engine.add_step_hook(lambda core: self.events.publisher.publish(core.drain_kv_events()))
        self.server = DecodeWorkerServer(
            self.events, f"{cfg.host}:{cfg.port}", worker_id=cfg.worker_id
        )
        address = rt.advertised(await self.server.start())
        info = rt.record(rt.core.source.name, grpc_address=address)
        await rt.register(info)
        self._loop_task = asyncio.create_task(self._serve_forever(), name="prefill loop")
        log.info("prefill worker %s ready", self.config.worker_id)
        return info

    async def stop(self) -> None:
        """Drain, then shut down: leave discovery, stop pulling from the queue (what is
        not pulled stays there for the other prefill workers), let the prefills and KV
        writes in flight finish for up to `drain_timeout` s, then close."""
        await self.rt.leave()
        self._stopping.set()
        if hasattr(self, "events"):
            self.events.draining = True
        if self._loop_task is not None:
            # the loop ends after its current fetch (at most its 1 s timeout); cancelling
            # a fetch halfway could strand messages until their ack deadline
            done, _ = await asyncio.wait({self._loop_task}, timeout=5.0)
            if not done:
                self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._tasks:
            held = len(self._tasks)
            _, late = await asyncio.wait(set(self._tasks), timeout=self.config.drain_timeout)
            log.info("prefill worker %s drained %d of %d in-flight prefills",
                     self.config.worker_id, held - len(late), held)  # fmt: skip
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if hasattr(self, "server"):
            await self.server.stop(1.0)
        await self.rt.close()

    # -- the work loop ------------------------------------------------------------------

    async def _serve_forever(self) -> None:
        slots = asyncio.Semaphore(self.config.max_batch)
        while not self._stopping.is_set():
            await slots.acquire()
            free = 1
            while free < self.config.max_batch and not slots.locked():
                await slots.acquire()
                free += 1
            if self._stopping.is_set():
                break
            try:
                deliveries = await self.rt.queue.fetch(
                    batch=free, timeout=1.0, worker_id=self.config.worker_id
                )
            except Exception as e:
                log.warning("fetching from the prefill queue failed: %s", e)
                deliveries = []
                await asyncio.sleep(0.5)
            for _ in range(free - len(deliveries)):
                slots.release()
            for d in deliveries:
                task = asyncio.create_task(self._serve(d, slots), name=d.request.request_id)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve(self, d: Delivery, slots: asyncio.Semaphore) -> None:
        self.metrics.in_flight.inc()
        req = d.request
        ids = list(req.prompt_token_ids)
        work = len(ids) - self.rt.engine.snapshot.prefix_hit(
            ids, req.cache_salt or None, req.lora
        )
        self.events.started(work)
        if self.rt.tracer.on:  # from its publication to this fetch, in the request's trace
            queued = self.rt.tracer.start(
                "queue", req.traceparent, self._attributes(d), start_s=req.published_at,
                kind="consumer",
            )  # fmt: skip
            queued.end()
        try:
            async with d.keepalive():
                result = await self._prefill_and_write(d)
            self.metrics.prefills.labels(result=result).inc()
        except Exception:
            log.exception("prefill of %s failed", d.request.request_id)
            self.metrics.prefills.labels(result="failed").inc()
            if d.settled is None:
                with contextlib.suppress(Exception):
                    await d.nak(0.5)
        finally:
            self.events.finished(work)
            self.metrics.in_flight.dec()
            slots.release()

    async def _prefill_and_write(self, d: Delivery) -> str:
        req = d.request
        decode = await self.decode_workers.wait_for(
            req.decode_worker_id, self.config.decode_lookup_timeout
        )
        problem = self._check(req, decode)
        if problem:
            log.warning("not prefilling %s: %s", req.request_id, problem)
            await d.term(problem)
            return "skipped"
        assert decode is not None and decode.transfer is not None
        theirs, ours = decode.extra.get(DETERMINISTIC_KEY), self.rt.core.numerics
        if theirs is not None and theirs != ours:
            # a --deterministic decode worker offered it before this worker joined (it
            # checks the prefill pool as it publishes): our KV would be other bits, so
            # the decode worker prefills it itself, told at once
            return await self._refuse(d, decode, f"computes other bits ({ours}, not {theirs})")
        started = time.monotonic()
        span = NO_SPAN
        if self.rt.tracer.on:
            span = self.rt.tracer.start("prefill", req.traceparent, self._attributes(d))
            span.set("diptych.prompt_tokens", len(req.prompt_token_ids))
            span.set("diptych.cached_tokens", self.rt.engine.snapshot.prefix_hit(
                list(req.prompt_token_ids), req.cache_salt or None, req.lora))  # fmt: skip
            span.set("diptych.decode_cached_tokens", req.num_cached_tokens)
        local_id = f"{req.request_id}#{d.num_delivered}"
        first_token = NewRequest(
            local_id,
            req.prompt_token_ids,
            first_token_params(req.sampling),
            cache_salt=req.cache_salt or None,
            hold_blocks=True,
            lora=req.lora,
        )
        try:
            stream = await self.rt.engine.submit(first_token)
        except ValueError as e:  # its LoRA adapter is not served or cannot be read here
            span.end()
            log.warning("not prefilling %s: %s", req.request_id, e)
            await d.term(str(e))
            return "skipped"
        try:
            outs = [o async for o in stream]
            span.end()
            out = outs[-1]  # one token: the only output
            assert out.new_token_ids
            prefill_s = time.monotonic() - started
            self.metrics.prefill_seconds.observe(prefill_s)
            if not await self._claim(d):
                await d.ack()
                return "duplicate"
            if time.time() > req.deadline - self.config.write_margin:
                return await self._refuse(d, decode, "deadline too close", claimed=True)
            src_blocks = await self.rt.engine.block_ids(local_id)
            nbytes = await self._write(d, decode, src_blocks, out, prefill_s)
            self.metrics.transferred_bytes.inc(nbytes)
            try:
                await d.ack()
            except BackendUnavailable as e:  # done all the same: the decode worker has it
                log.warning("ack of %s lost (%s); a redelivery will find it done", local_id, e)
            return "ok"
        finally:
            span.end()  # if the prefill failed (else a second end does nothing)
            with contextlib.suppress(KeyError, Exception):
                await self.rt.engine.release_held(local_id)

    async def _refuse(
        self, d: Delivery, decode: WorkerInfo, error: str, claimed: bool = False
    ) -> str:
        """Tell the decode worker, by a not-ok notice, that its request will not be
        written (it prefills locally at once), then ack; one delivery of a request
        answers (`claimed`: this one already holds the claim)."""
        req = d.request
        if not claimed and not await self._claim(d):
            await d.ack()
            return "duplicate"
        assert decode.transfer is not None
        log.warning("refusing %s: %s", req.request_id, error)
        notice = PrefillNotice(req.request_id, ok=False, error=error)
        peer = decode.transfer.agent_name
        handle = self.rt.agent.notify(peer, notice.encode(), grant=req.kv_grant or None)
        await handle.wait(self.config.write_timeout)
        await d.ack()
        return "refused"

    async def _claim(self, d: Delivery) -> bool:
        """`claim_completion`, retried while the queue's server is away for as long as
        the request's deadline leaves time to write: a broker restart longer than one
        call's retry budget must not leave the decode worker waiting out its deadline."""
        last_try = d.request.deadline - self.config.write_margin
        while True:
            try:
                return await d.claim_completion()
            except BackendUnavailable as e:
                if time.time() + CLAIM_RETRY_S > last_try:
                    raise
                log.warning(
                    "claiming %s: the queue is unavailable (%s); retrying until its deadline",
                    d.request.request_id, e,
                )  # fmt: skip
                await asyncio.sleep(CLAIM_RETRY_S)

    def _check(self, req: RemotePrefillRequest, decode: WorkerInfo | None) -> str:
        ours = self.rt.kv_format
        if decode is None or decode.transfer is None:
            return f"decode worker {req.decode_worker_id} is not registered"
        if decode.incarnation_id != req.decode_incarnation_id:
            return f"decode worker {req.decode_worker_id} restarted"
        if not decode.transfer.kv_regions:
            return f"decode worker {req.decode_worker_id} publishes no KV region"
        published = decode.kv_layout.format_hash if decode.kv_layout else None
        if req.kv_layout_hash != ours or published != ours:
            return (
                f"KV layout {req.kv_layout_hash} (published {published}) differs from ours ({ours})"
            )
        if req.expired():
            return "deadline passed"
        bs = self.layout.block_size
        if len(req.dst_block_ids) != -(-len(req.prompt_token_ids) // bs):
            return "dst_block_ids do not cover the prompt"
        return ""

    async def _write(
        self,
        d: Delivery,
        decode: WorkerInfo,
        src_blocks: list[int],
        out: RequestOutput,
        prefill_s: float,
    ) -> int:
        """Write the blocks past the decode worker's cached prefix, notice attached:
        one write a rank of ours, each into the decode ranks that hold its heads."""
        req = d.request
        assert decode.transfer is not None and decode.kv_layout is not None
        bs = self.layout.block_size
        first = req.num_cached_tokens // bs
        last = -(-len(req.prompt_token_ids) // bs)
        writes = rank_writes(
            self.layout, [r.id for r in self.rt.pools], src_blocks[first:last],
            decode.kv_layout, decode.transfer.kv_regions, req.dst_block_ids[first:last],
        )  # fmt: skip
        nbytes = sum(w.nbytes for w in writes)
        span = NO_SPAN  # the notice names it: the decode worker's adopt span goes under it
        if self.rt.tracer.on:
            span = self.rt.tracer.start("transfer", req.traceparent, self._attributes(d))
            span.set("diptych.blocks", last - first)
            span.set("diptych.bytes", nbytes)
        notice = PrefillNotice(
            req.request_id,
            ok=True,
            first_token=out.new_token_ids[0],
            logprob=out.new_logprobs[0] if out.new_logprobs else None,
            prefill_worker_id=self.config.worker_id,
            prefill_s=prefill_s,
            write_started_at=time.time(),
            transferred_bytes=nbytes,
            traceparent=span.traceparent,
        )
        try:
            await self._send(req, decode, writes, notice)
        finally:
            span.end()
        for w in writes:
            for rank, n in w.bytes_to.items():
                self.metrics.rank_bytes.labels(str(w.src_rank), str(rank)).inc(n)
        return nbytes

    async def _send(
        self, req: RemotePrefillRequest, decode: WorkerInfo, writes: list[RankWrite],
        notice: PrefillNotice,
    ) -> None:  # fmt: skip
        """The writes, then the notice (`Agent.write_all`), retried while the decode
        worker does not know us yet, within the deadline."""
        assert decode.transfer is not None
        t0 = time.monotonic()
        await self.rt.agent.write_all(
            decode.transfer.agent_name, [(w.src, w.dst) for w in writes], notice.encode(),
            grant=req.kv_grant or None, timeout=self.config.write_timeout,
            retry_until=req.deadline - self.config.write_margin,
        )  # fmt: skip
        self.metrics.transfer_seconds.observe(time.monotonic() - t0)

    def _attributes(self, d: Delivery) -> dict[str, str | int | float | bool]:
        """What every span of a delivery says: which request, which try, who."""
        return {
            "diptych.request_id": d.request.request_id,
            "diptych.delivery": d.num_delivered,
            "diptych.worker_id": self.config.worker_id,
            "diptych.decode_worker_id": d.request.decode_worker_id,
        }


def first_token_params(s: SamplingParams) -> SamplingParams:
    """Parameters that sample exactly the first token as the decode worker would: the
    same filters and seed, one token, EOS not ending it (the decode worker decides what
    its first token ends)."""
    return s.replace(max_tokens=1, ignore_eos=True, min_tokens=min(s.min_tokens, 1))

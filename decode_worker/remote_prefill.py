"""The decode worker's side of a remote prefill: publish it, wait for its one outcome.

    EngineCore.submit pinned the prompt's blocks (a RemotePlan)
      -> publish RemotePrefillRequest(blocks, deadline) on the prefill queue
      -> wait for the first of:
           notice ok        adopt the KV and the first token; the request joins the batch
           notice not ok    nothing was written: free the blocks, prefill locally
           notice malformed it came after its write, so none is in flight: same
           dead letter      no consumer claimed it, so nothing was written: same
           deadline+grace   a claimed prefill may have died; prefill workers start no
                            write after the deadline, so after the grace no write can
                            land: same
           publish failed   nothing was sent: same

A block is never reused while a write into it may land: it stays pinned (even if the
client aborts, even if the waiting handler is cancelled) until one of those outcomes is
settled with the engine. The background loops below only deliver outcomes to the
waiting request; settling is `prefill`'s own, in a task that outlives its caller.

Which prefill worker a remote prefill should prefer: the one holding most of its prompt.

Prefill workers keep prefix caches too, so the prefill worker that computed a
conversation's last turn computes the next one from where it left off. The decode worker
follows every prefill worker's Events stream (the KV events and load a decode worker
sends the frontends) into a :class:`KvIndex`, and for each remote prefill compares

    the best holder    prompt tokens it does not hold + prompt tokens it has queued
    any worker         the whole prompt + the least any prefill worker has queued

A holder that wins gets the request on its own subject of the queue (``prefer``); it
fetches those before shared work. Otherwise the request goes to the shared queue, which
whoever is free pulls. A preference is released to every worker if the preferred one
has not taken it within ``prefill_affinity_wait`` s, and at once if it leaves discovery
(``RemotePrefill`` does that); the durable shared queue is always the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from decode_worker.metrics import DecodeMetrics
from decode_worker.peer_kv import MARK as PEER_KV_MARK
from decode_worker.peer_kv import PeerKv
from engine.request import RemotePlan, RemoteRule
from protocol.kv_layout import hash_blocks
from protocol.lora import AdapterRef
from runtime.discovery import Discovery
from runtime.discovery.members import RoleMembers
from runtime.errors import ControlPlaneError
from runtime.kv_index import KvIndex
from runtime.queue import RemotePrefillRequest
from runtime.queue.messages import MalformedNotice, PrefillNotice
from runtime.rpc import DecodeWorkerClient, LoadReport, WorkerEvent, follow_events
from runtime.rpc.types import (
    GenerateRequest,
    KvCleared,
    KvRemoved,
    KvSnapshot,
    KvStored,
    LoadUpdate,
)
from runtime.tasks import cancel_and_wait
from runtime.tracing import NO_SPAN, Span
from runtime.worker_info import DETERMINISTIC_KEY, LORA_RANK_KEY, WorkerInfo
from transfer import DescList, Notification
from worker.assembly import WorkerRuntime


class PrefillAffinity:
    def __init__(
        self,
        discovery: Discovery,
        kv_format: str,
        block_size: int,
        *,
        subscriber: str,
        on_leave: Callable[[str], None] | None = None,
    ) -> None:
        self.index = KvIndex()
        self.loads: dict[str, LoadReport] = {}
        self.kv_format = kv_format  # `KvLayout.format_hash` of our pool
        self.block_size = block_size
        self._subscriber = subscriber
        self._on_leave = on_leave
        self._followers: dict[str, tuple[DecodeWorkerClient, asyncio.Task[None]]] = {}
        self.members = RoleMembers(discovery, "prefill", on_join=self._joined, on_leave=self._left)

    def start(self) -> None:
        self.members.start()

    async def close(self) -> None:
        await self.members.close()
        for wid in list(self._followers):
            await self._stop_following(wid)

    # -- following the prefill workers --------------------------------------------------
    async def _joined(self, info: WorkerInfo) -> None:
        wid = info.worker_id
        await self._stop_following(wid)  # a new incarnation: start afresh
        layout = info.kv_layout
        if not info.grpc_address or layout is None or layout.format_hash != self.kv_format:
            return  # an older prefill worker without events, or one we cannot peer with
        client = DecodeWorkerClient(info.grpc_address, worker_id=wid)  # only its answers
        await client.connect(wait=False)
        follow = follow_events(
            client, wid, self.on_event, subscriber=self._subscriber, what="prefill worker"
        )
        task = asyncio.create_task(follow, name=f"prefill events {wid}")
        self._followers[wid] = (client, task)

    async def _left(self, info: WorkerInfo) -> None:
        await self._stop_following(info.worker_id)
        if self._on_leave is not None:
            self._on_leave(info.worker_id)

    async def _stop_following(self, wid: str) -> None:
        entry = self._followers.pop(wid, None)
        self.index.remove_worker(wid)
        self.loads.pop(wid, None)
        if entry is not None:
            client, task = entry
            await cancel_and_wait(task)
            with contextlib.suppress(Exception):
                await client.close()

    def on_event(self, wid: str, event: WorkerEvent) -> None:
        if isinstance(event, LoadUpdate):
            self.loads[wid] = event.load
        elif isinstance(event, KvStored):
            self.index.stored(wid, event.block_hashes)
        elif isinstance(event, KvRemoved):
            self.index.removed(wid, event.block_hashes)
        elif isinstance(event, KvSnapshot):
            self.index.replace(wid, event.block_hashes)
        elif isinstance(event, KvCleared):
            self.index.clear(wid)

    # -- the choice ---------------------------------------------------------------------
    def choose(
        self, prompt: tuple[int, ...], cache_salt: str | None = None,
        adapter: AdapterRef | None = None,
    ) -> str | None:  # fmt: skip
        """The prefill worker to prefer for ``prompt``, or None for the shared queue."""
        live = [m.worker_id for m in self.members.all() if m.worker_id in self.loads]
        if not live:
            return None
        hashes = hash_blocks(prompt, self.block_size, salt=cache_salt, adapter=adapter)
        matched = self.index.match(hashes)
        if not matched:
            return None
        n = len(prompt)
        queued = {wid: self.loads[wid].prefill_tokens_pending for wid in live}
        any_worker = n + min(queued.values())
        best, best_work = None, any_worker
        for wid, blocks in matched.items():
            if wid in queued:
                work = n - min(blocks * self.block_size, n - 1) + queued[wid]
                if work < best_work:
                    best, best_work = wid, work
        return best


log = logging.getLogger(__name__)

# What a remote prefill ended with: the ok notice, or why it fell back to local prefill.
Outcome = PrefillNotice | str


@dataclass
class _Pending:
    deadline: float
    outcome: asyncio.Future[Outcome]
    published: float = field(default_factory=time.monotonic)
    # offered first to this prefill worker (published at `sequence`) until released
    prefer: str | None = None
    sequence: int = 0
    message: RemotePrefillRequest | None = None
    grant: str = ""  # the write grant over its blocks, for the one prefill worker
    trace: str = ""  # the request's trace context (its Generate call's span)
    adopt: Span = NO_SPAN  # from the ok notice to the first token out


class RemotePrefill:
    def __init__(
        self, rt: WorkerRuntime, config: DecodeWorkerConfig, metrics: DecodeMetrics
    ) -> None:
        self.rt = rt
        self.config = config
        self.metrics = metrics
        self.pending: dict[str, _Pending] = {}
        self._queue_depth = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._settling: set[asyncio.Task[bool]] = set()
        self._releasing: set[asyncio.Task[None]] = set()
        self.affinity: PrefillAffinity | None = None  # set by the worker when enabled
        self.peer_kv: PeerKv | None = None  # (the notices of prefix pulls come here too)
        self._rule = RemoteRule(
            config.min_remote_prefill_tokens,
            config.min_remote_prefill_share,
            config.max_local_prefill_tokens,
        )
        # a simulated engine's time runs this much faster: the timeout is simulated
        sim = config.engine.sim
        self._time_scale = sim.speedup if sim is not None else 1.0

    def rule(self, adapter: AdapterRef | None = None) -> RemoteRule | None:
        """What `EngineCore.submit` takes as `remote_min_uncached` now; None (prefill
        locally) unless remote prefill is on, a prefill worker is registered and the
        queue is not too deep; for a LoRA adapter's request, a prefill worker that
        serves adapters, and under `--deterministic`, prefill workers that all run it
        on the same numerics (kernels, dtype, TP size; else it is prefilled here, counted)."""
        cfg = self.config
        if cfg.remote_prefill and len(self.rt.peers) and self._queue_depth < cfg.max_queue_depth:
            peers = self.rt.peers.all()
            if adapter is not None and not any(p.extra.get(LORA_RANK_KEY) for p in peers):
                self.metrics.lora_local.inc()
                return None
            mine = self.rt.core.numerics
            if mine is not None and not all(p.extra.get(DETERMINISTIC_KEY) == mine for p in peers):
                # a prefill worker of another mode, build or TP size computes other KV
                self.metrics.deterministic_local.inc()
                return None
            return self._rule
        return None

    async def prefill(self, request: GenerateRequest, plan: RemotePlan) -> Span | None:
        """Publish the remote prefill of a request whose blocks `plan` pinned, wait for
        its outcome and settle it with the engine. A span (the adopt span, which the
        caller ends when the first token goes out; `NO_SPAN` untraced): its KV and first
        token were adopted; None: it was released to prefill locally."""
        rid = request.request_id
        deadline = time.time() + self.config.remote_prefill_timeout / self._time_scale
        outcome: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        grant = self._grant(plan, deadline)
        waiting = _Pending(deadline, outcome, grant=grant, trace=request.traceparent)
        self.pending[rid] = waiting
        settle = asyncio.create_task(self._settle(rid, outcome, time.monotonic()))
        self._settling.add(settle)
        settle.add_done_callback(self._settling.discard)
        self._queue_depth += 1
        try:
            message = self._message(request, plan, deadline, grant)
            prefer = None
            if self.affinity is not None:
                prefer = self.affinity.choose(
                    request.prompt_token_ids, request.cache_salt or None, request.lora
                )
            published = await self.rt.queue.publish(message, prefer=prefer)
            self.metrics.remote_started.inc()
            self.metrics.remote_routed.labels("holder" if prefer else "any").inc()
            pending = self.pending.get(rid)
            if prefer is not None and pending is not None:
                pending.prefer, pending.message = prefer, message
                pending.sequence = published.sequence
                wait = self.config.prefill_affinity_wait / self._time_scale
                self._spawn(self._release_after(rid, wait))
        except Exception as e:  # QueueFull, the server away, too large, a bad field...
            log.warning("remote prefill of %s not published (%s); prefilling locally", rid, e)
            self._resolve(rid, "publish_error")
        return waiting.adopt if await asyncio.shield(settle) else None

    def _grant(self, plan: RemotePlan, deadline: float) -> str:
        """A write grant over the blocks the prefill worker is to write (those past the
        cached prefix), for as long as a write may land: deadline plus grace."""
        layout = self.rt.core.layout
        first = plan.num_cached_tokens // layout.block_size
        blocks = DescList.concat(
            DescList.blocks(pool, list(plan.block_ids[first:]), layout.block_bytes)
            for pool in self.rt.pools  # the same blocks of every tensor-parallel rank
        )
        ttl = deadline - time.time() + self.config.late_write_grace
        return self.rt.agent.grant(blocks, max(ttl, 1.0))

    def _message(
        self, request: GenerateRequest, plan: RemotePlan, deadline: float, grant: str
    ) -> RemotePrefillRequest:
        return RemotePrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            decode_worker_id=self.config.worker_id,
            decode_incarnation_id=self.rt.incarnation,
            transfer_agent=self.rt.agent.name,
            dst_block_ids=tuple(plan.block_ids),
            num_cached_tokens=plan.num_cached_tokens,
            deadline=deadline,
            kv_layout_hash=self.rt.kv_format,
            cache_salt=request.cache_salt,
            kv_grant=grant,
            traceparent=request.traceparent,
            lora_name=request.lora_name,
            lora_path=request.lora_path,
        )

    async def _settle(self, rid: str, outcome: asyncio.Future[Outcome], started: float) -> bool:
        result = await outcome
        engine = self.rt.engine
        if isinstance(result, str):
            await engine.remote_failed(rid)
            self.metrics.remote_finished.labels(result=result).inc()
            return False
        await engine.remote_ready(rid, result.first_token, result.logprob)
        m = self.metrics
        m.remote_finished.labels(result="ok").inc()
        m.remote_latency.observe(time.monotonic() - started)
        m.remote_transfer.observe(max(time.time() - result.write_started_at, 0.0))
        m.transferred_bytes.inc(result.transferred_bytes)
        return True

    # -- preferred prefill workers ------------------------------------------------------

    def preferred_left(self, worker_id: str) -> None:
        """A prefill worker left discovery: what waits for it goes to every worker now."""
        for rid, p in list(self.pending.items()):
            if p.prefer == worker_id:
                self._spawn(self._release(rid, force=True, why="left"))

    async def _release_after(self, rid: str, wait: float) -> None:
        await asyncio.sleep(wait)
        await self._release(rid, force=False, why="wait")

    async def _release(self, rid: str, *, force: bool, why: str) -> None:
        p = self.pending.get(rid)
        if p is None or p.prefer is None or p.message is None:
            return  # settled, or released already
        prefer, p.prefer = p.prefer, None
        try:
            moved = await self.rt.queue.release(p.message, p.sequence, prefer, force=force)
        except Exception as e:  # the deadline still covers it
            log.warning("releasing remote prefill %s from %s failed: %s", rid, prefer, e)
            return
        if moved:
            self.metrics.remote_released.labels(why).inc()
            log.info("remote prefill %s released from %s (%s)", rid, prefer, why)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _resolve(self, rid: str, result: Outcome) -> None:
        """Deliver a request's outcome; the first one counts, later ones are ignored."""
        pending = self.pending.pop(rid, None)
        if pending is None:
            log.info("outcome %s for unknown or settled remote prefill %s", result, rid)
            return
        self.rt.agent.revoke(pending.grant)  # nothing may land in its blocks from now on
        if self.rt.tracer.on and isinstance(result, PrefillNotice):
            # under the prefill worker's transfer span, which the notice names
            pending.adopt = self.rt.tracer.start(
                "adopt", result.traceparent or pending.trace,
                {"diptych.request_id": rid, "diptych.worker_id": self.config.worker_id,
                 "diptych.prefill_worker_id": result.prefill_worker_id},
            )  # fmt: skip
        pending.outcome.set_result(result)

    # -- where outcomes come from -----------------------------------------------

    def start_loops(self) -> None:
        self._tasks = [
            asyncio.create_task(self._notices(), name="prefill notices"),
            asyncio.create_task(self._dead_letters(), name="dead letters"),
            asyncio.create_task(self._watchdog(), name="remote prefill deadlines"),
            asyncio.create_task(self._depth(), name="queue depth"),
        ]

    async def close(self) -> None:
        for t in [*self._tasks, *self._settling, *self._releasing]:
            t.cancel()
        for t in [*self._tasks, *self._settling, *self._releasing]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _notices(self) -> None:
        async for note in self.rt.agent.notifications():
            try:
                self.on_notification(note)
            except Exception:  # one bad notice must not end the loop
                log.exception("handling a prefill notice from %s failed", note.peer)

    def on_notification(self, note: Notification) -> None:
        peer_kv = self.peer_kv  # (a prefix pull's message or grant: checked without a call)
        ours = peer_kv is not None and (
            bytes(note.payload[: len(PEER_KV_MARK)]) == PEER_KV_MARK
            or (note.kind == "violation" and bool(peer_kv.pending))
        )
        if ours and peer_kv is not None and peer_kv.on_notification(note):
            return
        if note.kind == "violation":  # the transfer layer refused a use of a grant
            rid = next((r for r, p in self.pending.items() if p.grant == note.grant), None)
            log.warning("%s used the write grant of %s outside it (%s); prefilling locally",
                        note.peer, rid, bytes(note.payload).decode(errors="replace"))  # fmt: skip
            if rid is not None:
                self._resolve(rid, "violation")
            return
        try:
            notice = PrefillNotice.decode(bytes(note.payload))
        except MalformedNotice as e:
            self.metrics.malformed_notices.inc()
            log.warning("malformed prefill notice from %s: %s", note.peer, e)
            if e.request_id is not None and self._from_holder(e.request_id, note):
                self._resolve(e.request_id, "malformed")
            return
        if not self._from_holder(notice.request_id, note):
            return
        if notice.ok:
            self._resolve(notice.request_id, notice)
        else:
            log.info("prefill of %s refused: %s", notice.request_id, notice.error)
            self._resolve(notice.request_id, "refused")

    def _from_holder(self, rid: str, note: Notification) -> bool:
        """Whether a notice about `rid` came under that request's grant (so from the
        prefill worker that wrote its blocks); one that did not is counted, ignored."""
        pending = self.pending.get(rid)
        if pending is None or not pending.grant or note.grant == pending.grant:
            return True  # an unknown or settled request: _resolve ignores it
        self.metrics.rejected_notices.inc()
        log.warning("ignoring a prefill notice for %s from %s, not under its grant",
                    rid, note.peer)  # fmt: skip
        return False

    async def _dead_letters(self) -> None:
        async for letter in self.rt.queue.dead_letters(self.config.worker_id):
            log.info("remote prefill of %s dead-lettered (%s)", letter.request_id, letter.reason)
            self._resolve(letter.request_id, "dead_letter")

    async def _watchdog(self) -> None:
        grace = self.config.late_write_grace
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for rid, p in list(self.pending.items()):
                if now > p.deadline + grace:
                    log.warning("remote prefill of %s missed its deadline; prefilling locally", rid)
                    self._resolve(rid, "timeout")

    async def _depth(self) -> None:
        while True:
            with contextlib.suppress(ControlPlaneError):
                self._queue_depth = (await self.rt.queue.depth()).pending
            self.metrics.queue_depth.set(self._queue_depth)
            oldest = min((p.published for p in self.pending.values()), default=None)
            age = 0.0 if oldest is None else (time.monotonic() - oldest) * self._time_scale
            self.metrics.oldest_remote.set(age)  # in simulated seconds under --engine sim
            await asyncio.sleep(0.5)

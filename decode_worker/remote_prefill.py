"""The decode worker's side of a remote prefill.

    plan (engine thread): prefix match, pre-allocate and pin the prompt's blocks
      -> publish RemotePrefillRequest(blocks, deadline) on the prefill queue
      -> notice ok      : adopt the KV and the first token; the request joins the batch
      -> notice not ok  : nothing was written: free the blocks, prefill locally
      -> dead letter    : no consumer claimed it, so nothing was written: same
      -> deadline+grace : a claimed prefill may have died; prefill workers start no
                          write after the deadline, so after the grace no write can
                          land: free the blocks, prefill locally

A block is never reused while a write into it may land: it stays pinned (even if
the client aborts) until one of those four outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from decode_worker.config import DecodeWorkerConfig
from decode_worker.metrics import DecodeMetrics
from engine import AsyncEngine, TokenLogprob
from engine.async_engine import RemotePlan
from runtime.discovery.members import RoleMembers
from runtime.errors import ControlPlaneError
from runtime.prefill_notice import PrefillNotice
from runtime.queue import PrefillQueue, RemotePrefillRequest
from runtime.rpc.types import GenerateRequest
from runtime.worker_info import WorkerInfo
from transfer import Agent, Notification

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    deadline: float
    started: float


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncEngine,
        queue: PrefillQueue,
        agent: Agent,
        config: DecodeWorkerConfig,
        me: WorkerInfo,
        layout_hash: str,
        prefill_workers: RoleMembers,
        metrics: DecodeMetrics,
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.agent = agent
        self.config = config
        self.me = me
        self.layout_hash = layout_hash
        self.prefill_workers = prefill_workers
        self.metrics = metrics
        self.pending: dict[str, _Pending] = {}
        self._queue_depth = 0
        self._tasks: list[asyncio.Task[None]] = []

    # -- decisions --------------------------------------------------------------

    def wanted(self) -> bool:
        """Worth trying now: enabled, a prefill worker alive, the queue not too deep."""
        return (
            self.config.remote_prefill
            and len(self.prefill_workers) > 0
            and self._queue_depth < self.config.max_queue_depth
        )

    async def start(self, request: GenerateRequest, plan: RemotePlan) -> None:
        """Publish the remote prefill of a request whose blocks `plan` pinned."""
        rid = request.request_id
        now = time.time()
        deadline = now + self.config.remote_prefill_timeout
        msg = RemotePrefillRequest(
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            decode_worker_id=self.me.worker_id,
            decode_incarnation_id=self.me.incarnation_id,
            transfer_agent=self.agent.name,
            dst_block_ids=tuple(plan.block_ids),
            num_cached_tokens=plan.num_cached_tokens,
            deadline=deadline,
            kv_layout_hash=self.layout_hash,
            cache_salt=request.cache_salt,
        )
        self.pending[rid] = _Pending(deadline, time.monotonic())
        self._queue_depth += 1
        try:
            await self.queue.publish(msg)
        except ControlPlaneError as e:  # QueueFull, the server away, too large...
            log.warning("remote prefill of %s not published (%s); prefilling locally", rid, e)
            await self._give_up(rid, "publish_error")
            return
        self.metrics.remote_started.inc()

    # -- outcomes ---------------------------------------------------------------

    async def _adopt(self, notice: PrefillNotice) -> None:
        rid = notice.request_id
        pending = self.pending.pop(rid, None)
        if pending is None:
            log.warning("prefill notice for unknown or settled request %s", rid)
            return
        lp = None
        if notice.logprob is not None:
            top = [(t.token_id, t.logprob) for t in notice.logprob.top]
            lp = TokenLogprob(notice.first_token, notice.logprob.logprob, 0, top)
        await self.engine.remote_ready(rid, notice.first_token, lp)
        self.metrics.remote_finished.labels(result="ok").inc()
        self.metrics.remote_latency.observe(time.monotonic() - pending.started)
        self.metrics.remote_transfer.observe(notice.transfer_s)
        self.metrics.transferred_bytes.inc(notice.transferred_bytes)

    async def _give_up(self, rid: str, reason: str) -> None:
        """No write can land any more: release the blocks and prefill locally."""
        if self.pending.pop(rid, None) is None:
            return
        await self.engine.remote_failed(rid)
        self.metrics.remote_finished.labels(result=reason).inc()

    # -- background loops -------------------------------------------------------

    def start_loops(self) -> None:
        self._tasks = [
            asyncio.create_task(self._notices(), name="prefill notices"),
            asyncio.create_task(self._dead_letters(), name="dead letters"),
            asyncio.create_task(self._watchdog(), name="remote prefill deadlines"),
            asyncio.create_task(self._depth(), name="queue depth"),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _notices(self) -> None:
        async for note in self.agent.notifications():
            await self._on_notification(note)

    async def _on_notification(self, note: Notification) -> None:
        try:
            notice = PrefillNotice.decode(bytes(note.payload))
        except ControlPlaneError as e:
            log.warning("ignoring a malformed notification from %s: %s", note.peer, e)
            return
        try:
            if notice.ok:
                await self._adopt(notice)
            else:
                log.info("prefill of %s refused: %s", notice.request_id, notice.error)
                await self._give_up(notice.request_id, "refused")
        except Exception:
            log.exception("handling the prefill notice of %s failed", notice.request_id)

    async def _dead_letters(self) -> None:
        async for letter in self.queue.dead_letters(self.me.worker_id):
            log.info("remote prefill of %s dead-lettered (%s)", letter.request_id, letter.reason)
            await self._give_up(letter.request_id, "dead_letter")

    async def _watchdog(self) -> None:
        grace = self.config.late_write_grace
        while True:
            await asyncio.sleep(0.25)
            now = time.time()
            for rid, p in list(self.pending.items()):
                if now > p.deadline + grace:
                    log.warning("remote prefill of %s missed its deadline; prefilling locally", rid)
                    await self._give_up(rid, "timeout")

    async def _depth(self) -> None:
        while True:
            with contextlib.suppress(ControlPlaneError):
                self._queue_depth = (await self.queue.depth()).pending
            self.metrics.queue_depth.set(self._queue_depth)
            await asyncio.sleep(0.5)

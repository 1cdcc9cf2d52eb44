"""Which prefill worker a remote prefill should prefer: the one holding most of its prompt.

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
from collections.abc import Callable

from protocol.block_hash import hash_blocks
from runtime.discovery import Discovery
from runtime.discovery.members import RoleMembers
from runtime.kv_index import KvIndex
from runtime.rpc import DecodeWorkerClient, LoadReport, WorkerEvent, follow_events
from runtime.rpc.types import KvCleared, KvRemoved, KvSnapshot, KvStored, LoadUpdate
from runtime.tasks import cancel_and_wait
from runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)


class PrefillAffinity:
    def __init__(
        self,
        discovery: Discovery,
        layout_hash: str,
        block_size: int,
        *,
        subscriber: str,
        on_leave: Callable[[str], None] | None = None,
    ) -> None:
        self.index = KvIndex()
        self.loads: dict[str, LoadReport] = {}
        self.layout_hash = layout_hash
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
        if not info.grpc_address or layout is None or layout.layout_hash != self.layout_hash:
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
    def choose(self, prompt: tuple[int, ...], cache_salt: str | None = None) -> str | None:
        """The prefill worker to prefer for ``prompt``, or None for the shared queue."""
        live = [m.worker_id for m in self.members.all() if m.worker_id in self.loads]
        if not live:
            return None
        matched = self.index.match(hash_blocks(prompt, self.block_size, salt=cache_salt))
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

"""The Events stream: the worker's side (the set of cached blocks and a fan-out to
routers) and the subscriber's check that it is in step.

A worker reports what its prefix cache does (``stored``, ``removed``, ``cleared``; after
each engine step, ``publish`` with what the step stored and evicted) and its load
(``update_load``); each router subscribed over gRPC gets a snapshot, then the changes in
order. These methods are thread-safe, so an engine stepping in a worker thread may call
them directly.

Slow subscribers never grow memory without bound: each has a queue of at most
``max_queue`` events; on overflow the queue is dropped and the subscriber gets a fresh
snapshot instead (it is behind anyway). Load reports are coalesced: a subscriber that has
not read the previous one gets only the latest.

The subscriber's side: a worker numbers its KV events 1, 2, 3... per incarnation; a
snapshot carries the number of the last event it includes and a load report the number
of the last KV event sent before it. So a router can tell, from any event, whether it
missed or reordered one: then what it knows of that worker may be wrong, and only a
fresh snapshot (a dump) puts it right. :class:`EventSequencer` is that check, with no
I/O: the gRPC client uses it to resubscribe, the fleet simulator to ask its simulated
worker for a dump.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable

from runtime.rpc import types as wire


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: deque[wire.WorkerEvent] = deque()
        self.needs_snapshot = True
        self.load: wire.LoadReport | None = None
        self.wake = asyncio.Event()
        self.resyncs = 0

    def notify(self) -> None:
        try:
            in_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            self.wake.set()
        else:
            self.loop.call_soon_threadsafe(self.wake.set)


class KvEventPublisher:
    def __init__(self, incarnation_id: str, max_queue: int = 4096) -> None:
        self.incarnation_id = incarnation_id
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._blocks: Counter[int] = Counter()  # hash -> number of cached blocks with it
        self._sequence = 0
        self._load = wire.LoadReport()
        self._subscribers: set[_Subscriber] = set()

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def cached_hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._blocks)

    def stored(self, block_hashes: Iterable[int], parent_hash: int | None = None) -> None:
        hashes = tuple(block_hashes)
        if not hashes:
            return
        with self._lock:
            self._blocks.update(hashes)
            self._emit(wire.KvStored(self.incarnation_id, self._next(), hashes, parent_hash))

    def removed(self, block_hashes: Iterable[int]) -> None:
        hashes = tuple(block_hashes)
        if not hashes:
            return
        with self._lock:
            for h in hashes:
                left = self._blocks[h] - 1
                if left > 0:
                    self._blocks[h] = left
                else:
                    self._blocks.pop(h, None)
            self._emit(wire.KvRemoved(self.incarnation_id, self._next(), hashes))

    def publish(self, changes: Iterable[tuple[str, Iterable[int]]]) -> None:
        """What a prefix cache stored and evicted, in order: ``("stored" | "removed",
        block hashes)`` pairs, as ``EngineCore.drain_kv_events`` returns them after a step."""
        for kind, hashes in changes:
            if kind == "stored":
                self.stored(hashes)
            else:
                self.removed(hashes)

    def cleared(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._emit(wire.KvCleared(self.incarnation_id, self._next()))

    def update_load(self, load: wire.LoadReport) -> None:
        with self._lock:
            self._load = load
            for sub in self._subscribers:
                sub.load = load
                sub.notify()

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence

    def _emit(self, event: wire.WorkerEvent) -> None:
        for sub in self._subscribers:
            if sub.needs_snapshot:
                continue  # the snapshot it is about to get includes this event
            if len(sub.queue) >= self.max_queue:
                sub.queue.clear()
                sub.needs_snapshot = True
                sub.resyncs += 1
            else:
                sub.queue.append(event)
            sub.notify()

    async def subscribe(self) -> AsyncIterator[wire.WorkerEvent]:
        """A snapshot and the current load, then every change; ends when closed."""
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            self._subscribers.add(sub)
            sub.load = self._load
        try:
            while True:
                batch: list[wire.WorkerEvent] = []
                with self._lock:
                    if sub.needs_snapshot:
                        sub.needs_snapshot = False
                        blocks = frozenset(self._blocks)
                        batch.append(wire.KvSnapshot(self.incarnation_id, self._sequence, blocks))
                    batch.extend(sub.queue)
                    sub.queue.clear()
                    if sub.load is not None:
                        batch.append(wire.LoadUpdate(self.incarnation_id, self._sequence, sub.load))
                        sub.load = None
                    sub.wake.clear()
                if not batch:
                    await sub.wake.wait()
                    continue
                for event in batch:
                    yield event
        finally:
            with self._lock:
                self._subscribers.discard(sub)


class Verdict(enum.Enum):
    APPLY = "apply"  # in step: use it
    SKIP = "skip"  # nothing to go on yet (no snapshot since the (re)subscription)
    RESYNC = "resync"  # out of step: discard what is known, get a snapshot


class EventSequencer:
    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.last = -1  # the sequence of the last KV event applied; -1: no snapshot yet

    def reset(self) -> None:
        """A new subscription: wait for its snapshot."""
        self.incarnation, self.last = None, -1

    def check(self, event: wire.WorkerEvent) -> Verdict:
        if isinstance(event, wire.KvSnapshot):
            self.incarnation, self.last = event.incarnation_id, event.sequence
            return Verdict.APPLY
        if self.last < 0:
            return Verdict.SKIP
        if event.incarnation_id != self.incarnation:
            return Verdict.RESYNC  # the worker restarted: its cache is another one
        if isinstance(event, wire.LoadUpdate):
            # it names the last KV event sent before it: any other number is a gap
            return Verdict.APPLY if event.sequence == self.last else Verdict.RESYNC
        if event.sequence != self.last + 1:
            return Verdict.RESYNC
        self.last = event.sequence
        return Verdict.APPLY

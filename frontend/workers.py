"""The decode workers this frontend can use: discovery, clients, in-flight counts, load.

The pool follows ``discovery.watch("decode")``: a join adds a worker, a leave drops it,
an update replaces its record (a new incarnation arrives as a leave then a join). A
worker's gRPC client is created on first use (or at join when the router wants worker
events) and closed once the worker has left and its last request here has ended, so
that a worker draining its requests after unregistering is not cut off.

Requests take a :class:`Lease` on a worker: it counts the request as in flight there
until released. A worker that failed a request with a retryable error is avoided for
``cooldown_s`` unless no other worker is left. With a deployment secret, a client takes
only answers that prove they come from its worker (``runtime/rpc/auth.py``); one that
does not is such an error (UNAVAILABLE), and counted through ``on_proof_failure``.

Load shedding at the edge (`check_admission`): when the decode pool is saturated, refuse
a request at once (429 with ``Retry-After``) rather than queue it without bound.

A worker's queue is the requests it holds beyond those its engine runs: queued in its
scheduler or waiting for a remote prefill, as its load reports say, or this frontend's
requests in flight there when more (those sent since its last report). The pool is
saturated for a request when **every** worker's queue is at least the bound for the
request's class, counting the requests admitted before it that are not on a worker yet
(a burst is admitted in the time it takes to tokenize one request), so a request is
refused only when no worker has room for it; the router is free to pick any worker
otherwise.

The bound is ``max_queued_per_worker`` when configured, else each worker's own
(``WorkerInfo.max_queued``, its ``--max-queued-requests``), so by default the edge
refuses exactly what the worker would, but before tokenizing and without a round trip.

Two classes: *interactive* (the default) is refused at the bound;
*batch* (``X-Priority: batch``, or a ``priority`` above 0 in the body, lower running
first as on the workers' priority scheduling) is refused once every queue is
``batch_share`` of that full, so an overload sheds batch traffic first and keeps room
for interactive requests. ``max_in_flight`` bounds this frontend's own concurrent
requests whatever the workers say (memory, sockets).

Each decode worker bounds its own queue too (``--max-queued-requests``), against
frontends that do not shed; its refusal (RESOURCE_EXHAUSTED) makes the frontend try
another worker and, when all are full, answer 429 as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from frontend.config import AdmissionConfig
from frontend.errors import Overloaded, ServiceUnavailable
from frontend.router import PullHint, Router, RouteRequest, WorkerView
from runtime.discovery import Discovery, EventKind
from runtime.rpc import (
    ClientOptions,
    DecodeWorkerClient,
    LoadReport,
    LoadUpdate,
    WorkerEvent,
    follow_events,
)
from runtime.tasks import cancel_and_wait
from runtime.worker_info import DETERMINISTIC_KEY, WorkerInfo

log = logging.getLogger(__name__)

ROLE = "decode"


@dataclass(eq=False)
class _Worker:
    info: WorkerInfo
    client: DecodeWorkerClient | None = None
    in_flight: int = 0
    load: LoadReport | None = None
    avoid_until: float = 0.0
    left: bool = False
    events_task: asyncio.Task[None] | None = field(default=None, repr=False)

    def view(self) -> WorkerView:
        return WorkerView(self.info.worker_id, self.info, self.in_flight, self.load)


class Lease:
    """One request's hold on a worker; :meth:`release` exactly once (more is harmless).
    :meth:`prefilled` and :meth:`release` tell the router what became of its choice."""

    def __init__(
        self, pool: WorkerPool, worker: _Worker, client: DecodeWorkerClient, route: RouteRequest,
        pull: PullHint | None = None,
    ) -> None:  # fmt: skip
        self._pool = pool
        self.pull = pull  # a peer the worker may pull the prompt's blocks from
        self._worker = worker
        self.client = client
        self.route = route
        self.worker_id = worker.info.worker_id
        self._released = False
        self._prefilled = False

    def prefilled(self, cached_tokens: int | None) -> None:
        """The first token arrived; ``cached_tokens`` as the worker reported it."""
        if not self._prefilled and not self._released:
            self._prefilled = True
            self._pool.router.on_prefilled(self.route, self.worker_id, cached_tokens)

    def release(self, output_token_ids: Sequence[int] = ()) -> None:
        if not self._released:
            self._released = True
            self._pool.router.on_finished(self.route, self.worker_id, output_token_ids)
            self._pool._release(self._worker)

    def failed(self) -> None:
        """The worker failed this request with a retryable error: avoid it for a while."""
        self._worker.avoid_until = time.monotonic() + self._pool.cooldown_s


class WorkerPool:
    def __init__(
        self,
        router: Router,
        *,
        cooldown_s: float = 5.0,
        client_options: ClientOptions | None = None,
        on_change: Callable[[int], None] | None = None,
        on_proof_failure: Callable[[], None] | None = None,
        max_held: int = 1024,
        on_held: Callable[[int], None] | None = None,
    ) -> None:
        self.router = router
        self.cooldown_s = cooldown_s
        self.client_options = client_options or ClientOptions()
        self._on_change = on_change
        self._on_proof_failure = on_proof_failure  # an answer not from the worker called
        self._workers: dict[str, _Worker] = {}
        self._leaving: set[_Worker] = set()  # left, with requests still in flight
        self._watch_task: asyncio.Task[None] | None = None
        self._closers: set[asyncio.Task[None]] = set()
        self._subscriber = f"frontend-{os.getpid()}"
        # requests waiting for a first worker to join (`acquire(wait_s=...)`)
        self.max_held = max_held
        self._on_held = on_held
        self.held = 0
        self._joined = asyncio.Event()

    # -- membership ------------------------------------------------------------------------
    def start(self, discovery: Discovery) -> None:
        """Follow the decode workers of ``discovery`` until :meth:`close`."""
        self._watch_task = asyncio.create_task(self._watch(discovery), name="frontend-watch")

    async def _watch(self, discovery: Discovery) -> None:
        while True:  # the watch resyncs by itself after backend errors; this is for bugs
            events = discovery.watch(ROLE)
            try:
                async for event in events:
                    if event.kind is EventKind.LEAVE:
                        self.remove(event.worker.worker_id)
                    else:
                        self.add(event.worker)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watching decode workers failed; watching again")
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            await asyncio.sleep(1.0)

    def add(self, info: WorkerInfo) -> None:
        """A worker joined, or its record changed (a new address means a new client)."""
        if not info.grpc_address:
            log.warning("decode worker %s registered no gRPC address; ignoring it", info.worker_id)
            return
        old = self._workers.get(info.worker_id)
        if old is not None:
            if (old.info.grpc_address, old.info.incarnation_id) == (
                info.grpc_address,
                info.incarnation_id,
            ):
                old.info = info
                return
            self.remove(info.worker_id)
        worker = _Worker(info)
        self._workers[info.worker_id] = worker
        log.info("decode worker %s joined at %s", info.worker_id, info.grpc_address)
        self.router.worker_joined(info)
        if self.router.wants_events:
            worker.events_task = asyncio.create_task(
                self._follow_events(worker), name=f"events {info.worker_id}"
            )
        self._joined.set()
        self._changed()

    def remove(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        log.info("decode worker %s left", worker_id)
        worker.left = True
        self.router.worker_left(worker_id)
        if worker.in_flight == 0:
            self._close_later(worker)
        else:
            self._leaving.add(worker)
        if not self._workers:
            self._joined.clear()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._workers))

    # -- what the app asks -----------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self._workers.values()]

    def max_model_len(self) -> int | None:
        """The smallest context window the workers state in their records."""
        lens = [w.info.max_model_len for w in self._workers.values() if w.info.max_model_len]
        return min(lens) if lens else None

    def deterministic(self) -> bool:
        """Whether there are workers and every one runs `--deterministic`."""
        infos = [w.info for w in self._workers.values()]
        return bool(infos) and all(i.extra.get(DETERMINISTIC_KEY) for i in infos)

    async def acquire(
        self, request: RouteRequest, exclude: Collection[str] = (), wait_s: float = 0.0
    ) -> Lease:
        """A lease on the worker the router picks among those not in ``exclude``; raises
        :class:`ServiceUnavailable` when there is none. With no worker at all (a pool
        scaled to zero) it first waits up to ``wait_s`` for one to join."""
        if not self._workers and wait_s > 0:
            await self._wait_for_a_worker(wait_s)
        candidates = [w for wid, w in self._workers.items() if wid not in exclude]
        if not candidates:
            if self._workers:
                raise ServiceUnavailable(
                    "every decode worker failed this request", code="no_worker_available"
                )
            raise ServiceUnavailable(
                "no decode worker is available; try again later", code="no_worker_available"
            )
        now = time.monotonic()
        healthy = [w for w in candidates if w.avoid_until <= now]
        candidates = healthy or candidates
        preferred = [w for w in healthy if w.info.worker_id == request.prefer]
        candidates = preferred or candidates  # the router still sees (and hooks) it
        chosen_id = self.router.select(request, [w.view() for w in candidates])
        pull = self.router.pull_hint(request)  # (asked before any await: the next select's)
        worker = self._workers.get(chosen_id)
        if worker is None or worker not in candidates:
            raise RuntimeError(f"router chose {chosen_id!r}, which is not a candidate")
        client = await self._client_of(worker)
        worker.in_flight += 1
        return Lease(self, worker, client, request, pull)

    async def _wait_for_a_worker(self, wait_s: float) -> None:
        if self.held >= self.max_held:
            raise ServiceUnavailable(
                f"no decode worker is available and {self.held} requests already wait for "
                "one; try again later",
                code="no_worker_available",
            )
        self._held_changed(1)
        try:
            await asyncio.wait_for(self._joined.wait(), wait_s)
        except TimeoutError:
            raise ServiceUnavailable(
                f"no decode worker joined within {wait_s:g} s; try again later",
                code="no_worker_available",
            ) from None
        finally:
            self._held_changed(-1)

    def _held_changed(self, by: int) -> None:
        self.held += by
        if self._on_held is not None:
            self._on_held(self.held)

    def _release(self, worker: _Worker) -> None:
        worker.in_flight -= 1
        if worker.left and worker.in_flight == 0 and worker in self._leaving:
            self._leaving.discard(worker)
            self._close_later(worker)

    # -- clients and events ------------------------------------------------------------------
    async def _client_of(self, worker: _Worker) -> DecodeWorkerClient:
        if worker.client is None:
            client = DecodeWorkerClient(
                worker.info.grpc_address, self.client_options,
                worker_id=worker.info.worker_id,  # with a secret: only its answers
                on_proof_failure=self._on_proof_failure,
            )  # fmt: skip
            await client.connect(wait=False)  # only creates the channel: no I/O
            worker.client = client
        return worker.client

    async def _follow_events(self, worker: _Worker) -> None:
        def on_event(wid: str, event: WorkerEvent) -> None:
            if isinstance(event, LoadUpdate):
                worker.load = event.load
            self.router.on_event(wid, event)

        client = await self._client_of(worker)
        await follow_events(client, worker.info.worker_id, on_event,
                            subscriber=self._subscriber, what="decode worker")  # fmt: skip

    def _close_later(self, worker: _Worker) -> None:
        task = asyncio.create_task(self._close_worker(worker))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _close_worker(self, worker: _Worker) -> None:
        await cancel_and_wait(worker.events_task)
        client, worker.client = worker.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    async def close(self) -> None:
        await cancel_and_wait(self._watch_task)
        for wid in list(self._workers):
            self.remove(wid)
        for worker in list(self._leaving):
            self._leaving.discard(worker)
            await self._close_worker(worker)
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)


PriorityClass = Literal["interactive", "batch"]


def priority_class(header: str | None, priority: int) -> PriorityClass:
    """``X-Priority: batch|interactive`` if given, else batch for a body ``priority``
    above 0; raises ValueError for another header value."""
    if header:
        h = header.strip().lower()
        if h not in ("batch", "interactive"):
            raise ValueError(f"X-Priority must be `interactive` or `batch`, got {header[:40]!r}")
        return "batch" if h == "batch" else "interactive"
    return "batch" if priority > 0 else "interactive"


def held_and_slots(view: WorkerView) -> tuple[int, int]:
    """The requests the worker holds, and how many of them it runs (or is about to), as
    best known here: while its last report shows nothing waiting, it has room to run up
    to its stated ``max_running`` (a burst fills those slots before a report says so)."""
    r = view.load
    capacity = view.info.max_running or 0
    if r is None:
        return view.in_flight, capacity
    held = max(r.active_requests, r.running_requests + r.waiting_requests, view.in_flight)
    return held, r.run_slots(capacity)


def queued(view: WorkerView) -> int:
    """Requests the worker holds beyond those it runs or is about to run."""
    held, slots = held_and_slots(view)
    return max(held - slots, 0)


def places(view: WorkerView, bound: int) -> int:
    """How many more requests the worker takes before its queue reaches ``bound``."""
    held, slots = held_and_slots(view)
    return max(bound + slots - held, 0)


def check_admission(
    config: AdmissionConfig,
    workers: Sequence[WorkerView],
    in_flight: int,
    cls: PriorityClass,
    unplaced: int = 0,
) -> None:
    """Raise :class:`Overloaded` when the request must be refused; ``in_flight`` is this
    frontend's requests now (not counting this one), ``unplaced`` those of them admitted
    and not yet on a worker (tokenizing, being routed): a burst is admitted faster than
    it is placed, and each of those takes a place under some worker's bound. With no
    worker at all it admits: the pool answers 503 for that, a different condition."""
    if config.max_in_flight and in_flight >= config.max_in_flight:
        raise Overloaded(
            f"this frontend is at its limit of {config.max_in_flight} requests in flight",
            config.retry_after_s,
        )
    if config.max_queued_per_worker == 0 or not workers:
        return
    bounds = [_bound(config, w, cls) for w in workers]
    if any(b is None for b in bounds):
        return  # a worker without a bound (none given, none stated) has room
    room = sum(places(w, b) for w, b in zip(workers, bounds) if b is not None)
    if room <= unplaced:  # the places left under the bounds are taken
        bound = min(b for b in bounds if b is not None)
        raise Overloaded(
            f"every decode worker has {bound} or more requests queued or on their way "
            f"({cls} requests are refused from {bound}); try again later",
            config.retry_after_s,
        )


def _bound(config: AdmissionConfig, view: WorkerView, cls: PriorityClass) -> int | None:
    """The queue bound of one worker for a class: the configured one, else the worker's."""
    bound = config.max_queued_per_worker
    if bound is None:
        bound = view.info.max_queued
    if bound is None:
        return None
    if cls == "batch":
        bound = max(math.floor(bound * config.batch_share), 1)
    return bound

"""Load shedding at the edge: when the decode pool is saturated, refuse a request at once
(429 with ``Retry-After``) rather than queue it without bound.

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

import math
from collections.abc import Sequence
from typing import Literal

from frontend.config import AdmissionConfig
from frontend.errors import Overloaded
from frontend.router import WorkerView

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
    slots = r.running_requests if r.waiting_requests else max(r.running_requests, capacity)
    return held, slots


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

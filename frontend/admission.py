"""Load shedding at the edge: when the decode pool is saturated, refuse a request at once
(429 with ``Retry-After``) rather than queue it without bound.

A worker's queue is the requests it holds beyond those its engine runs: queued in its
scheduler or waiting for a remote prefill, as its load reports say, or this frontend's
requests in flight there when more (those sent since its last report). The pool is
saturated for a request when **every** worker's queue is at least the bound for the
request's class, so a request is refused only when no worker has room for it; the
router is free to pick any worker otherwise.

Two classes: *interactive* (the default) is refused at ``max_queued_per_worker``;
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


def queued(view: WorkerView) -> int:
    """Requests the worker holds beyond those it runs, as best known here."""
    r = view.load
    if r is None:
        return view.in_flight
    held = max(r.active_requests, r.running_requests + r.waiting_requests, view.in_flight)
    return max(held - r.running_requests, 0)


def check_admission(
    config: AdmissionConfig,
    workers: Sequence[WorkerView],
    in_flight: int,
    cls: PriorityClass,
) -> None:
    """Raise :class:`Overloaded` when the request must be refused; ``in_flight`` is this
    frontend's requests now (not counting this one). With no worker at all it admits:
    the pool answers 503 for that, a different condition."""
    if config.max_in_flight is not None and in_flight >= config.max_in_flight:
        raise Overloaded(
            f"this frontend is at its limit of {config.max_in_flight} requests in flight",
            config.retry_after_s,
        )
    bound = config.max_queued_per_worker
    if bound is None or not workers:
        return
    if cls == "batch":
        bound = max(math.floor(bound * config.batch_share), 1)
    shortest = min(queued(w) for w in workers)
    if shortest >= bound:
        raise Overloaded(
            f"every decode worker has {shortest} or more requests queued "
            f"({cls} requests are refused from {bound}); try again later",
            config.retry_after_s,
        )

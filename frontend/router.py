"""Choosing a decode worker for a request: the :class:`Router` interface and least-loaded.

A router sees each candidate as a :class:`WorkerView` (its discovery record, the
requests this frontend has on it, and the last load it reported) and the request's
prompt token ids. Routers that need more (a KV-aware router scores cached prefixes)
set ``wants_events``: the pool then subscribes to every worker's Events stream and
passes each event to :meth:`Router.on_event`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.rpc import LoadReport, WorkerEvent
from runtime.worker_info import WorkerInfo


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # 0 for the first try; a retry or a migration counts up (its prompt then holds the
    # tokens generated so far).
    attempt: int = 0
    cache_salt: str = ""  # enters the block hashes, as on the workers
    session_id: str | None = None  # the client's conversation (X-Session-Id or `user`)
    # A worker to use when it is a healthy candidate (the sibling choices of n > 1 go
    # where the first choice's prompt is cached).
    prefer: str | None = None

    @property
    def key(self) -> str:
        """Names this attempt in the router's hooks."""
        return f"{self.request_id}#{self.attempt}"


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    info: WorkerInfo
    in_flight: int  # requests this frontend has on the worker now
    load: LoadReport | None  # the worker's last load report, if it sends them


class Router(abc.ABC):
    """Picks one of the candidate workers; called on the event loop, must not block."""

    wants_events: bool = False

    @abc.abstractmethod
    def select(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> str:
        """The ``worker_id`` of one of ``candidates`` (never empty)."""

    def worker_joined(self, info: WorkerInfo) -> None:  # noqa: B027 - optional hook
        """A worker registered (or restarted: then it left first)."""

    def worker_left(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """A worker unregistered or its lease expired; forget what is known of it."""

    def on_event(self, worker_id: str, event: WorkerEvent) -> None:  # noqa: B027
        """A KV or load event from the worker's Events stream (``wants_events`` only).
        Every (re)subscription starts with a ``KvSnapshot`` replacing earlier state."""

    def on_prefilled(  # noqa: B027 - optional hook
        self, request: RouteRequest, worker_id: str, cached_tokens: int | None
    ) -> None:
        """The attempt's first token arrived; ``cached_tokens`` is the prompt's prefix-cache
        hit on the worker, as it reported it (None if it did not)."""

    def on_finished(  # noqa: B027 - optional hook
        self, request: RouteRequest, worker_id: str, output_token_ids: Sequence[int]
    ) -> None:
        """The attempt ended, however it did, after generating ``output_token_ids``."""


class LeastLoadedRouter(Router):
    """The worker with the fewest requests; ties go round-robin.

    A worker's load is the number of requests this frontend has on it, or, with load
    reports, the larger of that and the running plus waiting requests it reported (so
    requests of other frontends count, and a report that predates this frontend's last
    requests does not hide them). Among equals, the lower KV usage wins.
    """

    def __init__(self, use_load_reports: bool = True) -> None:
        self.wants_events = use_load_reports
        self._turn = 0

    def load_of(self, view: WorkerView) -> tuple[int, float]:
        load = view.in_flight
        usage = 0.0
        if self.wants_events and view.load is not None:
            load = max(load, view.load.running_requests + view.load.waiting_requests)
            usage = view.load.kv_usage
        return load, usage

    def select(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> str:
        scores = [self.load_of(v) for v in candidates]
        best = min(scores)
        tied = [v for v, s in zip(candidates, scores) if s == best]
        self._turn += 1
        return tied[self._turn % len(tied)].worker_id

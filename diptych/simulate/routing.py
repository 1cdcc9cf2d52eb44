"""Routing in the fleet simulator: the frontend's routers, fed as a live fleet feeds them.

`SimRouting` holds one router per frontend replica (requests go to the replicas in
turn, as a load balancer in front of them would send them) and plays the decode
workers' side of the Events stream:

    KV events    what a worker's prefix cache stored and evicted in a step, delivered to
                 every replica `event_latency_s` after the step ends (in order)
    load         a report when a worker admits a request, hands it its first token or
                 finishes it (as `decode_worker/worker.py` does), and after every step,
                 each delivered `event_latency_s` later

so the replicas know each other's requests only through the workers, with the delay a
real network adds. The routers are the frontend's own (`LeastLoadedRouter`,
`KvRouter`); `OracleRouter` is the KV router knowing every cache instead: each
worker's prefix cache read directly at decision time, no event lost or late (its
load comes from the same reports), the bound the real index is measured against.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from diptych.simulate.options import ROUTERS
from diptych.simulate.worker import SimWorker
from frontend.config import KvRouterConfig
from frontend.router import KvRouter, LeastLoadedRouter, Router, RouteRequest, WorkerView
from protocol.kv_layout import KvTier, hash_blocks
from runtime.rpc.types import KvRemoved, KvStored, LoadReport, LoadUpdate, WorkerEvent
from runtime.worker_info import WorkerInfo


@dataclass(frozen=True)
class RoutingConfig:
    router: str = "kv"
    frontends: int = 1  # replicas, each with its own router
    event_latency_s: float = 1e-3  # worker -> frontend: KV events and load reports
    kv: KvRouterConfig = field(default_factory=KvRouterConfig)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.frontends < 1 or self.event_latency_s < 0:
            raise ValueError("need >= 1 frontend and event_latency_s >= 0")


class Scheduler(Protocol):
    now: float

    def at(self, time: float, action: Callable[[], object]) -> None: ...


@dataclass
class _Counts:
    """A decode worker's handler-side counters (what its load reports say)."""

    active: int = 0
    prefill: int = 0
    tokens: int = 0  # context of the active requests
    sequence: int = 0  # of its KV events


class OracleRouter(KvRouter):
    """The KV router reading each live worker's prefix cache itself."""

    def __init__(
        self, config: KvRouterConfig, workers: Callable[[], Sequence[SimWorker]],
        clock: Callable[[], float],
    ) -> None:  # fmt: skip
        super().__init__(dataclasses.replace(config, kv_events=True), clock=clock)
        self._workers = workers

    def _match(self, hashes: list[int], now: float) -> dict[str, int]:
        out = {}
        for w in self._workers():
            cached = w.core.kv.pool.cached
            k = 0
            while k < len(hashes) and hashes[k] in cached:
                k += 1
            if k:
                out[w.name] = k
        return out


class SimRouting:
    def __init__(
        self, config: RoutingConfig, clock: Scheduler, workers: Callable[[], Sequence[SimWorker]]
    ) -> None:
        self.config = config
        self._clock = clock
        self._workers = workers
        self.counts: dict[str, _Counts] = {}
        self.routers: list[Router] = [self._router(i) for i in range(config.frontends)]
        self._turn = itertools.count()
        self._routes: dict[str, tuple[Router, RouteRequest, str]] = {}
        self._prefill: dict[str, int] = {}  # request id -> prompt tokens prefilled here
        self._tokens: dict[str, int] = {}  # request id -> its context
        self.pulled_blocks = 0  # written into a worker's pool by a peer (`pull_prefix`)

    def _router(self, i: int) -> Router:
        c = self.config
        kv = dataclasses.replace(c.kv, seed=(c.kv.seed or 0) + i)
        if c.router == "least-loaded":
            return LeastLoadedRouter(use_load_reports=False)
        if c.router == "oracle":
            return OracleRouter(kv, self._workers, lambda: self._clock.now)
        if c.router == "kv-approx":
            kv = dataclasses.replace(kv, kv_events=False)
        elif c.router == "kv-session":
            kv = dataclasses.replace(kv, session_affinity=True)
        return KvRouter(kv, clock=lambda: self._clock.now)

    @property
    def wants_events(self) -> bool:
        return self.config.router != "least-loaded"

    # -- membership ---------------------------------------------------------------------
    def joined(self, w: SimWorker, model: str) -> WorkerInfo:
        info = WorkerInfo(w.name, "decode", model, kv_layout=w.core.layout)
        self.counts[w.name] = _Counts()
        if self.wants_events:
            w.core.record_kv_events()
        for r in self.routers:
            r.worker_joined(info)
        return info

    def left(self, name: str) -> None:
        for r in self.routers:
            r.worker_left(name)

    # -- requests -----------------------------------------------------------------------
    def route(
        self,
        rid: str,
        prompt: Sequence[int],
        session: str | None,
        views: list[WorkerView],
        workers: dict[str, SimWorker],
    ) -> str:
        """A replica's choice; the worker counts the request from now (the simulator
        has no request hop), its prefill estimated from its cache until admitted."""
        router = self.routers[next(self._turn) % len(self.routers)]
        request = RouteRequest(rid, tuple(prompt), session_id=session)
        name = router.select(request, views)
        self._routes[rid] = (router, request, name)
        w = workers[name]
        pull = router.pull_hint(request)
        if pull is not None and pull.holder in workers:
            self.pulled_blocks += pull_prefix(w, workers[pull.holder], rid, prompt, pull.blocks)
        guess = len(prompt) - w.core.snapshot().prefix_hit(prompt)
        self.counts[name].active += 1
        self.counts[name].tokens += len(prompt)
        self._tokens[rid] = len(prompt)
        self._set_prefill(w, rid, guess)
        return name

    def admitted(self, w: SimWorker, rid: str, prefill_here: int) -> None:
        self._set_prefill(w, rid, prefill_here)

    def first_token(self, w: SimWorker, rid: str, cached_tokens: int | None) -> None:
        self._set_prefill(w, rid, 0)
        router, request, name = self._routes[rid]
        router.on_prefilled(request, name, cached_tokens)

    def finished(self, w: SimWorker, rid: str) -> None:
        self._set_prefill(w, rid, 0)
        self._prefill.pop(rid, None)
        self.counts[w.name].active -= 1
        self.counts[w.name].tokens -= self._tokens.pop(rid, 0)
        self.report(w)
        router, request, name = self._routes.pop(rid)
        router.on_finished(request, name, ())
        self.report(w)

    def generated(self, w: SimWorker, rid: str, tokens: int) -> None:
        """Output tokens: the request's context grows (reported with the step)."""
        if rid in self._tokens:
            self._tokens[rid] += tokens
            self.counts[w.name].tokens += tokens

    def _set_prefill(self, w: SimWorker, rid: str, tokens: int) -> None:
        tokens = max(tokens, 0)
        before = self._prefill.get(rid, 0)
        if tokens != before:
            self.counts[w.name].prefill += tokens - before
            self._prefill[rid] = tokens
            self.report(w)

    # -- the Events stream --------------------------------------------------------------
    def step_ended(self, w: SimWorker) -> None:
        """Deliver what the worker's cache did and its load, one latency from now."""
        if not self.wants_events:
            return
        c = self.counts[w.name]
        events: list[WorkerEvent] = []
        for kind, hashes in w.core.drain_kv_events():
            c.sequence += 1
            if kind == "removed":
                events.append(KvRemoved(w.name, c.sequence, tuple(hashes)))
            else:  # "stored", or moved into a tier ("host", "disk")
                tier = 0 if kind == "stored" else KvTier[kind.upper()]
                events.append(KvStored(w.name, c.sequence, tuple(hashes), tier=tier))
        events.append(self._load(w))
        self._deliver(w.name, events)

    def report(self, w: SimWorker) -> None:
        if self.wants_events:
            self._deliver(w.name, [self._load(w)])

    def _load(self, w: SimWorker) -> LoadUpdate:
        c = self.counts[w.name]
        s = w.core.snapshot()
        load = LoadReport(
            running_requests=s.running, waiting_requests=s.waiting,
            kv_used_blocks=s.kv_used_blocks, kv_total_blocks=s.kv_total_blocks,
            active_requests=c.active, prefill_tokens_pending=max(c.prefill, 0),
            active_tokens=max(c.tokens, 0),
        )  # fmt: skip
        return LoadUpdate(w.name, c.sequence, load)

    def _deliver(self, name: str, events: list[WorkerEvent]) -> None:
        def land() -> None:
            for r in self.routers:
                for e in events:
                    r.on_event(name, e)

        self._clock.at(self._clock.now + self.config.event_latency_s, land)


def pull_prefix(w: SimWorker, holder: SimWorker, rid: str, prompt: Sequence[int],
                blocks: int) -> int:  # fmt: skip
    """A decode worker's pull of the prompt's first `blocks` blocks from `holder`
    (decode_worker/peer_kv.py), through the same engine calls, at once: the copy's time
    (the blocks' bytes at the host link's speed, as a tier's restore) is charged to the
    puller's next step, the round trip's latency is not modelled; how many it got."""
    bs = w.core.layout.block_size
    hashes = hash_blocks(prompt[: min(blocks, (len(prompt) - 1) // bs) * bs], bs)
    have, dst = w.core.reserve_peer_blocks(f"pull {rid}", hashes)
    want = hashes[have : have + len(dst)]
    src = holder.core.pin_peer_blocks(f"push {rid}", want)
    w.core.runner.write_blocks(dst[: len(src)], holder.core.runner.read_blocks(src))
    holder.core.release_peer_blocks(f"push {rid}")
    return w.core.commit_peer_blocks(f"pull {rid}", want[: len(src)])


def routing_summary(fleet: _FleetLike) -> dict[str, float]:
    """The share of prompt tokens the decode workers found cached, and how evenly the
    requests spread: max over mean requests in flight per decode worker, at each
    timeline sample of the run's middle 80 % (where the mean is at least one)."""
    engines = [w.core for w in fleet.decode + fleet.retired if w.role == "decode"]
    queried = sum(e.scheduler.prefix_queried_tokens for e in engines)
    hit = sum(e.scheduler.prefix_hit_tokens for e in engines)
    end = fleet.spread[-1][0] if fleet.spread else 0.0
    middle = [c for t, c in fleet.spread if 0.1 * end <= t <= 0.9 * end and c]
    ratios = sorted(max(c) / (sum(c) / len(c)) for c in middle if sum(c) >= len(c)) or [1.0]
    mean_in_flight = sum(sum(c) / len(c) for c in middle) / max(len(middle), 1)
    return {
        "prefix_hit_rate": hit / queried if queried else 0.0,
        "spread_mean": sum(ratios) / len(ratios),
        "spread_p50": ratios[len(ratios) // 2],
        "spread_p95": ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))],
        "spread_max": ratios[-1],
        "spread_samples": len(ratios),
        "mean_in_flight": mean_in_flight,
        "peer_pulled_blocks": fleet.routing.pulled_blocks,
    }


class _FleetLike(Protocol):
    routing: SimRouting
    decode: list[SimWorker]
    retired: list[SimWorker]
    spread: list[tuple[float, list[int]]]

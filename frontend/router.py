"""Choosing a decode worker for a request: the :class:`Router` interface and least-loaded.

A router sees each candidate as a :class:`WorkerView` (its discovery record, the
requests this frontend has on it, and the last load it reported) and the request's
prompt token ids. Routers that need more (a KV-aware router scores cached prefixes)
set ``wants_events``: the pool then subscribes to every worker's Events stream and
passes each event to :meth:`Router.on_event`.

KV-aware routing (:class:`KvRouter`): the decode worker that holds most of the prompt,
without piling on it.

For each candidate worker the router prices what sending the request there costs, in
KV blocks, and takes the cheapest (or samples, with a temperature):

    cost(w) = overlap_weight * prefill(w) + decode(w)
    prefill(w) = (prompt tokens w does not hold + prompt tokens w has still to prefill) / B
    decode(w)  = (tokens of context over the requests on w, prompt and output) / B

So a worker that holds a 4k-token conversation wins it unless its requests carry more
than 16k tokens of context beyond the others' (overlap_weight 4). Decode load counts each
request's whole context, shared prefixes included (every request reads its own context
each step), so a worker that serves many requests over one popular system prompt is
not made to look idle by the blocks they share: that prompt is no magnet. There is no
fleet-wide switch between "affinity" and "balance" (as in routers that stop using the
cache past an imbalance threshold): each decision weighs both.

What a worker holds comes from its KV events (``runtime/kv_index.py``), or, with
``kv_events=False`` (workers that publish none), from what this router's own routing
predicts it caches, forgotten after ``predict_ttl_s``. With events, a prompt whose first
token came back also counts as held by its worker for ``RECENT_S`` or until an event
about those blocks arrives: a client that sends the next turn the moment the last one
ends may otherwise be routed a few milliseconds before the worker's events say what
that turn cached (and likewise while the router's first snapshot of a worker is on its
way). Its load is an estimate (below). With ``session_affinity`` a
client's session id (``X-Session-Id`` or the body's ``user``) is a sticky hint: the
worker that served the session's last turn is assumed to hold that turn's prompt, so
the cost of moving the session (re-prefilling its history) is priced even when the
index does not know it.

The router is a plain object fed events and asked for decisions, with the clock passed
in: the frontend's worker pool drives it live, the fleet simulator in virtual time.

Each worker's load is estimated from its reports plus this router's own requests the
reports cannot include yet. A worker reports its load (``LoadReport``) after every
engine step and whenever it admits or finishes a request, to every router subscribed,
so routers in several frontends see each other's requests one network hop after they
reach the worker. A report cannot include what this router sent after it was written,
so the estimate is

    reported + this router's requests sent to the worker since the last report arrived

taken no lower than this router's own requests on the worker (a report written before
a burst of ours reached the worker must not hide the burst). Without reports, the
estimate is this router's own requests alone.
"""

from __future__ import annotations

import abc
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from frontend.config import KvRouterConfig
from protocol.kv_layout import KvTier, hash_blocks
from protocol.lora import AdapterRef
from runtime.kv_index import KvIndex, PredictedIndex
from runtime.rpc import LoadReport, WorkerEvent
from runtime.rpc.types import (
    DISK_COST,
    HOST_COST,
    KvCleared,
    KvRemoved,
    KvSnapshot,
    KvStored,
    LoadUpdate,
)
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
    lora: AdapterRef | None = None  # the LoRA adapter it runs: in the block hashes too

    @property
    def key(self) -> str:
        """Names this attempt in the router's hooks."""
        return f"{self.request_id}#{self.attempt}"


@dataclass(frozen=True)
class PullHint:
    """Worker `holder` holds the prompt's first `blocks` blocks, more than the chosen
    worker: the chosen one may have them written into its pool instead of computing
    them (`GenerateRequest.kv_peer`)."""

    holder: str
    blocks: int


def _no_pull(i: int) -> PullHint | None:
    """No candidate pulls (pulls off, or nobody holds enough of the prompt)."""
    return None


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

    def pull_hint(self, request: RouteRequest) -> PullHint | None:
        """Asked right after `select`: a peer the chosen worker may pull the prompt's
        blocks from (only routers that price pulls give one)."""
        return None

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


@dataclass
class Load:
    requests: int = 0  # admitted and not finished
    prefill_tokens: int = 0  # prompt tokens still to prefill
    tokens: int = 0  # context of those requests: what each decode step reads

    def add(self, other: Load, sign: int = 1) -> None:
        self.requests += sign * other.requests
        self.prefill_tokens += sign * other.prefill_tokens
        self.tokens += sign * other.tokens


@dataclass
class Routed:
    """One attempt this router sent to a worker, and what it adds to the worker's load."""

    worker_id: str
    load: Load
    predicted_cached: int  # prompt tokens the router expected the worker to hold
    hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks


@dataclass
class WorkerLoad:
    block_size: int = 16
    report: LoadReport | None = None
    own: Load = field(default_factory=Load)  # every attempt of ours in flight there
    since_report: dict[str, Routed] = field(default_factory=dict)  # sent after it arrived
    _since: Load = field(default_factory=Load)
    _estimate: Load | None = None  # until the next change (most decisions change one worker)

    def sent(self, key: str, routed: Routed) -> None:
        self.own.add(routed.load)
        self.since_report[key] = routed
        self._since.add(routed.load)
        self._estimate = None

    def prefilled(self, key: str, routed: Routed) -> None:
        """Its prompt is prefilled: it no longer adds prefill work."""
        tokens = routed.load.prefill_tokens
        routed.load.prefill_tokens = 0
        self.own.prefill_tokens -= tokens
        if key in self.since_report:
            self._since.prefill_tokens -= tokens
        self._estimate = None

    def finished(self, key: str, routed: Routed) -> None:
        self.own.add(routed.load, -1)
        if self.since_report.pop(key, None) is not None:
            self._since.add(routed.load, -1)
        self._estimate = None

    def reported(self, report: LoadReport) -> None:
        self.report = report
        self.since_report.clear()
        self._since = Load()
        self._estimate = None

    def estimate(self) -> Load:
        """The estimate (do not change it: it is kept until the next event)."""
        if self._estimate is None:
            self._estimate = self._compute()
        return self._estimate

    def _compute(self) -> Load:
        r, own = self.report, self.own
        if r is None:
            return Load(own.requests, own.prefill_tokens, own.tokens)
        s = self._since
        # a worker that predates active_requests reports only what its engine holds
        requests = max(r.active_requests, r.running_requests + r.waiting_requests)
        return Load(
            max(requests + s.requests, own.requests),
            max(r.prefill_tokens_pending + s.prefill_tokens, own.prefill_tokens),
            # a worker that predates active_tokens: its KV in use
            max((r.active_tokens or r.kv_used_blocks * self.block_size) + s.tokens, own.tokens),
        )


DEFAULT_BLOCK_SIZE = 16
RECENT_S = 10.0
MAX_SESSIONS = 1_000_000


@dataclass(frozen=True)
class Decision:
    worker_id: str
    # "prefix": it holds part of the prompt; "session": the sticky hint; "pull": it will
    # have another worker's blocks written into its pool; "load"
    reason: str
    prompt_tokens: int
    predicted_cached_tokens: int
    best_cached_tokens: int  # the most any candidate held
    candidates: int
    seconds: float  # wall time of the decision, hashing included


class RouterObserver:
    """What the router tells the frontend's metrics (no-ops here)."""

    def decided(self, decision: Decision) -> None:
        """A worker was chosen."""

    def prefilled(
        self, predicted_cached_tokens: int, cached_tokens: int, prompt_tokens: int
    ) -> None:
        """An attempt's first token came, with the worker's real prefix-cache hit."""


@dataclass
class _Session:
    worker_id: str
    blocks: int
    seen: float


class KvRouter(Router):
    wants_events = True

    def __init__(
        self,
        config: KvRouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: RouterObserver | None = None,
    ) -> None:
        self.config = config or KvRouterConfig()
        self.clock = clock
        self.observer = observer or RouterObserver()
        self.index = KvIndex()
        # predictions: the whole index without events; with them, recent prefills only
        ttl = RECENT_S if self.config.kv_events else self.config.predict_ttl_s
        self.predicted = PredictedIndex(ttl)
        self.loads: dict[str, WorkerLoad] = {}
        self._block_size: dict[str, int] = {}
        self._routed: dict[str, Routed] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._rng = random.Random(self.config.seed)
        self._pull: tuple[str, PullHint] | None = None  # the last decision's, until asked
        # per worker, the blocks it holds only in a tier under its pool (hash -> KvTier),
        # and what a hit there costs against computing it (host, disk) as it reports
        self._lower: dict[str, dict[int, int]] = {}
        self._restore_cost: dict[str, tuple[float, float]] = {}

    # -- membership and events ----------------------------------------------------------
    def worker_joined(self, info: WorkerInfo) -> None:
        wid = info.worker_id
        layout = info.kv_layout
        self._block_size[wid] = layout.block_size if layout else DEFAULT_BLOCK_SIZE
        self.loads[wid] = WorkerLoad(self._block_size[wid])
        self.index.add_worker(wid)
        self.predicted.add_worker(wid, layout.num_blocks if layout else None)

    def worker_left(self, worker_id: str) -> None:
        self._lower.pop(worker_id, None)
        self._restore_cost.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        self.predicted.remove_worker(worker_id)
        self.loads.pop(worker_id, None)
        self._block_size.pop(worker_id, None)

    def on_event(self, worker_id: str, event: WorkerEvent) -> None:
        if worker_id not in self.loads:
            return  # it left; a late event must not bring it back
        if isinstance(event, LoadUpdate):
            self.loads[worker_id].reported(event.load)
            extra = event.load.extra
            if HOST_COST in extra or DISK_COST in extra:
                c = self.config
                self._restore_cost[worker_id] = (
                    extra.get(HOST_COST, c.host_hit_cost), extra.get(DISK_COST, c.disk_hit_cost)
                )
        elif not self.config.kv_events:
            return
        elif isinstance(event, KvStored):
            self.index.stored(worker_id, event.block_hashes)
            lower = self._lower.get(worker_id)
            if event.tier:
                if lower is None:
                    lower = self._lower[worker_id] = {}
                lower.update(dict.fromkeys(event.block_hashes, event.tier))
            elif lower:
                for h in event.block_hashes:
                    lower.pop(h, None)
        elif isinstance(event, KvRemoved):
            self.index.removed(worker_id, event.block_hashes)
            self.predicted.forget(worker_id, event.block_hashes)  # the truth wins
            lower = self._lower.get(worker_id)
            if lower:
                for h in event.block_hashes:
                    lower.pop(h, None)
        elif isinstance(event, (KvSnapshot, KvCleared)):
            if isinstance(event, KvSnapshot):
                self.index.replace(worker_id, event.block_hashes)
                self._lower[worker_id] = dict(event.lower)
            else:
                self.index.clear(worker_id)
                self._lower.pop(worker_id, None)
            self.predicted.forget(worker_id)

    # -- the decision -------------------------------------------------------------------
    def select(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> str:
        started = time.perf_counter()
        now = self.clock()
        prompt = request.prompt_token_ids
        n = len(prompt)
        most = max(n - 1, 0)  # the last prompt token is always computed
        hashes_by_size: dict[int, list[int]] = {}
        matched_by_size: dict[int, dict[str, int]] = {}
        session = self._session(request.session_id, now)
        costs: list[float] = []
        cached: list[int] = []
        weight = self.config.overlap_weight
        block_size, loads = self._block_size, self.loads
        sizes = set(block_size.values())
        fast = session is None and len(sizes) == 1
        # one block size (the common case) and no session: the costs as one comprehension,
        # then those of the workers that hold some of the prompt; it runs for every
        # candidate of every request (192 in a simulated fleet), the same arithmetic
        if fast:
            (bs,) = sizes
            try:
                estimates = [loads[view.worker_id].estimate() for view in candidates]
            except KeyError:  # a candidate the router was not told about: the loop learns it
                fast = False
        if fast:
            salt = request.cache_salt or None
            hashes = hashes_by_size[bs] = hash_blocks(prompt, bs, salt=salt, adapter=request.lora)
            matched = matched_by_size[bs] = self._match(hashes, now)
            costs = [(weight * (n + e.prefill_tokens) + e.tokens) / bs for e in estimates]
            cached = [0] * len(candidates)
            if matched:
                for i, view in enumerate(candidates):
                    blocks = matched.get(view.worker_id, 0)
                    if blocks:
                        hit = min(blocks * bs, most)
                        e = estimates[i]
                        worth = hit - self._restore_tokens(view.worker_id, hashes, 0, hit // bs, bs)
                        costs[i] = (weight * (n - worth + e.prefill_tokens) + e.tokens) / bs
                        cached[i] = hit
        else:
            self._costs(request, candidates, session, now, hashes_by_size, matched_by_size,
                        costs, cached)  # fmt: skip
        if request.lora is not None:
            self._lora_costs(request.lora.name, candidates, costs)
        pull_of = self._pulls(candidates, hashes_by_size, matched_by_size, cached, costs, most)
        i = self._choose(costs)
        chosen = candidates[i].worker_id
        bs = block_size[chosen]
        pull = pull_of(i)
        self._pull = (request.key, pull) if pull is not None else None
        held = cached[i] if pull is None else min(pull.blocks * bs, most)
        self._record(request, chosen, held, bs, hashes_by_size[bs], now)
        index_hit = min(matched_by_size[bs].get(chosen, 0) * bs, most)
        if pull is not None:
            reason = "pull"
        elif cached[i] == 0:
            reason = "load"
        else:
            reason = "prefix" if index_hit == cached[i] else "session"
        self.observer.decided(
            Decision(chosen, reason, n, held, max(cached), len(candidates),
                     time.perf_counter() - started)
        )  # fmt: skip
        return chosen

    def _lora_costs(self, name: str, candidates: Sequence[WorkerView], costs: list[float]) -> None:
        """Charge a worker that does not hold LoRA adapter `name` in a device slot (as
        its last load report says) the load of it: `lora_load_tokens` of prefill."""
        extra = self.config.overlap_weight * self.config.lora_load_tokens
        for i, view in enumerate(candidates):
            load = self.loads.get(view.worker_id)
            report = load.report if load is not None else None
            if report is None or name not in report.lora_resident:
                costs[i] += extra / self._block_size.get(view.worker_id, 16)

    def _costs(
        self,
        request: RouteRequest,
        candidates: Sequence[WorkerView],
        session: _Session | None,
        now: float,
        hashes_by_size: dict[int, list[int]],
        matched_by_size: dict[int, dict[str, int]],
        costs: list[float],
        cached: list[int],
    ) -> None:
        """`select`'s costs candidate by candidate: workers of several block sizes, a
        session's worker, or a candidate not seen before."""
        prompt = request.prompt_token_ids
        n = len(prompt)
        most = max(n - 1, 0)
        weight = self.config.overlap_weight
        block_size, loads = self._block_size, self.loads
        bs_now, hashes, matched = 0, [], {}
        sessions_worker = session.worker_id if session is not None else None
        for view in candidates:
            wid = view.worker_id
            bs = block_size.get(wid) or self._learn(view.info)
            if bs != bs_now:
                if bs not in hashes_by_size:
                    salt = request.cache_salt or None
                    hashes = hashes_by_size[bs] = hash_blocks(
                        prompt, bs, salt=salt, adapter=request.lora
                    )
                    matched_by_size[bs] = self._match(hashes, now)
                bs_now, hashes, matched = bs, hashes_by_size[bs], matched_by_size[bs]
            hit = matched.get(wid, 0) * bs if matched else 0
            if wid == sessions_worker:
                assert session is not None
                hit = max(hit, min(session.blocks, len(hashes)) * bs)
            if hit > most:
                hit = most
            load = loads[wid].estimate()
            worth = hit - self._restore_tokens(wid, hashes, 0, hit // bs, bs)
            costs.append((weight * (n - worth + load.prefill_tokens) + load.tokens) / bs)
            cached.append(hit)

    def _restore_tokens(
        self, worker_id: str, hashes: list[int], start: int, stop: int, bs: int
    ) -> float:
        """What restoring the worker's blocks `hashes[start:stop]` from its tiers costs,
        in tokens of prefill: each block held only in a tier, at that tier's cost (no
        work at all for a worker whose blocks are all in its pool)."""
        lower = self._lower.get(worker_id)
        if not lower:
            return 0.0
        c = self.config
        host, disk = self._restore_cost.get(worker_id, (c.host_hit_cost, c.disk_hit_cost))
        cost = 0.0
        for h in hashes[start:stop]:
            tier = lower.get(h)
            if tier:
                cost += host if tier == KvTier.HOST else disk
        return cost * bs

    def _pulls(
        self,
        candidates: Sequence[WorkerView],
        hashes_by_size: dict[int, list[int]],
        matched_by_size: dict[int, dict[str, int]],
        cached: list[int],
        costs: list[float],
        most: int,
    ) -> Callable[[int], PullHint | None]:
        """Candidates that would pull the prompt's blocks another worker holds and they
        lack (`peer_pull`) get their costs lowered by the prefill the pull saves, less
        `peer_pull_cost` of it and what the holder's restore of blocks it keeps only in
        a tier costs; returned: the pull candidate i would make, if any. Candidates that
        hold as much of the prompt share one figure (most hold none): this runs for
        every candidate of every decision."""
        c = self.config
        if not c.peer_pull:
            return _no_pull
        best_by_size = {
            bs: max(matched.items(), key=lambda kv: kv[1])
            for bs, matched in matched_by_size.items() if matched
        }  # fmt: skip
        if max((b for _, b in best_by_size.values()), default=0) < c.peer_pull_min_blocks:
            return _no_pull  # (most decisions: nobody holds enough to be worth a pull)
        offers: dict[tuple[int, int], tuple[float, PullHint] | None] = {}

        def offer(bs: int, own: int) -> tuple[float, PullHint] | None:
            """(cost saved, the pull) for a candidate of block size `bs` that holds
            `own` blocks of the prompt; None: no pull is worth it."""
            key = (bs, own)
            if key not in offers:
                holder, blocks = best_by_size.get(bs, ("", 0))
                blocks = min(blocks, most // bs)
                made = None
                if blocks - own >= c.peer_pull_min_blocks:
                    restore = self._restore_tokens(holder, hashes_by_size[bs], own, blocks, bs)
                    saving = c.overlap_weight * (
                        (blocks - own) * (1.0 - c.peer_pull_cost) - restore / bs
                    )  # (costs are in blocks)
                    if saving > 0:
                        made = (saving, PullHint(holder, blocks))
                offers[key] = made
            return offers[key]

        sizes = self._block_size
        size_of = [sizes[view.worker_id] for view in candidates]
        for i, bs in enumerate(size_of):
            got = offer(bs, cached[i] // bs)  # (the holder's own: no gain, None)
            if got is not None:
                costs[i] -= got[0]

        def pull_of(i: int) -> PullHint | None:
            got = offer(size_of[i], cached[i] // size_of[i])
            return got[1] if got is not None else None

        return pull_of

    def pull_hint(self, request: RouteRequest) -> PullHint | None:
        """The pull the last `select` (of `request`) chose its worker for, if any."""
        last, self._pull = self._pull, None
        return last[1] if last is not None and last[0] == request.key else None

    def _learn(self, info: WorkerInfo) -> int:
        """A candidate the router was not told about (a test's view): track it now."""
        self.worker_joined(info)
        return self._block_size[info.worker_id]

    def _match(self, hashes: list[int], now: float) -> dict[str, int]:
        predicted = self.predicted.match(hashes, now)
        if not self.config.kv_events:
            return predicted
        matched = self.index.match(hashes)
        for wid, blocks in predicted.items():
            if blocks > matched.get(wid, 0):
                matched[wid] = blocks
        return matched

    def _choose(self, costs: list[float]) -> int:
        low = min(costs)
        t = self.config.temperature
        if t > 0 and len(costs) > 1:
            spread = max(max(costs) - low, 1e-9)
            weights = [math.exp(-(c - low) / (spread * t)) for c in costs]
            return self._rng.choices(range(len(costs)), weights)[0]
        best = [i for i, c in enumerate(costs) if c <= low + 1e-9]
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _record(
        self,
        request: RouteRequest,
        worker_id: str,
        hit: int,
        bs: int,
        hashes: list[int],
        now: float,
    ) -> None:
        n = len(request.prompt_token_ids)
        routed = Routed(worker_id, Load(1, n - hit, n), hit, hashes)
        self._routed[request.key] = routed
        self.loads[worker_id].sent(request.key, routed)
        if not self.config.kv_events:
            self.predicted.predict(worker_id, hashes, now)
        if request.session_id is not None and self.config.session_affinity:
            self._sessions[request.session_id] = _Session(worker_id, len(hashes), now)
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def _session(self, session_id: str | None, now: float) -> _Session | None:
        if session_id is None or not self.config.session_affinity:
            return None
        ttl = self.config.session_ttl_s
        while self._sessions:  # oldest first: drop the expired
            oldest = next(iter(self._sessions.values()))
            if oldest.seen + ttl > now:
                break
            self._sessions.popitem(last=False)
        return self._sessions.get(session_id)

    # -- what happened to the request ---------------------------------------------------
    def on_prefilled(
        self, request: RouteRequest, worker_id: str, cached_tokens: int | None
    ) -> None:
        routed = self._routed.get(request.key)
        if routed is None:
            return
        load = self.loads.get(worker_id)
        if load is not None:
            load.prefilled(request.key, routed)
            if self.config.kv_events:  # cached there now; its events may still be on the way
                self.predicted.predict(worker_id, routed.hashes, self.clock())
        if cached_tokens is not None:
            n = len(request.prompt_token_ids)
            self.observer.prefilled(routed.predicted_cached, min(cached_tokens, n), n)

    def on_finished(
        self, request: RouteRequest, worker_id: str, output_token_ids: Sequence[int]
    ) -> None:
        routed = self._routed.pop(request.key, None)
        if routed is None:
            return
        load = self.loads.get(worker_id)
        if load is not None:
            load.finished(request.key, routed)
        if not self.config.kv_events and output_token_ids and worker_id in self.loads:
            # the worker caches the blocks its reply filled too
            bs = self._block_size[worker_id]
            tokens = (*request.prompt_token_ids, *output_token_ids)
            hashes = hash_blocks(tokens, bs, salt=request.cache_salt or None, adapter=request.lora)
            self.predicted.predict(worker_id, hashes, self.clock())

    @property
    def indexed_blocks(self) -> int:
        """Entries in the index this router matches against (events or predictions)."""
        index = self.index if self.config.kv_events else self.predicted.index
        return index.num_blocks()

    @property
    def in_flight(self) -> int:
        """Attempts routed and not finished (for tests: back to 0 when idle)."""
        return len(self._routed)

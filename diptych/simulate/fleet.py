"""The fleet simulator's event loop: arrivals, routing, remote prefill, KV transfer.

    arrive      a frontend replica's router (`diptych/simulate/routing.py`: the KV-aware
                router by default, fed KV events and load reports with a network
                delay) picks a decode worker; the worker's engine admits the request
                (`EngineCore.submit`), pinning its blocks for a remote prefill when
                the decode worker's rule says so
                (prefill workers exist, fewer than `max_queue_depth` of its prefills
                are out, at least `min_remote_prefill_tokens` uncached)
    queue       remote prefills wait in one FIFO; a prefill worker takes one while it
                holds fewer than `max_batch` (as workers pull from JetStream)
    step end    a worker's step or run ends: its tokens reach the clients; a prefill
                worker's finished prompt starts its KV transfer
    land        the KV is in the decode worker's blocks (after `transfer_latency_s` +
                uncached tokens x the device's KV bytes per token / bandwidth): the
                prefill worker frees its blocks, the decode worker adopts the KV and
                streams the first token when its current step ends
    next turn   a multi-turn session's next request, `think_time` after the last ended
    scale       `Fleet.scale(pool, n)`: new workers are ready `startup_s` later (and
                paid for from the call); going ones drain as the real ones do: a
                decode worker takes no new requests, a prefill worker pulls no more
                from the queue, each leaves once it holds nothing (if the last
                prefill worker goes, queued prompts fall back to local prefill)

Time is a float in simulated seconds; nothing sleeps. Every worker is a `SimWorker`.

A watchdog ends a run that cannot finish with `SimulationStuck`, naming the workers
and requests involved, instead of spinning: a worker whose steps take no simulated
time and deliver nothing `watchdog_steps` times in a row (virtual time would stand
still), or open requests with nothing left to happen but housekeeping (virtual time
would run on forever).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from bench.request import Request as BenchRequest
from diptych.simulate.results import Recorder
from diptych.simulate.routing import RoutingConfig, SimRouting
from diptych.simulate.worker import Delivery, SimWorker
from diptych.simulate.workload import Workload, token_ids
from engine.config import EngineConfig
from engine.request import NewRequest, RemoteRule
from frontend.router import WorkerView
from protocol.sampling import SamplingParams

IB_EFFICIENCY = 375 / 400  # of an InfiniBand port's line rate (transfer_bytes_per_s)
# the simulated reasoning model's end-of-thinking token: an id no prompt uses
# (diptych/simulate/workload.py keeps the first ids out of prompts)
THINK_END = 1


@dataclass
class FleetConfig:
    engine: EngineConfig  # every worker's (its `sim` names the timing model)
    # the prefill workers' own, when they run another tensor-parallel size (None: `engine`)
    prefill_engine: EngineConfig | None = None
    decode_workers: int = 1
    prefill_workers: int = 0  # 0: aggregated
    min_remote_prefill_tokens: int = 128
    min_remote_prefill_share: float = 0.5
    max_local_prefill_tokens: int = 4096
    max_queue_depth: int = 64
    max_batch: int = 8
    # one worker's share of the RDMA fabric, as achieved: a 400 Gbit/s NDR port at the
    # 375 Gbit/s an ib_write_bw GPUDirect check must reach (Azure's ND H100 v5 node
    # health checks, azurehpc-health-checks conf/nd96isr_h100_v5.conf)
    transfer_bytes_per_s: float = 400e9 / 8 * IB_EFFICIENCY
    transfer_latency_s: float = 0.5e-3
    ignore_eos: bool = True
    fast_forward: bool = True  # False: step by step (slow; the runs' reference)
    sample_every_s: float | None = None  # the timeline's period (None: 1/400 of the sends)
    startup_s: float = 0.0  # from `Fleet.scale` to a new worker taking work
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # steps in a row that one worker may take at one instant, delivering nothing
    watchdog_steps: int = 1000

    def __post_init__(self) -> None:
        if self.decode_workers < 1 or self.prefill_workers < 0:
            raise ValueError("a fleet needs >= 1 decode worker and >= 0 prefill workers")
        if not self.transfer_bytes_per_s > 0:
            raise ValueError("transfer_bytes_per_s must be > 0")
        if self.watchdog_steps < 1:
            raise ValueError("watchdog_steps must be >= 1")

    def engine_of(self, pool: str) -> EngineConfig:
        """The engine a worker of `pool` runs."""
        if pool == "prefill" and self.prefill_engine is not None:
            return self.prefill_engine
        return self.engine


class SimulationStuck(RuntimeError):
    """The simulated fleet cannot finish its workload (the watchdog's verdict)."""


@dataclass
class _Remote:
    request_id: str
    prompt: list[int]
    decode: SimWorker
    uncached: int
    prefill: SimWorker | None = None
    first_token: int = 0
    queued_at: float = 0.0


class Fleet:
    def __init__(
        self, config: FleetConfig, workload: Workload, *, drop_prompts: bool = False
    ) -> None:
        """`drop_prompts`: the workload is this run's alone, so each prompt's text is let
        go once its request is sent (an hour of a busy fleet's prompts is ~0.4 GB)."""
        self.config = config
        self.workload = workload
        self._drop_prompts = drop_prompts
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        ff = config.fast_forward
        self.decode = [
            SimWorker(f"decode-{i}", "decode", config.engine, ff)
            for i in range(config.decode_workers)
        ]
        self.prefill = [
            SimWorker(f"prefill-{i}", "prefill", config.engine_of("prefill"), ff)
            for i in range(config.prefill_workers)
        ]
        self.kv_bytes_per_token = self.decode[0].runner.timing.kv_bytes_per_token
        self._model = self.decode[0].core.model_config.name
        self.routing = SimRouting(config.routing, self, lambda: self.live("decode"))
        self._infos = {w.name: self.routing.joined(w, self._model) for w in self.decode}
        self._by_name = {w.name: w for w in self.decode}
        self._views: dict[str, WorkerView] = {}
        self._first_token: set[str] = set()
        # (time, requests in flight on each live decode worker), at every timeline sample
        self.spread: list[tuple[float, list[int]]] = []
        self.in_flight = {w.name: 0 for w in self.decode}
        self.remote_out = {w.name: 0 for w in self.decode}
        self.prefill_held = {w.name: 0 for w in self.prefill}
        # scaling: workers going, starts not yet ready (and how many of those were
        # taken back), when each worker began to cost, what the gone ones cost
        self.draining: set[str] = set()
        self.starting = {"decode": 0, "prefill": 0}
        self._cancelled = {"decode": 0, "prefill": 0}
        self._names = {"decode": itertools.count(len(self.decode)),
                       "prefill": itertools.count(len(self.prefill))}  # fmt: skip
        self._since = {w.name: 0.0 for w in self.decode + self.prefill}
        self.retired_worker_s = {"prefill": 0.0, "decode": 0.0}  # by pool
        self.retired: list[SimWorker] = []
        self.housekeeping: list[Callable[[], object]] = [self._sample]
        self.queue: deque[_Remote] = deque()
        self.remotes: dict[str, _Remote] = {}
        self.recorder = Recorder()
        self._owner: dict[str, SimWorker] = {}
        # the watchdog's count: worker -> (instant, steps it took then, delivering nothing)
        self._spins: dict[str, tuple[float, int]] = {}

    # -- the loop ----------------------------------------------------------------------

    def at(self, time: float, action: Callable[[], object]) -> None:
        heapq.heappush(self._events, (time, next(self._seq), action))

    def run(self) -> Recorder:
        for i, t in enumerate(self.workload.send_at):
            if t is not None:
                self.at(t, functools.partial(self._arrive, i))
        if self.config.sample_every_s is None:
            last = max((t for t in self.workload.send_at if t is not None), default=0.0)
            self._sample_every = max(last / 400, 1e-3)
        else:
            self._sample_every = self.config.sample_every_s
        self.at(0.0, self._sample)
        events = self._events
        while events:
            self.now, _, action = heapq.heappop(events)
            action()
            if action in self.housekeeping and self.recorder.open and not self._pending():
                raise SimulationStuck(self._stuck(
                    f"{len(self.recorder.open)} request(s) are open but nothing is left to "
                    "happen (no step in flight, no arrival, transfer or start to come)",
                    self._holders(),
                ))  # fmt: skip
        self.recorder.end = self.now
        return self.recorder

    def _pending(self) -> bool:
        """Something beyond housekeeping is scheduled."""
        return any(e[2] not in self.housekeeping for e in self._events)

    def busy(self) -> bool:
        """Requests are open or work is scheduled, beyond periodic housekeeping (the
        timeline's samples, a planner's ticks), which would otherwise run forever."""
        return bool(self.recorder.open) or self._pending()

    def _sample(self) -> None:
        self.recorder.sample(self.now, self.decode, self.prefill, len(self.queue))
        self.spread.append((self.now, [self.in_flight[w.name] for w in self.live("decode")]))
        if self.busy():
            self.at(self.now + self._sample_every, self._sample)

    def _kick(self, w: SimWorker) -> None:
        if w.busy_until is None:
            end = w.start(self.now)
            if end is not None:
                self._watch(w, end)
                self._end_at(w, end)

    # -- the watchdog ------------------------------------------------------------------

    def _watch(self, w: SimWorker, end: float) -> None:
        """Count the steps `w` begins at this instant that end at it too (a step that
        delivers tokens resets the count, in `_ended`); too many in a row is a spin."""
        if end > self.now:
            self._spins.pop(w.name, None)
            return
        at, n = self._spins.get(w.name, (self.now, 0))
        n = n + 1 if at == self.now else 1
        self._spins[w.name] = (self.now, n)
        if n < self.config.watchdog_steps:
            return
        spinning = [v for v in self.decode + self.prefill
                    if self._spins.get(v.name, (None, 0))[0] == self.now]  # fmt: skip
        raise SimulationStuck(self._stuck(
            f"{w.name} took {n} steps in a row that took no simulated time and delivered "
            "no token (virtual time stands still)", spinning,
        ))  # fmt: skip

    def _holders(self) -> list[SimWorker]:
        """The workers holding the open requests, and the prefill workers."""
        owners = {self._owner[rid].name for rid in self.recorder.open if rid in self._owner}
        return [w for w in self.decode if w.name in owners] + self.prefill

    def _stuck(self, what: str, workers: list[SimWorker]) -> str:
        lines = [f"the simulation is stuck at t={self.now:.6f} s: {what}"]
        for w in workers:
            s = w.core.scheduler
            lines.append(
                f"  {w.name}: running {_ids(r.request_id for r in s.running)}, "
                f"waiting {_ids(r.request_id for r in s.waiting)}, "
                f"waiting for remote KV {_ids(s.remote_waiting)}, held {_ids(s.held)}; "
                f"{s.kv.num_free_blocks} of {s.kv.pool.num_usable_blocks} KV blocks free"
            )
        if self.queue:
            lines.append(f"  queued for a prefill worker: {_ids(r.request_id for r in self.queue)}")
        lines.append(f"  open requests: {_ids(self.recorder.open)}")
        return "\n".join(lines)

    def _end_at(self, w: SimWorker, end: float) -> None:
        version = w.version
        self.at(end, lambda: self._ended(w, version))

    def _do(self, w: SimWorker, action: Callable[[], object]) -> None:
        if w.do(self.now, action):
            assert w.busy_until is not None
            self._end_at(w, w.busy_until)
        self._kick(w)

    # -- requests ----------------------------------------------------------------------

    def _arrive(self, index: int) -> None:
        req: BenchRequest = self.workload.requests[index]
        rid = f"r{index}"
        prompt = token_ids(req.prompt)
        if self._drop_prompts:
            self.workload.requests[index] = dataclasses.replace(req, prompt="")
        params = SamplingParams(
            max_tokens=req.output_len, temperature=0.0, ignore_eos=self.config.ignore_eos
        )
        if req.thinking is not None:  # a reasoning model's block, opened by the prompt
            params = params.replace(max_reasoning_tokens=req.thinking, reasoning_open=True,
                                    reasoning_end=(THINK_END,))  # fmt: skip
        cache, in_flight = self._views, self.in_flight  # a view is made anew only when
        views = [  # the worker's count changed: 192 views a request cost half the routing
            v if (v := cache.get(w.name)) is not None and v.in_flight == in_flight[w.name]
            else self._view(w)
            for w in self.live("decode")
        ]  # fmt: skip
        session = None if req.session is None else f"s{req.session}"
        name = self.routing.route(rid, prompt, session, views, self._by_name)
        w = self._by_name[name]
        self.in_flight[name] += 1
        self._owner[rid] = w
        self.recorder.arrived(rid, index, self.now, len(prompt), req.tag)
        self._do(w, lambda: self._admit(w, NewRequest(rid, prompt, params)))

    def _view(self, w: SimWorker) -> WorkerView:
        view = WorkerView(w.name, self._infos[w.name], self.in_flight[w.name], None)
        self._views[w.name] = view
        return view

    def _admit(self, w: SimWorker, new: NewRequest) -> None:
        cfg = self.config
        remote_ok = self.live("prefill") and self.remote_out[w.name] < cfg.max_queue_depth
        rule = RemoteRule(cfg.min_remote_prefill_tokens, cfg.min_remote_prefill_share,
                          cfg.max_local_prefill_tokens)  # fmt: skip
        plan = w.core.submit(new, remote_min_uncached=rule if remote_ok else None)
        rid, n = new.request_id, len(new.prompt_token_ids)
        self.routing.admitted(w, rid, 0 if plan else n - w.core.prefix_hit_tokens(rid))
        if plan is None:
            return
        prompt = list(new.prompt_token_ids)
        uncached = len(prompt) - plan.num_cached_tokens
        remote = _Remote(new.request_id, prompt, w, uncached, queued_at=self.now)
        self.remote_out[w.name] += 1
        self.remotes[new.request_id] = remote
        self.queue.append(remote)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.queue:
            free = [p for p in self.live("prefill")
                    if self.prefill_held[p.name] < self.config.max_batch]  # fmt: skip
            if not free:
                return
            p = min(free, key=lambda p: self.prefill_held[p.name])
            remote = self.queue.popleft()
            remote.prefill = p
            self.prefill_held[p.name] += 1
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            new = NewRequest(remote.request_id, remote.prompt, params, hold_blocks=True)
            self._do(p, functools.partial(p.core.submit, new))

    def _ended(self, w: SimWorker, version: int) -> None:
        if w.version != version or w.busy_until is None:
            return  # a run cut short rescheduled its end
        deliveries = w.finish()
        if deliveries:
            self._spins.pop(w.name, None)
        if w.role == "prefill":
            for d in deliveries:
                self._prefilled(d)
        else:
            for d in deliveries:
                self._delivered(w, d)
            self.routing.step_ended(w)
        self._kick(w)
        self._retire_if_done(w)

    def _delivered(self, w: SimWorker, d: Delivery) -> None:
        self.recorder.tokens(d.request_id, d.time, d.tokens, d.step_s, d.thinking)
        self.routing.generated(w, d.request_id, d.tokens)
        if d.request_id not in self._first_token:
            req = w.core.scheduler.requests.get(d.request_id)
            self._first_token.add(d.request_id)
            self.routing.first_token(w, d.request_id, req.num_cached_tokens if req else None)
        if d.finished:
            self._finished(w, d.request_id)

    def _finished(self, w: SimWorker, rid: str) -> None:
        index = self.recorder.finished(rid, self.now)
        self.in_flight[w.name] -= 1
        self._owner.pop(rid, None)
        self._first_token.discard(rid)
        self.routing.finished(w, rid)
        self._retire_if_done(w)
        nxt = self.workload.next_turn.get(index)
        if nxt is not None:
            think = self.workload.requests[nxt].think_time
            self.at(self.now + think, lambda: self._arrive(nxt))

    # -- remote prefill ----------------------------------------------------------------

    def _prefilled(self, d: Delivery) -> None:
        remote = self.remotes[d.request_id]
        p = remote.prefill
        assert p is not None and d.finished
        req = p.core.scheduler.held[d.request_id]
        remote.first_token = req.output_token_ids[0]
        cfg = self.config
        nbytes = remote.uncached * self.kv_bytes_per_token
        land = self.now + cfg.transfer_latency_s + nbytes / cfg.transfer_bytes_per_s
        self.at(land, lambda: self._landed(remote))

    def _landed(self, remote: _Remote) -> None:
        p, w, rid = remote.prefill, remote.decode, remote.request_id
        assert p is not None
        del self.remotes[rid]
        self.prefill_held[p.name] -= 1
        self._do(p, lambda: p.core.release_held(rid))
        self.remote_out[w.name] -= 1
        self._do(w, lambda: self._adopt(w, rid, remote.first_token))
        self._dispatch()
        self._retire_if_done(p)

    def _adopt(self, w: SimWorker, rid: str, first_token: int) -> None:
        out = w.core.remote_kv_ready(rid, first_token)
        self.recorder.tokens(rid, self.now, 1, 0.0)
        self._first_token.add(rid)
        req = w.core.scheduler.requests.get(rid)
        self.routing.first_token(w, rid, max(req.num_cached_tokens, 0) if req else None)
        if out.finished:
            self._finished(w, rid)

    # -- scaling -----------------------------------------------------------------------

    def live(self, pool: str) -> list[SimWorker]:
        """The pool's workers taking new work (ready, not draining)."""
        workers = self.decode if pool == "decode" else self.prefill
        return [w for w in workers if w.name not in self.draining]

    def scale(self, pool: str, n: int) -> None:
        """Make `pool` have `n` workers: start the missing ones (ready `startup_s`
        later), take back starts not yet ready, then drain the least loaded."""
        if pool not in ("decode", "prefill") or n < (1 if pool == "decode" else 0):
            raise ValueError(f"cannot scale {pool!r} to {n} (decode needs at least one)")
        live = self.live(pool)
        have = len(live) + self.starting[pool]
        for _ in range(n - have):
            self.starting[pool] += 1
            self.at(self.now + self.config.startup_s,
                    functools.partial(self._started, pool, self.now))  # fmt: skip
        if n >= have:
            return
        back = min(self.starting[pool], have - n)
        self.starting[pool] -= back
        self._cancelled[pool] += back
        load = self.in_flight if pool == "decode" else self.prefill_held
        for w in sorted(live, key=lambda w: load[w.name])[: have - n - back]:
            self.draining.add(w.name)
            if pool == "decode":  # it leaves discovery first: routers forget it
                self.routing.left(w.name)
            self._retire_if_done(w)
        if pool == "prefill" and not self.live("prefill"):
            self._fall_back_to_local()

    def accelerator_s(self, per_worker: Mapping[str, int] | None = None) -> float:
        """Accelerator-seconds so far: every worker from its scale call (or 0) to now or
        to when it left, starts taken back included up to then, times its pool's
        accelerators a worker (`per_worker`, by pool; default 1: worker-seconds)."""
        cost = per_worker or {}
        live = {"prefill": 0.0, "decode": 0.0}
        for name, t in self._since.items():
            live[name.rsplit("-", 1)[0]] += self.now - t
        return sum(
            (self.retired_worker_s[p] + live[p]) * cost.get(p, 1) for p in ("prefill", "decode")
        )

    def _started(self, pool: str, asked_at: float) -> None:
        if self._cancelled[pool]:
            self._cancelled[pool] -= 1
            self.retired_worker_s[pool] += self.now - asked_at
            return
        self.starting[pool] -= 1
        name = f"{pool}-{next(self._names[pool])}"
        w = SimWorker(name, pool, self.config.engine_of(pool), self.config.fast_forward)
        self._since[name] = asked_at
        if pool == "decode":
            self.decode.append(w)
            self._infos[name] = self.routing.joined(w, self._model)
            self._views.pop(name, None)  # a new record
            self._by_name[name] = w
            self.in_flight[name] = self.remote_out[name] = 0
        else:
            self.prefill.append(w)
            self.prefill_held[name] = 0
            self._dispatch()

    def _retire_if_done(self, w: SimWorker) -> None:
        if w.name not in self.draining or w.busy_until is not None or w.inbox:
            return
        if w.role == "decode":
            if self.in_flight[w.name] or self.remote_out[w.name]:
                return
        elif self.prefill_held[w.name]:
            return
        if not w.core.is_idle():
            return
        self.draining.discard(w.name)
        (self.decode if w.role == "decode" else self.prefill).remove(w)
        self.retired_worker_s[w.role] += self.now - self._since.pop(w.name)
        self.retired.append(w)

    def _fall_back_to_local(self) -> None:
        """No prefill worker is left to pull the queue: its prompts prefill where they
        wait, as a decode worker does when its remote prefill times out."""
        while self.queue:
            remote = self.queue.popleft()
            w, rid = remote.decode, remote.request_id
            del self.remotes[rid]
            self.remote_out[w.name] -= 1
            self.routing.admitted(w, rid, remote.uncached)  # prefilled here after all
            self._do(w, functools.partial(w.core.remote_kv_failed, rid))


def _ids(ids: Iterable[str], most: int = 12) -> str:
    """Request ids for a message: the first `most`, then how many more."""
    ids = list(ids)
    more = f", ... {len(ids) - most} more" if len(ids) > most else ""
    return f"[{', '.join(ids[:most])}{more}]"

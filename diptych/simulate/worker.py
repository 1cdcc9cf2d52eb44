"""One simulated worker: a real `EngineCore` on a virtual runner, in virtual time.

A worker is idle, or busy until `busy_until` with one of

    a step    `EngineCore.step` ran at its start (the scheduler's real choice); its
              outputs are delivered at its end
    a run     only decodes, none of which can stop or run short of KV early: `steps`
              decode steps at once (`fast_forward.advance_decodes`), applied at its end;
              something arriving meanwhile cuts the run after the step in flight

What arrives while the worker is busy (a new request, a remote prefill's KV) waits
in its inbox and is handed to the engine when the step or run ends, as a real
worker's engine thread takes it between steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from diptych.simulate.fast_forward import advance_decodes, decode_room
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import RequestOutput
from engine.sim.runner import SimModelRunner


@dataclass
class Delivery:
    """Tokens a step or run delivered to one request, at `time`."""

    request_id: str
    time: float
    tokens: int  # new tokens for the client
    step_s: float  # the gap between them after the first (a run's steps)
    finished: bool
    thinking: int = 0  # of all its tokens so far, a reasoning model's thinking


@dataclass
class _Run:
    start: float
    steps: int
    step_s: float


@dataclass
class SimWorker:
    name: str
    role: str  # "decode" (also the aggregated role) or "prefill"
    config: EngineConfig
    fast_forward: bool = True  # False: every decode step through `EngineCore.step`
    core: EngineCore = field(init=False)
    busy_until: float | None = None
    version: int = 0  # bumps when busy_until changes: older end events are stale
    busy_s: float = 0.0
    inbox: list[Callable[[], object]] = field(default_factory=list)
    _step: list[RequestOutput] | None = None
    _run: _Run | None = None

    def __post_init__(self) -> None:
        assert self.config.sim is not None and self.config.sim.virtual
        self.core = EngineCore(self.config)

    @property
    def runner(self) -> SimModelRunner:
        runner = self.core.runner
        assert isinstance(runner, SimModelRunner)
        return runner

    def do(self, now: float, action: Callable[[], object]) -> bool:
        """Apply `action` to the engine now if idle, else at the end of what is in
        flight (a run is cut after its current step). True when the end moved."""
        if self.busy_until is None:
            action()
            return False
        self.inbox.append(action)
        run = self._run
        if run is None or run.steps == 1:
            return False
        done = min(run.steps, math.floor((now - run.start) / run.step_s) + 1)
        if done >= run.steps:
            return False
        run.steps = done
        self.busy_until = run.start + done * run.step_s
        self.version += 1
        return True

    def start(self, now: float) -> float | None:
        """Begin the next step or run if there is work; its end time, else None."""
        assert self.busy_until is None
        core = self.core
        if not core.has_work():
            return None
        room = decode_room(core.scheduler) if self.fast_forward else 0
        if room > 1:
            running = core.scheduler.running
            steps = min([room] + [self.runner.max_decode_steps(r) for r in running])
            if steps > 1:
                seconds, _ = self.runner.decode_run(running, steps)
                self._run = _Run(now, steps, seconds / steps)
                self.busy_until = now + seconds
                self.version += 1
                return self.busy_until
        self._step = core.step()
        while not core.last_step_tokens:
            # It ran nothing, so it took no time. Either it only preempted (the next step
            # admits the freed requests at once), or the queue is stalled: pinned blocks
            # keep its head out until something arrives, which kicks the worker again.
            # Taking the empty step as a step of 0 s would re-kick it at the same instant
            # forever.
            self._step = None
            if not core.has_work():
                return None
            self._step = core.step()
        seconds = self.runner.last_step_s
        self.busy_s += seconds
        self.busy_until = now + seconds
        self.version += 1
        return self.busy_until

    def finish(self) -> list[Delivery]:
        """End what was in flight (at `busy_until`): apply it, empty the inbox."""
        end = self.busy_until
        assert end is not None
        out: list[Delivery] = []
        if self._run is not None:
            run, self._run = self._run, None
            self.busy_s += run.steps * run.step_s
            sched = self.core.scheduler
            running = list(sched.running)
            _, tokens = self.runner.decode_run(running, run.steps)
            finished = {r.request_id for r in advance_decodes(sched, run.steps, tokens)}
            for r in running:
                rid, thought = r.request_id, r.reasoning.tokens if r.reasoning else 0
                out.append(Delivery(rid, end, run.steps, run.step_s, rid in finished, thought))
        elif self._step is not None:
            for o in self._step:
                n = len(o.new_token_ids)
                out.append(Delivery(o.request_id, end, n, 0.0, o.finished, o.num_reasoning_tokens))
            self._step = None
        self.busy_until = None
        inbox, self.inbox = self.inbox, []
        for action in inbox:
            action()
        return out

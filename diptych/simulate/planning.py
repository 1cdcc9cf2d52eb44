"""The planner in the fleet simulator: the same `planner.Planner` core, its
observations read off the virtual fleet and its decisions applied with `Fleet.scale`.

Every `interval_s` of simulated time a tick sees what the live OBSERVE would have
read from Prometheus over that interval: requests that arrived, prompt and output
tokens of those that finished, their TTFT and inter-token p50/p99, the prefill queue
(depth and its oldest entry), KV usage per pool, running streams and live workers.
Ticks are housekeeping: they keep going while the fleet has work, and for
`idle_ticks` after it has none, so a fleet is seen scaling back down to its minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diptych.simulate.fleet import Fleet
from engine.sim.timing import TimingModel
from planner import Observation, Planner, StepCapacity, TickResult


def capacity_of(
    timing: TimingModel, max_batch: int = 256, kv_tokens: int | None = None
) -> StepCapacity:
    """One worker's capacity model from the simulated engine's timing model (a
    profile or a roofline): what the SLA policy sizes pools with."""
    return StepCapacity(
        prefill_s=lambda n: timing.step_s([(n, 0)]),
        decode_step_s=lambda b, ctx: timing.step_s([(1, round(ctx))] * b),
        max_batch=max_batch,
        kv_tokens=kv_tokens,
    )


def _quantiles(values: list[float], weights: list[float] | None = None) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    order = np.argsort(v)
    v, w = v[order], w[order]
    cum = (np.cumsum(w) - w / 2) / w.sum()
    return float(np.interp(0.5, cum, v)), float(np.interp(0.99, cum, v))


@dataclass
class SimPlanning:
    planner: Planner
    interval_s: float = 30.0
    idle_ticks: int = 10
    ticks: list[TickResult] = field(default_factory=list)

    def attach(self, fleet: Fleet) -> None:
        """Tick on `fleet` from `interval_s` on (call before `fleet.run`)."""
        if not self.interval_s > 0:
            raise ValueError(f"the planner interval must be above 0 s, got {self.interval_s}")
        if self.planner.limits.decode.min_replicas < 1:
            raise ValueError("a simulated fleet needs at least one decode worker: min >= 1")
        self._fleet = fleet
        self._seen = (0, 0, 0)  # arrivals, finished, ITL samples at the last tick
        self._idle = 0
        fleet.housekeeping.append(self._tick)
        fleet.at(self.interval_s, self._tick)

    def observe(self) -> Observation:
        fleet, rec = self._fleet, self._fleet.recorder
        arrived = len(rec.open) + len(rec.done)
        a0, d0, i0 = self._seen
        self._seen = (arrived, len(rec.done), len(rec.itl_values))
        done = rec.done[d0:]
        ttft = _quantiles([r.ttft for r in done]) if done else (None, None)
        itl = (
            _quantiles(rec.itl_values[i0:], rec.itl_weights[i0:])
            if len(rec.itl_values) > i0
            else (None, None)
        )
        kv: dict[str, float] = {}
        running = waiting = 0
        for pool in ("prefill", "decode"):
            snaps = [w.core.snapshot() for w in fleet.live(pool)]
            total = sum(s.kv_total_blocks for s in snaps)
            if total:
                kv[pool] = sum(s.kv_used_blocks for s in snaps) / total
            if pool == "decode":
                running = sum(s.running for s in snaps)
                waiting = sum(s.waiting for s in snaps)
        oldest = min((r.queued_at for r in fleet.queue), default=fleet.now)
        return Observation(
            time=fleet.now,
            request_rate=(arrived - a0) / self.interval_s,
            mean_input_tokens=float(np.mean([r.prompt_len for r in done])) if done else 0.0,
            mean_output_tokens=float(np.mean([r.output_tokens for r in done])) if done else 0.0,
            mean_input_tokens_sq=(float(np.mean([r.prompt_len**2 for r in done])) if done else 0.0),
            ttft_p50_s=ttft[0],
            ttft_p99_s=ttft[1],
            itl_p50_s=itl[0],
            itl_p99_s=itl[1],
            prefill_queue_depth=len(fleet.queue),
            prefill_queue_age_s=fleet.now - oldest,
            kv_usage=kv,
            running_requests=running,
            waiting_requests=waiting,
            in_flight=len(rec.open),
            ready={pool: len(fleet.live(pool)) for pool in ("prefill", "decode")},
        )

    def _tick(self) -> None:
        fleet = self._fleet
        result = self.planner.tick(self.observe())
        self.ticks.append(result)
        if not self.planner.dry_run:
            for d in result.decisions:
                fleet.scale(d.pool, d.target)
        self._idle = 0 if fleet.busy() else self._idle + 1
        if self._idle <= self.idle_ticks:
            fleet.at(fleet.now + self.interval_s, self._tick)

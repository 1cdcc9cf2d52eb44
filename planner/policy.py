"""PROPOSE: the replicas each pool should have next, and why.

Two policies, each a plain object asked once per tick (`propose`):

  - `SlaPolicy` sizes each pool from a worker's capacity within the SLA
    (`planner.capacity`): prefill replicas for the predicted prompt tokens per
    second at the TTFT target, decode replicas for the predicted output tokens per
    second at what one worker streams with its steps within the ITL target.
    Proactive: it follows the forecast, before queues build. A model is only a
    model: like Dynamo's SLA planner, it compares the TTFT p99 it observes with what
    the model predicts at the load observed (`Correction`, smoothed and clamped)
    and sizes prefill against the corrected model, so a profile that errs either
    way (a fleet whose decode workers absorb prefills, a slower network) is
    corrected from the fleet's own latency.
  - `LoadPolicy` steps a pool by one replica when a signal crosses a threshold:
    prefill on queue depth per replica and the oldest queued prompt's age, decode on
    KV usage and running streams per replica. Each signal has an upper threshold to
    grow and a lower one to shrink, and the band between them holds (hysteresis),
    so a load that sits near one threshold does not flap.

Neither enforces limits, budgets or cooldowns: CONSTRAIN does (`planner.constrain`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from planner.capacity import CapacityModel
from planner.observation import Forecast, Observation
from protocol.declare import check_fields, spec


@dataclass(frozen=True)
class Proposal:
    pool: str
    replicas: int
    reason: str


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def propose(self, obs: Observation, forecast: Forecast) -> list[Proposal]: ...


@dataclass
class Correction:
    """Observed over predicted TTFT p99, an exponentially weighted mean of the ticks
    that measured one at a load the model can speak for (utilisation under
    `max_utilisation`), clamped to [`low`, `high`]. 1 until then."""

    alpha: float = spec(0.3, lo=0.0, lo_open=True, hi=1.0, help="weight of the newest tick")
    low: float = spec(0.25, lo=0.0, lo_open=True, hi=1.0)
    high: float = spec(4.0, lo=1.0)
    max_utilisation: float = spec(0.95, lo=0.0, lo_open=True, hi=1.0)
    factor: float = 1.0
    samples: int = 0

    def __post_init__(self) -> None:
        check_fields(self)

    def update(self, capacity: CapacityModel, obs: Observation) -> None:
        ready = obs.ready_in("prefill")
        if obs.ttft_p99_s is None or ready < 1 or obs.prompt_tokens_per_s <= 0:
            return
        sq = obs.mean_input_tokens_sq
        u = capacity.prefill_utilisation(obs.prompt_tokens_per_s / ready,
                                         obs.mean_input_tokens, sq)  # fmt: skip
        if not 0 < u < self.max_utilisation:
            return
        predicted = capacity.prefill_ttft_p99_s(u, obs.mean_input_tokens, sq)
        if not predicted > 0:
            return
        ratio = min(max(obs.ttft_p99_s / predicted, self.low), self.high)
        self.factor += self.alpha * (ratio - self.factor)
        self.samples += 1


@dataclass(frozen=True)
class SlaPolicy:
    capacity: CapacityModel
    ttft_target_s: float
    itl_target_s: float
    name: str = "sla"
    down_headroom: float = 0.1  # spare capacity a scale-down must leave (hysteresis)
    correct: bool = True  # size against the model corrected by the TTFT observed
    correction: Correction = field(default_factory=Correction)

    def __post_init__(self) -> None:
        if not (self.ttft_target_s > 0 and self.itl_target_s > 0):
            raise ValueError("the SLA targets (TTFT, ITL) must be above 0 seconds")
        if not 0 <= self.down_headroom < 1:
            raise ValueError(f"down_headroom must be in [0, 1), got {self.down_headroom}")

    def propose(self, obs: Observation, forecast: Forecast) -> list[Proposal]:
        ttft, itl = self.ttft_target_s, self.itl_target_s
        inp, out = forecast.mean_input_tokens, forecast.mean_output_tokens
        context = inp + out / 2
        tokens_s = forecast.request_rate * out  # output tokens/s to stream
        # at least the thinking streaming now: long thinking shows in the finished
        # requests' output lengths only once it ends
        what = "output tok/s"
        if obs.reasoning_tokens_per_s > tokens_s:
            tokens_s, what = obs.reasoning_tokens_per_s, "thinking tok/s (live)"
        sla = f"TTFT {ttft * 1e3:.0f} ms"
        if self.correct:
            self.correction.update(self.capacity, obs)
            c = self.correction.factor
            # the model's p99 times c must stay within the target
            ttft = ttft / c
            if self.correction.samples:
                sla += f" (model x{c:.2f}, from the TTFT observed)"
        prefill = _sized(
            obs,
            "prefill",
            forecast.prompt_tokens_per_s,
            "prompt tok/s",
            self.capacity.prefill_tokens_per_s(ttft, inp, forecast.mean_input_tokens_sq),
            sla,
            f"a {inp:.0f}-token prompt alone",
            self.down_headroom,
        )
        decode = _sized(
            obs,
            "decode",
            tokens_s,
            what,
            self.capacity.decode_tokens_per_s(itl, context),
            f"ITL {itl * 1e3:.0f} ms at context {context:.0f}",
            "one stream",
            self.down_headroom,
        )
        # the streams decoding or queued to decode now must fit too: a phase of long
        # replies shows there long before any of them finishes and says how long it was
        streams = self.capacity.decode_streams(itl, context)
        decoding = obs.running_requests + obs.waiting_requests
        if streams > 0 and decoding > 0:
            held = _sized(
                obs,
                "decode",
                float(decoding),
                "streams decoding or queued",
                streams,
                f"ITL {itl * 1e3:.0f} ms",
                "one stream",
                self.down_headroom,
            )
            if held.replicas > decode.replicas:
                decode = held
        return [prefill, decode]


def _sized(
    obs: Observation, pool: str, demand: float, unit: str, per_worker: float, sla: str,
    alone: str, headroom: float = 0.0,
) -> Proposal:  # fmt: skip
    """Replicas for `demand` at `per_worker` each. When even one unit of work misses
    the SLA no replica count meets it: hold what is ready (at least one) and say so.

    Shrinking needs `headroom`: below the replicas ready, a smaller count is proposed
    only if it carries the demand with that fraction to spare, so a demand hovering
    at a whole number of workers does not flap between two counts."""
    if demand <= 0:
        return Proposal(pool, 0, f"no {unit} predicted")
    if per_worker <= 0:
        n = max(obs.ready_in(pool), 1)
        return Proposal(pool, n, f"{alone} misses {sla}, at any replica count; holding {n}")
    need = demand / per_worker
    n = math.ceil(need)
    why = f"{demand:,.1f} {unit} predicted / {per_worker:,.1f} per worker within {sla}"
    ready = obs.ready_in(pool)
    if n < ready:
        keep = min(ready, math.ceil(need / (1.0 - headroom)))
        if keep > n:
            return Proposal(pool, keep, f"{why}; keeping {keep}: {n} would leave under "
                                        f"{headroom:.0%} to spare")  # fmt: skip
    return Proposal(pool, n, why)


@dataclass(frozen=True)
class Band:
    """Grow above `up`, shrink below `down`, hold between."""

    up: float
    down: float

    def __post_init__(self) -> None:
        if not self.down < self.up:
            raise ValueError(f"a threshold band needs down < up, got {self.down} >= {self.up}")

    def verdict(self, value: float) -> int:
        return 1 if value > self.up else -1 if value < self.down else 0


@dataclass(frozen=True)
class LoadPolicy:
    queue_depth: Band = Band(up=4.0, down=0.5)  # queued prompts per prefill replica
    queue_age_s: Band = Band(up=1.0, down=0.1)  # the oldest queued prompt
    kv_usage: Band = Band(up=0.8, down=0.3)  # fraction of a decode pool's blocks
    streams: Band = Band(up=48.0, down=8.0)  # running streams per decode replica
    name: str = "load"

    def propose(self, obs: Observation, forecast: Forecast) -> list[Proposal]:
        return [self._prefill(obs), self._decode(obs)]

    def _prefill(self, obs: Observation) -> Proposal:
        n = obs.ready_in("prefill")
        depth = obs.prefill_queue_depth / max(n, 1)
        age = obs.prefill_queue_age_s
        up = self.queue_depth.verdict(depth) > 0 or self.queue_age_s.verdict(age) > 0
        down = self.queue_depth.verdict(depth) < 0 and self.queue_age_s.verdict(age) < 0
        what = f"queue {depth:.1f}/replica, oldest {age * 1e3:.0f} ms"
        return _stepped("prefill", n, up, down, what)

    def _decode(self, obs: Observation) -> Proposal:
        n = obs.ready_in("decode")
        kv = obs.kv_usage.get("decode", 0.0)
        streams = obs.running_requests / max(n, 1)
        up = self.kv_usage.verdict(kv) > 0 or self.streams.verdict(streams) > 0
        down = self.kv_usage.verdict(kv) < 0 and self.streams.verdict(streams) < 0
        what = f"KV {kv:.0%}, {streams:.1f} streams/replica"
        return _stepped("decode", n, up, down, what)


def _stepped(pool: str, n: int, up: bool, down: bool, what: str) -> Proposal:
    if up:
        return Proposal(pool, n + 1, f"{what}: above the band")
    if down and n > 0:
        return Proposal(pool, n - 1, f"{what}: below the band")
    return Proposal(pool, n, f"{what}: within the band")

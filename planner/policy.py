"""PROPOSE: the replicas each pool should have next, and why.

Two policies, each a plain object asked once per tick (`propose`):

  - `SlaPolicy` sizes each pool from a worker's capacity within the SLA
    (`planner.capacity`): prefill replicas for the predicted prompt tokens per
    second at the TTFT target, decode replicas for the predicted concurrent streams
    (Little's law: request rate x output tokens x the ITL target, plus the streams
    still waiting for their first token) at the ITL target. Proactive: it follows
    the forecast, before queues build.
  - `LoadPolicy` steps a pool by one replica when a signal crosses a threshold:
    prefill on queue depth per replica and the oldest queued prompt's age, decode on
    KV usage and running streams per replica. Each signal has an upper threshold to
    grow and a lower one to shrink, and the band between them holds (hysteresis),
    so a load that sits near one threshold does not flap.

Neither enforces limits, budgets or cooldowns: CONSTRAIN does (`planner.constrain`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from planner.capacity import CapacityModel
from planner.observation import Forecast, Observation


@dataclass(frozen=True)
class Proposal:
    pool: str
    replicas: int
    reason: str


class Policy(Protocol):
    name: str

    def propose(self, obs: Observation, forecast: Forecast) -> list[Proposal]: ...


@dataclass(frozen=True)
class SlaPolicy:
    capacity: CapacityModel
    ttft_target_s: float
    itl_target_s: float
    name: str = "sla"

    def __post_init__(self) -> None:
        if not (self.ttft_target_s > 0 and self.itl_target_s > 0):
            raise ValueError("the SLA targets (TTFT, ITL) must be above 0 seconds")

    def propose(self, obs: Observation, forecast: Forecast) -> list[Proposal]:
        tokens_s = forecast.prompt_tokens_per_s
        per_prefill = self.capacity.prefill_tokens_per_s(
            self.ttft_target_s, forecast.mean_input_tokens
        )
        if tokens_s <= 0:
            prefill = Proposal("prefill", 0, "no prompts predicted")
        elif per_prefill <= 0:
            prefill = Proposal(
                "prefill",
                obs.ready_in("prefill") + 1,
                f"a {forecast.mean_input_tokens:.0f}-token prompt alone misses TTFT "
                f"{self.ttft_target_s * 1e3:.0f} ms; adding one",
            )
        else:
            n = math.ceil(tokens_s / per_prefill)
            prefill = Proposal(
                "prefill",
                n,
                f"{tokens_s:,.0f} prompt tok/s predicted / {per_prefill:,.0f} per worker "
                f"within TTFT {self.ttft_target_s * 1e3:.0f} ms",
            )
        context = forecast.mean_input_tokens + forecast.mean_output_tokens / 2
        per_decode = self.capacity.decode_streams(self.itl_target_s, context)
        streams = forecast.request_rate * (
            forecast.mean_output_tokens * self.itl_target_s + self.ttft_target_s
        )
        if streams <= 0:
            decode = Proposal("decode", 0, "no streams predicted")
        elif per_decode <= 0:
            decode = Proposal(
                "decode",
                obs.ready_in("decode") + 1,
                f"one stream at context {context:.0f} misses ITL "
                f"{self.itl_target_s * 1e3:.0f} ms; adding one",
            )
        else:
            n = math.ceil(streams / per_decode)
            decode = Proposal(
                "decode",
                n,
                f"{streams:,.1f} streams predicted / {per_decode:,.0f} per worker "
                f"within ITL {self.itl_target_s * 1e3:.0f} ms at context {context:.0f}",
            )
        return [prefill, decode]


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
        if up:
            return Proposal("prefill", n + 1, f"{what}: above the band")
        if down and n > 0:
            return Proposal("prefill", n - 1, f"{what}: below the band")
        return Proposal("prefill", n, f"{what}: within the band")

    def _decode(self, obs: Observation) -> Proposal:
        n = obs.ready_in("decode")
        kv = obs.kv_usage.get("decode", 0.0)
        streams = obs.running_requests / max(n, 1)
        up = self.kv_usage.verdict(kv) > 0 or self.streams.verdict(streams) > 0
        down = self.kv_usage.verdict(kv) < 0 and self.streams.verdict(streams) < 0
        what = f"KV {kv:.0%}, {streams:.1f} streams/replica"
        if up:
            return Proposal("decode", n + 1, f"{what}: above the band")
        if down and n > 0:
            return Proposal("decode", n - 1, f"{what}: below the band")
        return Proposal("decode", n, f"{what}: within the band")

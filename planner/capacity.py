"""What one worker of each pool sustains within an SLA, from its step times.

The SLA policy asks two questions of a worker profile:

  - how many prompt tokens per second one prefill worker takes while TTFT stays
    under the target, at a given prompt length;
  - how many concurrent streams one decode worker holds while ITL stays under the
    target, at a given context length.

`StepCapacity` answers both from two step-time functions (the simulated engine's
timing model supplies them: a measured `diptych profile` or a roofline), so the
planner does not depend on the engine. Prefill is a queue served one prompt at a
time: with service time S and utilisation u, an M/D/1 queue waits u S / (2 (1 - u))
on average; the p99 wait is taken as `tail_factor` times that. The utilisation
allowed is the largest that keeps S + tail wait under the TTFT target (and never
above `max_utilisation`). Decode is a batch: the largest batch whose step stays under
the ITL target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class CapacityModel(Protocol):
    def prefill_tokens_per_s(self, ttft_target_s: float, prompt_tokens: float) -> float: ...

    def decode_streams(self, itl_target_s: float, context_tokens: float) -> float: ...


@dataclass(frozen=True)
class StepCapacity:
    prefill_s: Callable[[int], float]  # seconds to prefill one prompt of n tokens
    decode_step_s: Callable[[int, float], float]  # (batch, context) -> seconds per step
    max_batch: int = 256
    tail_factor: float = 4.0
    max_utilisation: float = 0.9

    def prefill_tokens_per_s(self, ttft_target_s: float, prompt_tokens: float) -> float:
        n = max(round(prompt_tokens), 1)
        service = self.prefill_s(n)
        if service <= 0:
            return float("inf")
        slack = ttft_target_s - service
        if slack <= 0:
            return 0.0  # this prompt alone misses the target: no replica count helps
        # S + k u S / (2 (1 - u)) <= T  <=>  u <= 2 slack / (2 slack + k S)
        u = min(2 * slack / (2 * slack + self.tail_factor * service), self.max_utilisation)
        return u * n / service

    def decode_streams(self, itl_target_s: float, context_tokens: float) -> float:
        if self.decode_step_s(1, context_tokens) > itl_target_s:
            return 0.0
        lo, hi = 1, self.max_batch  # the largest batch within the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step_s(mid, context_tokens) <= itl_target_s:
                lo = mid
            else:
                hi = mid - 1
        return float(lo)

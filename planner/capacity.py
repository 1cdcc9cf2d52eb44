"""What one worker of each pool sustains within an SLA, from its step times.

The SLA policy asks two questions of a worker profile:

  - how many prompt tokens per second one prefill worker takes while TTFT stays
    under the target, at a given prompt length (and spread of lengths);
  - how many concurrent streams one decode worker holds while ITL stays under the
    target, at a given context length.

`StepCapacity` answers both from two step-time functions (the simulated engine's
timing model supplies them: a measured `diptych profile` or a roofline), so the
planner does not depend on the engine. Prefill is a queue served one prompt at a
time (M/G/1): at utilisation u the mean wait is u E[S^2] / (2 E[S] (1 - u))
(Pollaczek-Khinchine), so a mix with a few long prompts queues far longer than its
mean prompt suggests. E[S^2] comes from the mean squared prompt length when it is
known (S taken at the root-mean-square length: S is near-linear in tokens, and this
errs long), else from the mean length (M/D/1). The p99 wait is `tail_factor` times
the mean, and a request's own prefill is taken at the root-mean-square length; the
utilisation allowed is the largest that keeps both under the TTFT target (and never
above `max_utilisation`). Decode is a batch: the largest batch whose step stays
under the ITL target (and whose KV fits), and the output tokens per second that
batch streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class CapacityModel(Protocol):
    def prefill_tokens_per_s(
        self, ttft_target_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float: ...

    def decode_streams(self, itl_target_s: float, context_tokens: float) -> float: ...

    def prefill_utilisation(
        self, tokens_per_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float: ...

    def prefill_ttft_p99_s(
        self, utilisation: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float: ...

    def decode_tokens_per_s(self, itl_target_s: float, context_tokens: float) -> float: ...


@dataclass(frozen=True)
class PoolCapacity:
    """Each pool's questions put to its own workers' model: prefill and decode workers
    of different tensor-parallel sizes have different step times."""

    prefill: CapacityModel
    decode: CapacityModel

    def prefill_tokens_per_s(
        self, ttft_target_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        return self.prefill.prefill_tokens_per_s(ttft_target_s, prompt_tokens, prompt_tokens_sq)

    def decode_streams(self, itl_target_s: float, context_tokens: float) -> float:
        return self.decode.decode_streams(itl_target_s, context_tokens)

    def prefill_utilisation(
        self, tokens_per_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        return self.prefill.prefill_utilisation(tokens_per_s, prompt_tokens, prompt_tokens_sq)

    def prefill_ttft_p99_s(
        self, utilisation: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        return self.prefill.prefill_ttft_p99_s(utilisation, prompt_tokens, prompt_tokens_sq)

    def decode_tokens_per_s(self, itl_target_s: float, context_tokens: float) -> float:
        return self.decode.decode_tokens_per_s(itl_target_s, context_tokens)


@dataclass(frozen=True)
class StepCapacity:
    prefill_s: Callable[[int], float]  # seconds to prefill one prompt of n tokens
    decode_step_s: Callable[[int, float], float]  # (batch, context) -> seconds per step
    max_batch: int = 256
    kv_tokens: int | None = None  # a decode worker's KV capacity, in tokens
    tail_factor: float = 4.0
    max_utilisation: float = 0.9

    def _service(self, prompt_tokens: float, prompt_tokens_sq: float) -> tuple[int, float, float]:
        """(mean prompt tokens, E[S], S at the root-mean-square length)."""
        n = max(round(prompt_tokens), 1)
        mean_s = self.prefill_s(n)
        rms = max(round(prompt_tokens_sq**0.5), n)
        long_s = self.prefill_s(rms) if rms > n else mean_s
        return n, mean_s, long_s

    def prefill_utilisation(
        self, tokens_per_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        """The busy fraction of one worker taking `tokens_per_s` prompt tokens/s."""
        n, mean_s, _ = self._service(prompt_tokens, prompt_tokens_sq)
        return tokens_per_s * mean_s / n

    def prefill_ttft_p99_s(
        self, utilisation: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        """The p99 TTFT the model expects of one worker at `utilisation` (inf at 1)."""
        _, mean_s, long_s = self._service(prompt_tokens, prompt_tokens_sq)
        if utilisation >= 1:
            return float("inf")
        ratio = long_s * long_s / mean_s if mean_s > 0 else 0.0
        return long_s + self.tail_factor * utilisation * ratio / (2 * (1 - utilisation))

    def prefill_tokens_per_s(
        self, ttft_target_s: float, prompt_tokens: float, prompt_tokens_sq: float = 0.0
    ) -> float:
        n, mean_s, long_s = self._service(prompt_tokens, prompt_tokens_sq)
        if mean_s <= 0:
            return float("inf")
        slack = ttft_target_s - long_s
        if slack <= 0:
            return 0.0  # such a prompt alone misses the target: no replica count helps
        ratio = long_s * long_s / mean_s  # E[S^2] / E[S]
        # S + k u R / (2 (1 - u)) <= T  <=>  u <= 2 slack / (2 slack + k R)
        u = min(2 * slack / (2 * slack + self.tail_factor * ratio), self.max_utilisation)
        return u * n / mean_s

    def decode_streams(self, itl_target_s: float, context_tokens: float) -> float:
        if self.decode_step_s(1, context_tokens) > itl_target_s:
            return 0.0
        hi = self.max_batch
        if self.kv_tokens is not None:  # the batch's KV must fit, too
            hi = min(hi, max(int(self.kv_tokens // max(context_tokens, 1.0)), 1))
        lo = 1  # the largest batch within the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_step_s(mid, context_tokens) <= itl_target_s:
                lo = mid
            else:
                hi = mid - 1
        return float(lo)

    def decode_tokens_per_s(self, itl_target_s: float, context_tokens: float) -> float:
        """Output tokens per second one decode worker streams with every step within
        the ITL target: its largest such batch over that batch's step time."""
        batch = self.decode_streams(itl_target_s, context_tokens)
        return batch / self.decode_step_s(int(batch), context_tokens) if batch else 0.0

"""Serving metrics from per-request results, with `vllm bench serve`'s definitions.

One `RequestResult` per request, as measured by the client on the SSE stream:

    start ─────── first event with choices ── event ── event ── ... ── last event with choices
          <─ ttft ─>                        <─ itl ─><─ itl ─>
          <──────────────────────────── latency (E2EL) ──────────────────────────────>

- TTFT: from sending the request to the first SSE event whose `choices` is non-empty
  (its text may be empty).
- ITL: the gap between consecutive events with choices, pooled over all requests.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for outputs longer than one token;
  for goodput a one-token output counts as TPOT 0 (it has no decode phase).
- E2EL: from sending the request to the last event with choices.
- Failed requests count in `failed` and nowhere else (no latency, no tokens).

Statistics are numpy's: mean, population std (ddof 0), median, and percentiles by
linear interpolation between closest ranks (`np.percentile`'s default). An empty
sample reports 0.0, as vLLM does. All times here are seconds; the reported figures
are milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.slo import is_good

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")  # (and "ttfa" where a model thinks)


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, from `time.perf_counter`)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0  # waiting for a --max-concurrency slot before sending
    generated_text: str = ""
    error: str = ""
    tag: str = ""
    cached_tokens: int | None = None  # prompt tokens the server found cached (its usage)
    # a reasoning model's: thinking tokens (its usage), and when the answer began (the
    # first content after the thinking; seconds from the start, None: no thinking seen)
    reasoning_tokens: int | None = None
    ttfa: float | None = None

    @property
    def tpot(self) -> float:
        """Mean decode time per token after the first; 0 for outputs of <= 1 token."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def token_times(self) -> list[float]:
        """Absolute arrival times of the streamed events (first event, then each ITL)."""
        t = self.start_time + self.ttft
        out = [t]
        for gap in self.itl:
            t += gap
            out.append(t)
        return out


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std and the given percentiles, in milliseconds (0.0 for no values)."""
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        "mean": float(np.mean(arr)),
        "median": float(np.median(arr)),
        "std": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(arr, p, method="linear"))
    return out


def percentile_word(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9' (the key style of vLLM's JSON)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, over half-open intervals [start, start + E2EL)."""
    events: list[tuple[float, int]] = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    events.sort()  # at equal times -1 sorts first: a request that ends frees its slot
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def peak_output_rate(results: Sequence[RequestResult]) -> float:
    """Most streamed events in any one-second bucket from the first request's start.

    As in vLLM, every event with choices counts as one token: a server that packs
    several tokens into one event shows a lower peak than it achieved.
    """
    if not results:
        return 0.0
    t0 = min(r.start_time for r in results)
    end = max(r.start_time + r.latency for r in results)
    buckets = np.zeros(math.ceil(end - t0) + 1)
    for r in results:
        for t in r.token_times():
            i = int(t - t0)
            if 0 <= i < len(buckets):
                buckets[i] += 1
    return float(buckets.max())


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 95, 99),
    goodput: Mapping[str, float] | None = None,
    metrics: Sequence[str] = METRIC_NAMES,
) -> dict[str, Any]:
    """The aggregate figures of one run, under vLLM's JSON key names.

    `goodput` maps "ttft"/"tpot"/"e2el" to an SLO in milliseconds; a completed request
    is good when it meets every one given. `request_goodput` is None without SLOs.
    """
    if duration_s <= 0:
        raise ValueError(f"the benchmark duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
        "ttfa": [r.ttfa for r in ok if r.ttfa is not None],
    }
    good = sum(1 for r in ok if is_good(r, goodput)) if goodput else None
    reported = [r for r in ok if r.cached_tokens is not None]
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_output_rate(ok),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    if reported:  # what the server did not have to prefill, where its usage said
        cached = sum(r.cached_tokens or 0 for r in reported)
        out["total_cached_tokens"] = cached
        out["total_prefilled_tokens"] = sum(r.prompt_len for r in reported) - cached
    if good is not None:
        out["good_requests"] = good
    thought = [r.reasoning_tokens for r in ok if r.reasoning_tokens]
    if thought:  # a reasoning model: its thinking rate and the time to the answer
        out["total_reasoning_tokens"] = sum(thought)
        out["reasoning_throughput"] = sum(thought) / duration_s
        metrics = (*metrics, "ttfa") if samples["ttfa"] and "ttfa" not in metrics else metrics
    for name in metrics:
        if name not in samples:
            raise ValueError(f"unknown metric {name!r}: choose from {', '.join(METRIC_NAMES)}")
        if not samples[name] and name == "ttfa":
            continue
        for stat, value in summarize(samples[name], percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def queue_metrics(
    results: Sequence[RequestResult], percentiles: Sequence[float], include_e2el: bool
) -> dict[str, float]:
    """Client-side waits for a --max-concurrency slot, and E2EL including them (vLLM keys)."""
    ok = [r for r in results if r.success]
    out: dict[str, float] = {}
    series = {"client_queue_time": [r.queue_time for r in ok]}
    if include_e2el:
        series["e2el_including_client_queue"] = [r.latency + r.queue_time for r in ok]
    for name, values in series.items():
        for stat, value in summarize(values, percentiles).items():
            out[f"{stat}_{name}_ms"] = value
    return out

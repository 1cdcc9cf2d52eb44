"""What the simulated clients saw, as `vllm bench serve` reports it, and the timeline.

Per request: send time, first token, end, output tokens, so TTFT, TPOT and E2EL are
exact. Inter-token latencies are kept as (gap, count) pairs: a run of k decode steps
gives each of its requests one gap from its previous token and k - 1 gaps of the
run's step time, which is what a client would have measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.metrics import RequestResult, compute_metrics, percentile_word
from diptych.json_types import JsonObject
from diptych.simulate.worker import SimWorker

_TAG_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class _Open:
    index: int
    sent: float
    prompt_len: int
    tag: str
    first: float | None = None
    last: float = 0.0
    tokens: int = 0
    thinking: int = 0  # of the tokens, a reasoning model's thinking
    answer_at: float | None = None  # the first answer token after some thinking


def weighted_percentiles(
    values: Sequence[float], weights: Sequence[float], percentiles: Sequence[float]
) -> dict[str, float]:
    """mean, median and the percentiles (linear between order statistics) of a
    weighted sample, in milliseconds."""
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{percentile_word(p)}": 0.0 for p in percentiles}}
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    order = np.argsort(v)
    v, w = v[order], w[order]
    cum = np.cumsum(w) - w / 2
    cum /= w.sum()
    out = {
        "mean": float(np.average(v, weights=w)) * 1e3,
        "median": float(np.interp(0.5, cum, v)) * 1e3,
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.interp(p / 100, cum, v)) * 1e3
    return out


class Recorder:
    def __init__(self) -> None:
        self.open: dict[str, _Open] = {}
        self.done: list[RequestResult] = []
        self.itl_values: list[float] = []
        self.itl_weights: list[float] = []
        self.timeline: list[dict[str, float]] = []
        self.token_bins: dict[int, int] = {}
        self.end = 0.0

    def arrived(self, rid: str, index: int, now: float, prompt_len: int, tag: str) -> None:
        self.open[rid] = _Open(index, now, prompt_len, tag)

    def tokens(self, rid: str, now: float, n: int, step_s: float, thinking: int = 0) -> None:
        """`n` tokens reached the client by `now`, `step_s` apart after the first;
        `thinking`: how many of all its tokens so far were thinking."""
        r = self.open[rid]
        answered = r.tokens + n - thinking  # answer tokens so far
        if thinking and answered > 0 and r.answer_at is None:
            r.answer_at = now - (answered - 1) * step_s
        r.thinking = thinking
        first_at = now - (n - 1) * step_s
        if r.first is None:
            r.first = first_at
        else:
            self.itl_values.append(first_at - r.last)
            self.itl_weights.append(1)
        if n > 1:
            self.itl_values.append(step_s)
            self.itl_weights.append(n - 1)
        r.tokens += n
        r.last = now
        second = int(now)
        self.token_bins[second] = self.token_bins.get(second, 0) + n

    def finished(self, rid: str, now: float) -> int:
        r = self.open.pop(rid)
        assert r.first is not None
        self.done.append(
            RequestResult(
                success=True,
                prompt_len=r.prompt_len,
                output_tokens=r.tokens,
                ttft=r.first - r.sent,
                latency=now - r.sent,
                start_time=r.sent,
                tag=r.tag,
                reasoning_tokens=r.thinking or None,
                ttfa=None if r.answer_at is None else r.answer_at - r.sent,
            )
        )
        return r.index

    def sample(
        self, now: float, decode: Sequence[SimWorker], prefill: Sequence[SimWorker], queued: int
    ) -> None:
        def pool(ws: Sequence[SimWorker]) -> tuple[int, int, float]:
            snaps = [w.core.snapshot() for w in ws]
            used = sum(s.kv_used_blocks for s in snaps)
            total = sum(s.kv_total_blocks for s in snaps) or 1
            return sum(s.running for s in snaps), sum(s.waiting for s in snaps), used / total

        d_run, d_wait, d_kv = pool(decode)
        p_run, p_wait, p_kv = pool(prefill) if prefill else (0, 0, 0.0)
        self.timeline.append(
            {
                "t": now,
                "in_flight": len(self.open),
                "decode_running": d_run,
                "decode_waiting": d_wait,
                "decode_kv_usage": d_kv,
                "prefill_running": p_run,
                "prefill_waiting": p_wait,
                "prefill_kv_usage": p_kv,
                "prefill_queue": queued,
            }
        )

    def metrics(
        self,
        percentiles: Sequence[float] = (50, 90, 95, 99),
        goodput: Mapping[str, float] | None = None,
    ) -> JsonObject:
        """vLLM's keys, over simulated seconds (the run lasts from 0 to its last event)."""
        duration = max(self.end, 1e-9)
        out = compute_metrics(
            self.done, duration, percentiles, goodput, metrics=("ttft", "tpot", "e2el")
        )
        out["failed"] = len(self.open)
        out["duration"] = duration
        for stat, value in weighted_percentiles(
            self.itl_values, self.itl_weights, percentiles
        ).items():
            out[f"{stat}_itl_ms"] = value
        out["max_output_tokens_per_s"] = float(max(self.token_bins.values(), default=0))
        return out

    def per_tag(self, percentiles: Sequence[float]) -> dict[str, dict[str, float]]:
        tags = sorted({r.tag for r in self.done if r.tag})
        out = {}
        for tag in tags:
            rs = [r for r in self.done if r.tag == tag]
            m = compute_metrics(
                rs, max(self.end, 1e-9), percentiles, None, ("ttft", "tpot", "e2el")
            )
            out[tag] = {k: v for k, v in m.items() if k.endswith("_ms") or k == "completed"}
        return out

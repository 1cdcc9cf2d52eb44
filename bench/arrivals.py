"""When requests are sent: Poisson or gamma arrivals at a request rate, or all at once.

Gaps between arrivals are gamma distributed with shape `burstiness` and mean
1 / rate: burstiness 1 is a Poisson process, below 1 burstier (clumps and lulls),
above 1 more even, and infinite burstiness a constant gap. As in `vllm bench serve`,
the cumulative times are then rescaled so the last arrival falls at exactly
n / rate seconds, which keeps the offered load equal across seeds.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start, one per request, non-decreasing."""
    if n < 0:
        raise ValueError(f"the number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / rate) / times[-1]
    return [float(t) for t in times]


def parse_rates(text: str | float) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; one value is a plain run, several a sweep."""
    if isinstance(text, (int, float)):
        values = [float(text)]
    else:
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts:
            raise ValueError("--request-rate is empty")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"--request-rate {text!r}: give numbers or 'inf', comma-separated"
            ) from None
    for v in values:
        if not v > 0:
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {v:g}")
    return values


def rate_label(rate: float) -> str:
    """The request rate as vLLM writes it in JSON: a float, or the string 'inf'."""
    return "inf" if math.isinf(rate) else f"{rate:g}"

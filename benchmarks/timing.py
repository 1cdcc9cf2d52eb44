"""Timing of in-process calls for the kernel-level benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def median_ms(
    fns: Mapping[str, Callable[[], object]], repeat: int, calls: int = 1
) -> dict[str, float]:
    """Median ms a call of each, over `repeat` rounds in which the functions take turns
    (a drift of the machine's memory bandwidth falls on all of them alike); a round's
    sample is the mean of `calls` calls in a row. Each is called once first."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            runs[name].append((time.perf_counter() - start) / calls)
    return {name: 1e3 * statistics.median(r) for name, r in runs.items()}

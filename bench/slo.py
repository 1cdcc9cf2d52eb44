"""Service-level objectives for goodput: `--goodput ttft:500 tpot:50 e2el:8000` (ms).

A completed request is *good* when every metric given is within its objective
(value <= SLO); goodput is good requests per second of the run (DistServe's
definition, as in `vllm bench serve`). A one-token output has TPOT 0 here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

SLO_METRICS = ("ttft", "tpot", "e2el")


class _Timed(Protocol):
    @property
    def ttft(self) -> float: ...
    @property
    def tpot(self) -> float: ...
    @property
    def latency(self) -> float: ...


def parse_goodput(pairs: Iterable[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}; raises ValueError."""
    out: dict[str, float] = {}
    for pair in pairs or ():
        for item in pair.split():
            name, sep, value = item.partition(":")
            name = name.strip().lower()
            if not sep:
                raise ValueError(f"goodput SLO {item!r} is not KEY:MILLISECONDS (e.g. ttft:500)")
            if name not in SLO_METRICS:
                raise ValueError(
                    f"goodput SLO {item!r}: the metric must be one of {', '.join(SLO_METRICS)}"
                )
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number") from None
            if not ms >= 0:
                raise ValueError(f"goodput SLO {item!r}: the value must be >= 0 ms")
            out[name] = ms
    return out


def is_good(result: _Timed, slos: Mapping[str, float] | None) -> bool:
    """Whether one completed request meets every SLO (milliseconds) in `slos`."""
    if not slos:
        return True
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.latency}
    # Compared in seconds, as vLLM does, so a value on the boundary rounds the same way.
    return all(ms / 1000.0 >= measured[name] for name, ms in slos.items())


def describe(slos: Mapping[str, float]) -> str:
    """'TTFT <= 500 ms, TPOT <= 50 ms' for tables and plot titles."""
    return ", ".join(f"{name.upper()} <= {ms:g} ms" for name, ms in slos.items())

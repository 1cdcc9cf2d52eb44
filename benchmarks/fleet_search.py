"""The tuned comparison behind `benchmarks/fleet_sim.py goodput`: the best aggregated
configuration against the best disaggregated split of the same 16 accelerators, each
found by a search, not one setting each.

A configuration's SLO capacity is the highest rate of a fixed ladder up to which every
run meets both p99 SLOs (TTFT and ITL); its goodput, the requests per second meeting
vLLM's per-request goodput SLO at that rate. Searched:

    aggregated      every chunk budget x every max batch (a full grid)
    disaggregated   coordinate descent from the untuned default: the split, then the
                    chunk budget, then the remote-prefill threshold, then the max batch,
                    each at the best of the others so far, then the split again

Configurations of one stage run in parallel processes (`--jobs`); a capacity search
stops at the first rate that misses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

GPUS = 16
LADDER = (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128)
CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
MAX_SEQS = (64, 128, 256)
THRESHOLDS = (128, 512, 1024, 2048, 4096)  # --min-remote-prefill-tokens


@dataclass(frozen=True)
class Config:
    prefill: int  # 0: aggregated over all GPUS
    chunk: int = 2048  # --max-num-batched-tokens
    max_seqs: int = 128  # --max-num-seqs
    remote_min: int = 128  # --min-remote-prefill-tokens (disaggregated only)

    @property
    def decode(self) -> int:
        return GPUS - self.prefill

    @property
    def label(self) -> str:
        if not self.prefill:
            return f"{GPUS} aggregated, chunk {self.chunk}, batch {self.max_seqs}"
        return (
            f"{self.prefill}P{self.decode}D, chunk {self.chunk}, batch {self.max_seqs}, "
            f"remote >= {self.remote_min}"
        )

    def flags(self) -> list[str]:
        return [
            "--prefill-workers", str(self.prefill), "--decode-workers", str(self.decode),
            "--max-num-batched-tokens", str(self.chunk), "--max-num-seqs", str(self.max_seqs),
            "--min-remote-prefill-tokens", str(self.remote_min),
        ]  # fmt: skip


@dataclass
class Result:
    config: Config
    capacity: float  # req/s (0: not even the first rate)
    rows: dict[float, dict[str, Any]]  # rate -> the run's report (those run)

    @property
    def goodput(self) -> float:
        """Goodput at the capacity rate (at the first rate when there is none)."""
        rate = self.capacity or min(self.rows)
        return float(self.rows[rate]["request_goodput"])

    def key(self) -> tuple[float, float]:
        return (self.capacity, self.goodput)


RunFn = Callable[[list[str], float], dict[str, Any]]


def capacity_search(
    config: Config, run: RunFn, attains: Callable[[dict[str, Any]], bool]
) -> Result:
    rows: dict[float, dict[str, Any]] = {}
    best = 0.0
    for rate in LADDER:
        rows[rate] = run(config.flags(), float(rate))
        if not attains(rows[rate]):
            break
        best = float(rate)
    return Result(config, best, rows)


class Search:
    """Every configuration measured so far, measured once."""

    def __init__(self, run: RunFn, attains: Callable[[dict[str, Any]], bool], jobs: int) -> None:
        self.run, self.attains, self.jobs = run, attains, jobs
        self.results: dict[Config, Result] = {}

    def measure(self, configs: Iterable[Config]) -> list[Result]:
        todo = [c for c in dict.fromkeys(configs) if c not in self.results]
        if self.jobs > 1 and len(todo) > 1:
            with ProcessPoolExecutor(self.jobs) as pool:
                done = list(pool.map(_search_one, [(c, self.run, self.attains) for c in todo]))
        else:
            done = [capacity_search(c, self.run, self.attains) for c in todo]
        for r in done:
            self.results[r.config] = r
            print(f"{r.config.label}: {r.capacity:g} req/s, goodput {r.goodput:.2f}", flush=True)
        return [self.results[c] for c in configs]

    def best(self, configs: Iterable[Config]) -> Result:
        return max(self.measure(list(configs)), key=Result.key)

    def aggregated(self) -> Result:
        return self.best(Config(0, chunk=c, max_seqs=s) for c in CHUNKS for s in MAX_SEQS)

    def disaggregated(self) -> Result:
        at = Config(10)
        for stage in ("split", "chunk", "remote_min", "max_seqs", "split"):
            at = self.best(_around(at, stage)).config
        return self.results[at]


def _around(c: Config, knob: str) -> list[Config]:
    if knob == "split":
        return [dataclasses.replace(c, prefill=p) for p in range(2, GPUS - 1, 2)]
    values = {"chunk": CHUNKS, "remote_min": THRESHOLDS, "max_seqs": MAX_SEQS}[knob]
    return [dataclasses.replace(c, **{knob: v}) for v in values]


def _search_one(job: tuple[Config, RunFn, Callable[[dict[str, Any]], bool]]) -> Result:
    return capacity_search(*job)

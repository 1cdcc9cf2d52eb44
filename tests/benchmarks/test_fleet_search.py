"""The tuned comparison's search: a capacity is the last rate of an unbroken run of
passes, a stage keeps the best, and the descent reaches an optimum it was not
started at (with a fake fleet whose capacity is a known function of its knobs)."""

from __future__ import annotations

from typing import Any

from benchmarks.fleet_search import LADDER, Config, Search, capacity_search


def _fake_capacity(flags: list[str]) -> float:
    f = dict(zip(flags[::2], flags[1::2], strict=True))
    prefill, chunk = int(f["--prefill-workers"]), int(f["--max-num-batched-tokens"])
    seqs, remote = int(f["--max-num-seqs"]), int(f["--min-remote-prefill-tokens"])
    if prefill == 0:
        return 16.0 + (32 if chunk == 512 else 0) + (8 if seqs == 256 else 0)
    return (
        100.0 - 6 * abs(prefill - 6) - (16 if chunk != 4096 else 0) - (8 if remote != 1024 else 0)
    )


def _run(flags: list[str], rate: float) -> dict[str, Any]:
    ok = rate <= _fake_capacity(flags)
    return {"ok": ok, "request_goodput": rate * (0.99 if ok else 0.5)}


def _attains(row: dict[str, Any]) -> bool:
    return bool(row["ok"])


def test_a_capacity_stops_at_the_first_miss() -> None:
    calls: list[float] = []

    def run(flags: list[str], rate: float) -> dict[str, Any]:
        calls.append(rate)
        return {"ok": rate in (8, 16, 32), "request_goodput": 1.0}

    r = capacity_search(Config(0), run, _attains)
    assert r.capacity == 16 and calls == [8, 16, 24]  # 32 passes, but after a miss
    assert capacity_search(Config(0), lambda f, r: {"ok": False, "request_goodput": 0.1},
                           _attains).capacity == 0  # fmt: skip
    assert max(LADDER) == 128


def test_the_search_finds_each_sides_optimum() -> None:
    s = Search(_run, _attains, jobs=1)
    agg = s.aggregated()
    assert (agg.config.chunk, agg.config.max_seqs, agg.capacity) == (512, 256, 56)
    dis = s.disaggregated()
    assert (dis.config.prefill, dis.config.chunk, dis.config.remote_min) == (6, 4096, 1024)
    assert dis.capacity == 96  # 100 rounded down to the ladder
    n = len(s.results)
    s.measure([Config(0, chunk=512, max_seqs=256)])
    assert len(s.results) == n  # measured once

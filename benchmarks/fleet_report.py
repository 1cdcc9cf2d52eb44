"""The tuned comparison's report: the docs section of a `benchmarks/fleet_sim.py
goodput` run, from the JSON the run writes (`--docs-from` writes it again)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from benchmarks.fleet_search import CHUNKS, MAX_SEQS, THRESHOLDS, Config


def tuned_report(out: dict[str, Any], profile: str, slo: dict[str, float]) -> str:
    """The docs section of a `fleet_sim.py goodput` run's JSON (`out`)."""

    fields = ("prefill", "chunk", "max_seqs", "remote_min")
    res = {Config(**{k: r[k] for k in fields}): _Searched(**r) for r in out["searched"]}
    best = out["best"]
    agg_c, dis_c = Config(**best["aggregated"]), Config(**best["disaggregated"])
    agg, dis = res[agg_c], res[dis_c]
    defaults = (res[Config(0)], res[Config(10)])
    rates, series = out["rates"], out["series"]
    cmd = out["command"]
    ratio = dis.capacity / agg.capacity if agg.capacity else float("inf")
    lines = [
        f"`python benchmarks/fleet_sim.py goodput --rates {cmd['rates']} --num-prompts "
        f"{cmd['num_prompts']} --jobs {cmd['jobs']} --write-docs`: {len(res)} "
        f"configurations searched, {out['wall_s']:.0f} s of wall time in all on "
        f"{out['cpu']} ({out['vcpus']} vCPUs).",
        "",
        f"Timing: the roofline `{profile}` (one H200 per worker, FP8 weights and KV, the "
        "latency terms above); KV moves at 375 of 400 Gbit/s per worker. Trace: "
        "`--dataset-name bursty --bursty-short-sharegpt --bursty-long-input-len 8192 "
        "--bursty-long-output-len 128 --bursty-long-every 10 --burstiness 0.5`, "
        f"{cmd['num_prompts']} requests per run. SLO: TTFT p99 <= {slo['ttft']:.0f} ms "
        f"and ITL p99 <= {slo['itl']:.0f} ms; a configuration's SLO capacity is the "
        "highest rate of 8, 16, ..., 96, 112, 128 req/s up to which every run meets both. "
        "Goodput (vLLM's, per request: TTFT <= 2000 ms and TPOT <= 50 ms, req/s) at that "
        "rate.",
        "",
        "Search space, both sides on 16 GPUs: chunk budget (`--max-num-batched-tokens`) "
        f"{', '.join(map(str, CHUNKS))}; max batch (`--max-num-seqs`) "
        f"{', '.join(map(str, MAX_SEQS))}; disaggregated also the split xPyD (x = 2, 4, "
        f"..., 14) and the remote-prefill threshold (`--min-remote-prefill-tokens`: "
        f"shorter prompts are prefilled on the decode worker) "
        f"{', '.join(map(str, THRESHOLDS))}. Aggregated: the full grid; disaggregated: "
        "coordinate descent from 10P6D (split, chunk, threshold, batch, split again).",
        "",
        "| configuration | SLO capacity (req/s) | goodput at it (req/s) |",
        "|---|---:|---:|",
        f"| aggregated, untuned ({Config(0).label}) | {defaults[0].capacity:g} | "
        f"{defaults[0].goodput:.1f} |",
        f"| **aggregated, best** ({agg_c.label}) | **{agg.capacity:g}** | {agg.goodput:.1f} |",
        f"| disaggregated, untuned ({Config(10).label}) | {defaults[1].capacity:g} | "
        f"{defaults[1].goodput:.1f} |",
        f"| **disaggregated, best** ({dis_c.label}) | **{dis.capacity:g}** | {dis.goodput:.1f} |",
        "",
        f"Tuned against tuned, disaggregation holds the SLO to {ratio:.2f}x the aggregated "
        "fleet's rate" + ("." if ratio >= 1 else ": the aggregated fleet wins on this trace."),
        "",
        "Sensitivity: aggregated SLO capacity (req/s) by chunk budget and max batch:",
        "",
        "| chunk budget | " + " | ".join(f"batch {m}" for m in MAX_SEQS) + " |",
        "|---:|" + "---:|" * len(MAX_SEQS),
    ]
    for c in CHUNKS:
        cells = [res.get(Config(0, chunk=c, max_seqs=m)) for m in MAX_SEQS]
        lines.append(f"| {c} | " + " | ".join(_cap(r) for r in cells) + " |")
    d = dis_c
    knobs = [
        ("split (prefill workers)", "prefill", range(2, 15, 2)),
        ("chunk budget", "chunk", CHUNKS),
        ("remote-prefill threshold", "remote_min", THRESHOLDS),
        ("max batch", "max_seqs", MAX_SEQS),
    ]
    lines += ["", f"Disaggregated, one knob at a time around the best ({d.label}):", ""]
    for name, field, values in knobs:
        cells = [res.get(dataclasses.replace(d, **{field: v})) for v in values]
        lines.append(
            f"- {name}: "
            + ", ".join(f"{v} -> {_cap(r)}" for v, r in zip(values, cells, strict=True))
        )
    names = list(series)
    a_rows, d_rows = series[names[0]], series[names[1]]
    lines += [
        "",
        "The two bests over the same rates:",
        "",
        "| rate | aggregated TTFT p99 | ITL p99 | TPOT p99 | goodput | disaggregated TTFT "
        "p99 | ITL p99 | TPOT p99 | goodput |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    agg_wins = []
    for r, a, b in zip(rates, a_rows, d_rows, strict=True):
        if a["request_goodput"] > b["request_goodput"]:
            agg_wins.append(f"{r:g}")
        lines.append(
            f"| {r:g} | {a['p99_ttft_ms']:.0f} | {a['p99_itl_ms']:.0f} | "
            f"{a['p99_tpot_ms']:.0f} | {a['request_goodput']:.2f} | {b['p99_ttft_ms']:.0f} | "
            f"{b['p99_itl_ms']:.0f} | {b['p99_tpot_ms']:.0f} | {b['request_goodput']:.2f} |"
        )
    tighter = []
    for itl in (100.0, 50.0, 30.0):
        caps = [_capacity_at(series[n], rates, slo["ttft"], itl) for n in names]
        tighter.append(f"ITL p99 <= {itl:g} ms: aggregated {caps[0]:g}, disaggregated {caps[1]:g}")
    lines += [
        "",
        "Aggregated has the higher goodput at "
        + (f"{', '.join(agg_wins)} req/s." if agg_wins else "none of these rates."),
        "",
        "The same two configurations (tuned for ITL p99 <= 100 ms, not re-tuned) under a "
        "tighter token-latency SLO, TTFT p99 <= 2000 ms kept, SLO capacity in req/s from "
        "the runs above: " + "; ".join(tighter) + ".",
        "",
        "![SLO sweep](img/fleet-sim-goodput.png)",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class _Searched:
    """One searched configuration, as the run's JSON holds it."""

    prefill: int
    chunk: int
    max_seqs: int
    remote_min: int
    capacity: float
    goodput: float


def _cap(r: _Searched | None) -> str:
    return "" if r is None else f"{r.capacity:g}"


def _capacity_at(
    rows: list[dict[str, Any]], rates: list[float], ttft_ms: float, itl_ms: float
) -> float:
    """The SLO capacity of a series of runs (one per rate) at these p99 targets."""
    best = 0.0
    for rate, row in zip(rates, rows, strict=True):
        if row["p99_ttft_ms"] > ttft_ms or row["p99_itl_ms"] > itl_ms:
            break
        best = rate
    return best

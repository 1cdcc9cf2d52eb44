"""The planner at fleet scale, in `diptych simulate`: SLA policy vs load policy vs
static provisioning for the peak, one simulated hour, side by side in one run.

    python benchmarks/planner_sim.py [--minutes 60] [--low 4] [--peak 24] [--write-docs]

Fleet: Llama-3.1-70B, FP8 weights and KV, one simulated H200 per worker, workers
ready `--startup` s after they are asked for. Trace: the bursty ShareGPT-like mix of
`benchmarks/fleet_sim.py` (an 8k-token prompt every 10th request) with a diurnal
rate: from `--low` up to `--peak` req/s and back over the run (a raised cosine), plus
three 2-minute bursts at 1.5x, arrivals a Poisson process thinned to that rate.

Runs, on the same trace:
    sla      the SLA policy (TTFT and ITL targets, sized from the roofline profile)
    load     the load policy (queue depth/age, KV usage, streams per replica)
    static   the cheapest fixed split sized for the peak: >= 95 % of requests within
             the SLA in every 5-minute window (bisected per pool from the SLA
             planner's peak)

A request meets the SLA when its TTFT and its TPOT are within the targets; the
table gives that share, the p99s, and accelerator-hours (every worker from the
moment it is asked for until it leaves). Writes docs/img/planner-sim.png (replicas
over time against the request rate) and, with --write-docs, its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from diptych.cli import build_parser  # noqa: E402
from diptych.simulate.cli import _vocab, fleet_config, simulate_rate  # noqa: E402
from diptych.simulate.workload import Workload, build  # noqa: E402

PROFILE = "H200:Llama-3.1-70B:tp1:float8"
IMG = ROOT / "docs" / "img" / "planner-sim.png"


def rate_at(t: float, args: argparse.Namespace) -> float:
    span = args.minutes * 60
    base = args.low + (args.peak - args.low) * 0.5 * (1 - math.cos(2 * math.pi * t / span))
    bursts = [0.2, 0.45, 0.7]  # fractions of the run where a 2-minute burst starts
    burst = any(b * span <= t < b * span + 120 for b in bursts)
    return base * (1.5 if burst else 1.0)


def diurnal(args: argparse.Namespace, vocab: int, simulate_args: Any) -> Workload:
    """Send times by thinning a Poisson process of the peak burst rate to `rate_at`."""
    rng = random.Random(args.seed)
    top = args.peak * 1.5
    times, t, span = [], 0.0, args.minutes * 60
    while True:
        t += rng.expovariate(top)
        if t >= span:
            break
        if rng.random() * top < rate_at(t, args):
            times.append(t)
    from bench.cli import config_from_args

    bench = config_from_args(simulate_args)
    spec = bench.workload.__class__(**{**bench.workload.__dict__, "num_prompts": len(times)})
    base = build(spec, vocab, math.inf, 1.0, args.seed)
    return Workload(base.requests, list(times), {})


def _simulate_args(args: argparse.Namespace, extra: list[str]) -> Any:
    return build_parser().parse_args(
        [
            "simulate", "--profile", PROFILE, "--dataset-name", "bursty",
            "--bursty-short-sharegpt", "--bursty-long-input-len", "8192",
            "--bursty-long-output-len", "128", "--bursty-long-every", "10",
            "--num-prompts", "1", "--seed", str(args.seed),
            "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.itl_ms:g}",
            "--max-num-batched-tokens", "2048", "--startup", str(args.startup),
            "--ttft-slo-ms", str(args.ttft_ms), "--itl-slo-ms", str(args.itl_ms),
            "--planner-interval", "30", "--up-cooldown", "30", "--down-cooldown", "60",
            "--idle-timeout", "120", "--max-prefill", "24", "--max-decode", "24",
            "--predictor", "holt", *extra,
        ]
    )  # fmt: skip


def _run(args: argparse.Namespace, workload: Workload, extra: list[str]) -> dict[str, Any]:
    a = _simulate_args(args, extra)
    from bench.cli import config_from_args

    bench = config_from_args(a)
    started = time.perf_counter()
    doc, rec = simulate_rate(bench, fleet_config(a, bench.ignore_eos), math.nan, 0, workload, a)
    doc["wall_s"] = time.perf_counter() - started
    windows: dict[int, list[bool]] = {}
    for r in rec.done:  # within the SLA, per 5-minute window of send times
        ok = r.ttft * 1e3 <= args.ttft_ms and r.tpot * 1e3 <= args.itl_ms
        windows.setdefault(int(r.start_time // 300), []).append(ok)
    doc["worst_window_met"] = min(sum(w) / len(w) for w in windows.values())
    doc.pop("busy", None)
    return doc


def cheapest_static(
    args: argparse.Namespace, workload: Workload, start: dict[str, int]
) -> tuple[dict[str, int], dict[str, Any]]:
    """The smallest fixed split sized for the peak (>= 95 % of requests within the SLA
    in every 5-minute window): from the SLA planner's peak, bisect the prefill pool,
    then the decode pool."""
    runs: dict[tuple[int, int], dict[str, Any]] = {}

    def ok(p: int, d: int) -> bool:
        if (p, d) not in runs:
            extra = ["--prefill-workers", str(p), "--decode-workers", str(d)]
            runs[p, d] = _run(args, workload, extra)
            print(f"static {p}P{d}D:", _row("static", runs[p, d]), flush=True)
        return bool(runs[p, d]["worst_window_met"] >= 0.95)  # sized for the peak

    p, d = start["prefill"], start["decode"]
    if not ok(p, d):
        raise RuntimeError(f"the SLA planner's peak {p}P{d}D misses the SLA statically")
    for pool in ("prefill", "decode"):
        lo, hi = 1, p if pool == "prefill" else d  # hi meets the SLA
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid, d) if pool == "prefill" else ok(p, mid):
                hi = mid
            else:
                lo = mid + 1
        p, d = (hi, d) if pool == "prefill" else (p, hi)
    return {"prefill": p, "decode": d}, runs[p, d]


def _row(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy": name,
        "accelerator_hours": doc["accelerator_hours"],
        "met_sla": doc["good_requests"] / max(doc["completed"], 1),
        "worst_window": doc["worst_window_met"],
        "p99_ttft_ms": doc["p99_ttft_ms"],
        "p99_itl_ms": doc["p99_itl_ms"],
        "completed": doc["completed"],
        "failed": doc["failed"],
        "wall_s": doc["wall_s"],
    }


def _plot(docs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    sla = docs["sla"]["planner"]
    minutes = [p["t"] / 60 for p in sla]
    a.plot(minutes, [p["rate"] for p in sla], label="observed")
    a.plot(minutes, [p["predicted_rate"] for p in sla], "--", label="predicted (holt)")
    a.set(ylabel="requests/s", title="request rate")
    a.legend()
    for name, style in (("sla", "-"), ("load", ":")):
        ticks = docs[name]["planner"]
        m = [p["t"] / 60 for p in ticks]
        for pool, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
            b.plot(m, [p["ready"][pool] for p in ticks], style, color=color,
                   label=f"{name}: {pool} ready")  # fmt: skip
    for pool, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        b.axhline(docs["static"]["static"][pool], color=color, alpha=0.4, lw=4,
                  label=f"static: {pool}")  # fmt: skip
    b.set(xlabel="minutes", ylabel="workers (H200s)", title="replicas per pool")
    b.legend(fontsize=8, ncol=3)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Llama-3.1-70B FP8 on simulated H200s, {args.minutes:g} min diurnal + bursts, "
        f"SLA TTFT {args.ttft_ms:g} ms / ITL {args.itl_ms:g} ms"
    )
    fig.tight_layout()
    IMG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG, dpi=90)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--low", type=float, default=4.0)
    p.add_argument("--peak", type=float, default=24.0)
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--itl-ms", type=float, default=100.0)
    p.add_argument("--startup", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    base = _simulate_args(args, [])
    workload = diurnal(args, _vocab(fleet_config(base, True)), base)
    print(f"{len(workload.requests)} requests over {args.minutes:g} min", flush=True)
    docs: dict[str, dict[str, Any]] = {}
    for name in ("sla", "load"):
        docs[name] = _run(args, workload, ["--planner", name, "--prefill-workers", "2",
                                           "--decode-workers", "2"])  # fmt: skip
        print(name, _row(name, docs[name]), flush=True)
    peak = {pool: max(t["target"][pool] for t in docs["sla"]["planner"])
            for pool in ("prefill", "decode")}  # fmt: skip
    peak, docs["static"] = cheapest_static(args, workload, peak)
    docs["static"]["static"] = peak
    print("static", peak, _row("static", docs["static"]), flush=True)
    rows = [_row(n, docs[n]) for n in ("static", "sla", "load")]
    _plot(docs, args)
    env = machine.describe(start, machine.snapshot())
    body = render(rows, peak, len(workload.requests), args, env)
    print(body)
    if args.write_docs:
        write_subsection("### The planner at fleet scale (simulated)", body, "## Fleet simulation")
    return 0


def render(
    rows: list[dict[str, Any]], peak: dict[str, int], n: int, args: argparse.Namespace, env: str
) -> str:
    static = rows[0]["accelerator_hours"]
    lines = [
        env,
        "",
        "```",
        f"python benchmarks/planner_sim.py --minutes {args.minutes:g} --low {args.low:g} "
        f"--peak {args.peak:g} --write-docs",
        "```",
        "",
        f"{n} requests in {args.minutes:g} simulated minutes, {args.low:g} -> {args.peak:g} "
        f"req/s and back, with three 2-minute bursts at 1.5x. SLA: TTFT <= {args.ttft_ms:g} ms "
        f"and TPOT <= {args.itl_ms:g} ms per request. Static: the cheapest fixed split sized "
        f"for the peak (>= 95 % within the SLA in every 5-minute window), "
        f"{peak['prefill']}P{peak['decode']}D, bisected per pool from the SLA planner's "
        f"peak. Workers take {args.startup:g} s "
        "to start and are paid for from the moment they are asked for.",
        "",
        "| policy | accelerator-hours | vs static | requests within SLA | worst 5 min "
        "| TTFT p99 | ITL p99 | completed | failed | wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        saved = 100 * (1 - r["accelerator_hours"] / static)
        lines.append(
            f"| {r['policy']} | {r['accelerator_hours']:.1f} | {-saved:+.0f} % "
            f"| {100 * r['met_sla']:.1f} % | {100 * r['worst_window']:.1f} % "
            f"| {r['p99_ttft_ms']:,.0f} ms | {r['p99_itl_ms']:.0f} ms "
            f"| {r['completed']} | {r['failed']} | {r['wall_s']:.0f} s |"
        )
    lines += ["", "![replicas over time](img/planner-sim.png)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Request-rate sweep of Diptych disaggregated vs aggregated on the bursty mix, with a plot.

    python benchmarks/serving_sweep.py [--rates 1,2,3,4,6,inf] [--num-prompts 48]
        [--goodput ttft:3000 tpot:150] [--json sweep.json] [--write-docs]

Each mode is a fresh `diptych serve` (aggregated: `--prefill-workers 0`; disaggregated:
one prefill and one decode worker over shm), driven by `diptych bench --dataset-name
bursty` at every rate in turn: steady short chats (prefilled on the decode worker:
shorter than its 128-token remote-prefill threshold) and every 8th request a long
prompt (prefilled by the prefill worker when there is one). Per-rate JSONs and each
mode's own plot land in --result-dir; the combined plot (both modes on one set of
axes) in --plot, by default docs/img/serving-sweep-bursty.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    build_parser,
    config_from_args,
    parse_goodput,
    plot_sweep,
    run_benchmark,
)
from bench.report import operating_point  # noqa: E402
from bench.slo import describe  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server  # noqa: E402

HEADING = "### Request-rate sweep: disaggregated vs aggregated on the bursty mix"
PLOT = ROOT / "docs" / "img" / "serving-sweep-bursty.png"


def workload_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name",
        "bursty",
        "--num-prompts",
        str(args.num_prompts),
        "--bursty-short-input-len",
        str(args.short_input_len),
        "--bursty-short-output-len",
        str(args.short_output_len),
        "--bursty-long-input-len",
        str(args.long_input_len),
        "--bursty-long-output-len",
        str(args.long_output_len),
        "--bursty-long-every",
        str(args.long_every),
        "--request-rate",
        args.rates,
        "--burstiness",
        str(args.burstiness),
        "--goodput",
        *args.goodput,
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
        "--num-warmups",
        "2",
    ]


def sweep_mode(mode: str, args: argparse.Namespace, builder: PromptBuilder) -> list[dict]:
    out_dir = Path(args.result_dir) / mode
    argv = ["--label", mode, "--result-dir", str(out_dir), *workload_argv(args)]
    if not sys.stderr.isatty():
        argv.append("--disable-tqdm")
    with diptych_server(mode) as server:
        print(f"\n== {mode}: diptych bench --base-url {server.url} {' '.join(argv)}", flush=True)
        config = config_from_args(build_parser().parse_args(["--base-url", server.url, *argv]))
        docs = asyncio.run(run_benchmark(config, builder))
    return [{k: v for k, v in d.items() if not isinstance(v, list)} for d in docs]


def _rate(row: dict[str, Any]) -> float:
    return math.inf if row["request_rate"] == "inf" else float(row["request_rate"])


def render(
    series: dict[str, list[dict]], args: argparse.Namespace, env: str, cmd: str, plot: Path
) -> str:
    slos = parse_goodput(args.goodput)
    rel = plot.relative_to(ROOT / "docs") if plot.is_relative_to(ROOT / "docs") else plot
    lines = [
        env,
        "",
        f"Workload (`--dataset-name bursty`): {args.num_prompts} requests per rate; short chats "
        f"of {args.short_input_len} prompt / {args.short_output_len} output tokens, and every "
        f"{args.long_every}th request a long prompt of {args.long_input_len} / "
        f"{args.long_output_len}; greedy, EOS ignored; Poisson arrivals (burstiness "
        f"{args.burstiness:g}); fresh prompts at every rate. Goodput SLOs: {describe(slos)}. "
        "Times in ms; TPOT p99 (short) is over the short chats only, TTFT p99 (long) over "
        "the long prompts only.",
        "",
        "```",
        cmd,
        "```",
        "",
        f"![sweep]({rel})",
        "",
        "| mode | rate (req/s) | done / failed | req/s | goodput (req/s) | output tok/s | "
        "TTFT p99 | TPOT p99 | TPOT p99 (short) | TTFT p99 (long) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, rows in series.items():
        for r in sorted(rows, key=_rate):
            tags = r.get("per_tag", {})
            short = tags.get("short", {}).get("p99_tpot_ms", math.nan)
            long = tags.get("long", {}).get("p99_ttft_ms", math.nan)
            lines.append(
                f"| {mode} | {r['request_rate']} | {r['completed']} / {r['failed']} | "
                f"{r['request_throughput']:.2f} | {r['request_goodput']:.2f} | "
                f"{r['output_throughput']:.1f} | {r['p99_ttft_ms']:.0f} | {r['p99_tpot_ms']:.1f} | "
                f"{short:.1f} | {long:.0f} |"
            )
    lines.append("")
    for mode, rows in series.items():
        point = operating_point(rows)
        if point is not None:
            lines.append(
                f"- {mode}: goodput peaks at {point['request_goodput']:.2f} req/s with "
                f"{point['request_rate']} req/s offered (the operating point)."
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="disaggregated,aggregated")
    ap.add_argument("--rates", default="1,2,3,4,6,inf")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--short-input-len", type=int, default=96)
    ap.add_argument("--short-output-len", type=int, default=64)
    ap.add_argument("--long-input-len", type=int, default=1024)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--long-every", type=int, default=8)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--goodput", nargs="+", default=["ttft:3000", "tpot:150"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default=None, help="per-rate JSONs (default: a temp dir)")
    ap.add_argument("--plot", default=str(PLOT))
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    args.result_dir = args.result_dir or tempfile.mkdtemp(prefix="serving-sweep-")
    builder = PromptBuilder(load_tokenizer(None))
    start = machine.snapshot()
    series = {mode: sweep_mode(mode, args, builder) for mode in args.modes.split(",")}
    end = machine.snapshot()
    slos = parse_goodput(args.goodput)
    plot = Path(args.plot).resolve()
    plot_sweep(series, plot, slos, f"Diptych on the bursty mix ({args.num_prompts} requests/rate)")
    cmd = "python benchmarks/serving_sweep.py " + " ".join(sys.argv[1:])
    text = render(series, args, machine.describe(start, end), cmd.strip(), plot)
    print("\n" + text + f"\nplot: {plot}\nper-rate results: {args.result_dir}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": [start, end], "series": series}, indent=1)
        )
    if args.write_docs:
        write_subsection(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

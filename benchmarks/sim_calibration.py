"""Calibration of the simulated engine against the real one, side by side on this machine.

    python benchmarks/sim_calibration.py --profile cpu.json [--rates 2,6]
        [--num-prompts 100] [--write-docs]

With a profile `diptych profile --url` measured here against the real server (the
same engine flags), the same `diptych bench` workload runs against

    real        `diptych serve --prefill-workers 0` (one aggregated worker, the model)
    sim server  the same command with `--engine sim --profile cpu.json`
    simulate    `diptych simulate --profile cpu.json --prefill-workers 0 --decode-workers 1`

and the TTFT and TPOT p50 / p90 of the last two are set against the first's. One
aggregated worker: on 2 cores a prefill and a decode worker would share the CPUs, and
the profile measures an engine that has them to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import build_parser, config_from_args, run_benchmark  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server  # noqa: E402
from diptych.cli import build_parser as diptych_parser  # noqa: E402
from diptych.simulate.cli import fleet_config, simulate_rate  # noqa: E402

KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms")
# Sent at once before each rate's run: a fresh engine is slower for a while (oneDNN
# builds a primitive for every new batch shape, ~10 ms each), so every server, and
# the server the profile is measured on, first serves a burst of mixed steps.
WARMUPS = "32"


def workload(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        args.rates,
        "--seed",
        str(args.seed),
        "--temperature",
        "0",
        "--metric-percentiles",
        "50,90,99",
    ]


def measure_profile(args: argparse.Namespace) -> str:
    """`diptych profile --url` against a fresh real server, into the result directory:
    the profile and the runs it is compared with then share the machine's state."""
    from diptych.cli import build_parser as cli
    from diptych.options import engine_config
    from diptych.profile import profile

    out = Path(args.result_dir) / "cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with diptych_server("aggregated", "--kv-cache-memory", str(args.kv_gib)) as s:
        a = cli().parse_args(
            [
                "profile",
                "--url",
                s.url,
                "--repeats",
                "3",
                "--contexts",
                "128,512,1024",
                "--kv-cache-memory",
                str(args.kv_gib),
            ]
        )
        out.write_text(json.dumps(profile(engine_config(a), a), indent=1))
    return str(out)


def served(label: str, flags: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    builder = PromptBuilder(load_tokenizer(None))
    with diptych_server("aggregated", "--kv-cache-memory", str(args.kv_gib), *flags) as s:
        argv = [
            "--base-url",
            s.url,
            "--label",
            label,
            "--disable-tqdm",
            "--num-warmups",
            WARMUPS,
            "--result-dir",
            args.result_dir,
            *workload(args),
        ]
        print(f"== {label}: diptych bench {' '.join(argv)}", flush=True)
        docs = asyncio.run(
            run_benchmark(config_from_args(build_parser().parse_args(argv)), builder)
        )
    return [{k: v for k, v in d.items() if not isinstance(v, list)} for d in docs]


def simulated(args: argparse.Namespace) -> list[dict[str, Any]]:
    a = diptych_parser().parse_args(
        [
            "simulate",
            "--profile",
            args.profile,
            "--prefill-workers",
            "0",
            "--decode-workers",
            "1",
            *workload(args),
        ]
    )
    bench = config_from_args(a)
    fleet = fleet_config(a, bench.ignore_eos)
    return [simulate_rate(bench, fleet, r, i)[0] for i, r in enumerate(bench.rates)]


def table(rates: list[float], series: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| rate (req/s) | source | served (req/s) | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 "
        "| worst |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    real = series["real"]
    for i, rate in enumerate(rates):
        for name, rows in series.items():
            row = rows[i]
            cells = []
            worst = 0.0
            for k in KEYS:
                v = row[k]
                if name == "real":
                    cells.append(f"{v:.1f}")
                else:
                    d = 100 * (v - real[i][k]) / real[i][k]
                    worst = max(worst, abs(d))
                    cells.append(f"{v:.1f} ({d:+.0f} %)")
            w = "" if name == "real" else f"{worst:.0f} %"
            served = row.get("request_throughput")
            cells.insert(0, "" if served is None else f"{served:.2f}")
            lines.append(f"| {rate:g} | {name} | " + " | ".join(cells) + f" | {w} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--profile", default=None, help="a served profile (default: measure one first, in this run)"
    )
    p.add_argument("--rates", default="2,6")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="sim-calibration")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    from kernels.cpu_isa import probe

    start = machine.snapshot()
    if args.profile is None:
        args.profile = measure_profile(args)
    first = served("real", [], args)
    sim = served("sim server", ["--engine", "sim", "--profile", args.profile], args)
    again = served("real (again)", [], args)
    # the reference: the mean of two real runs, one before and one after the simulations
    real = [
        {k: (a[k] + b[k]) / 2 for k in (*KEYS, "request_throughput")}
        for a, b in zip(first, again, strict=True)
    ]
    series = {
        "real": real,
        "real, first run": first,
        "real, second run": again,
        "sim server": sim,
        "simulate": simulated(args),
    }
    isa = probe()
    env = f"{machine.describe(start, machine.snapshot())} CPU ISA level {isa.level}."
    body = "\n".join(
        [
            f"{env}",
            "",
            "```",
            f"diptych serve --prefill-workers 0 --kv-cache-memory {args.kv_gib:g} &",
            f"diptych profile --url http://127.0.0.1:8000 --output cpu.json --repeats 3 "
            f"--contexts 128,512,1024 --kv-cache-memory {args.kv_gib:g}",
            f"python benchmarks/sim_calibration.py --profile cpu.json --rates {args.rates} "
            f"--num-prompts {args.num_prompts} --write-docs",
            "```",
            "",
            f"Workload: `--dataset-name random --random-input-len {args.input_len} "
            f"--random-output-len {args.output_len}`, {args.num_prompts} requests per rate, "
            "Poisson arrivals, greedy, EOS ignored; one aggregated worker; before each "
            f"rate every server first serves {WARMUPS} requests at once (warm-up). "
            '"served" is the request throughput achieved. Times in ms; '
            '"real" is the mean of two runs of the real server, one before and one after '
            "the simulated ones (each shown, so the machine's own drift is in the table); "
            "in brackets the difference from that mean.",
            "",
            table(rates, series),
        ]
    )
    print(body)
    if args.write_docs:
        write_subsection(
            "### Calibration: the simulated engine against the real one",
            body,
            "## Fleet simulation",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

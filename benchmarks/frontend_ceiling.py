"""The frontend's ceiling: streamed tokens per second one frontend process sustains.

    python benchmarks/frontend_ceiling.py [--concurrency 16,64,256] [--decode-workers 2]
        [--output-len 512] [--py-spy] [--write-docs]

Workers are `--engine sim --profile instant`: a step takes no time, so they emit
tokens as fast as the system asks. `diptych bench` streams `--output-len` tokens to
each of `--concurrency` clients at once (completions, greedy, EOS ignored). Besides
the tokens per second the clients receive, the frontend process's CPU time over the
run (from /proc) gives tokens per frontend CPU-second, the rate one frontend would
reach on a core of its own; on 2 cores the workers and the load generator share the
machine with it. `--py-spy` samples the frontend (py-spy record) during the largest
run and prints where its time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import build_parser, config_from_args, run_benchmark  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def py_spy_top(pid: int, seconds: int, out: Path) -> list[tuple[str, float]]:
    """The frontend's hottest functions (own time) over `seconds` of sampling."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    subprocess.run(
        [
            exe,
            "record",
            "-p",
            str(pid),
            "-d",
            str(seconds),
            "-f",
            "raw",
            "-o",
            str(out),
            "-r",
            "200",
            "--nonblocking",
        ],
        check=True,
        capture_output=True,
    )
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        leaf = frames[-1]
        own[leaf.split(" (")[0] + " (" + leaf.split(" (")[-1] if " (" in leaf else leaf] += n
    return [(name, 100 * n / total) for name, n in own.most_common(12)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    builder = PromptBuilder(load_tokenizer(None))
    rows = []
    spy: list[tuple[str, float]] = []
    flags = [
        "--engine",
        "sim",
        "--profile",
        "instant",
        "--decode-workers",
        str(args.decode_workers),
        "--max-num-seqs",
        "512",
    ]
    with diptych_server("aggregated", *flags) as server:
        manifest = json.loads((server.workdir / "state" / "serve.json").read_text())
        pid = int(manifest["frontend"]["pid"])
        for c in args.concurrency:
            argv = [
                "--base-url",
                server.url,
                "--dataset-name",
                "random",
                "--random-input-len",
                "16",
                "--random-output-len",
                str(args.output_len),
                "--num-prompts",
                str(c * args.rounds),
                "--max-concurrency",
                str(c),
                "--temperature",
                "0",
                "--disable-tqdm",
            ]
            config = config_from_args(build_parser().parse_args(argv))
            spying = None
            if args.py_spy and c == max(args.concurrency):
                from concurrent.futures import ThreadPoolExecutor

                pool = ThreadPoolExecutor(1)
                spying = pool.submit(py_spy_top, pid, 8, server.workdir / "py-spy.txt")
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            doc = asyncio.run(run_benchmark(config, builder))[0]
            cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
            if spying is not None:
                spy = spying.result()
            tokens = doc["total_output_tokens"]
            rows.append(
                {
                    "concurrency": c,
                    "tok_s": doc["output_throughput"],
                    "frontend_cpu_share": cpu / wall,
                    "tok_per_cpu_s": tokens / cpu,
                    "failed": doc["failed"],
                    "p50_itl_ms": doc["median_itl_ms"],
                }
            )
            print(rows[-1], flush=True)
    return {"rows": rows, "py_spy": spy}


def render(result: dict[str, Any], env: str, args: argparse.Namespace) -> str:
    lines = [
        env,
        "",
        "```",
        f"python benchmarks/frontend_ceiling.py --concurrency "
        f"{','.join(map(str, args.concurrency))} --decode-workers {args.decode_workers} "
        f"--output-len {args.output_len}{' --py-spy' if args.py_spy else ''} --write-docs",
        "```",
        "",
        "| clients | streamed tok/s | frontend CPU (cores) | tok per frontend CPU-s "
        "| ITL p50 | failed |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['tok_s']:,.0f} | {r['frontend_cpu_share']:.2f} "
            f"| {r['tok_per_cpu_s']:,.0f} | {r['p50_itl_ms']:.1f} ms | {r['failed']} |"
        )
    if result["py_spy"]:
        lines += ["", "Where the frontend's time goes at the largest load (py-spy, own time):", ""]
        lines += [f"- {pct:.1f} % `{name}`" for name, pct in result["py_spy"]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256]
    )
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2, help="requests per client")
    p.add_argument("--py-spy", action="store_true")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    result = run(args)
    from kernels.cpu_isa import probe

    env = f"{machine.describe(start, machine.snapshot())} CPU ISA level {probe().level}."
    body = render(result, env, args)
    print(body)
    if args.write_docs:
        write_subsection("### The frontend's ceiling", body, "## Fleet simulation")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
    """The hottest functions (own time) of the frontend's event-loop thread over
    `seconds` of sampling."""
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
        if frames[0].startswith("Thread._bootstrap"):
            continue  # helper threads (gRPC's poller, executors) mostly wait in C
        n = int(count)
        total += n
        leaf = frames[-1]
        own[leaf.split(" (")[0] + " (" + leaf.split(" (")[-1] if " (" in leaf else leaf] += n
    return [(name, 100 * n / total) for name, n in own.most_common(12)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    builder = PromptBuilder(load_tokenizer(None))
    rows = []
    spy: list[tuple[str, float]] = []
    plans = [("instant", c) for c in args.concurrency]
    if args.paced_step_ms:
        plans.append((f"fixed:{args.paced_step_ms:g}ms", max(args.concurrency)))
    for profile in dict.fromkeys(p for p, _ in plans):
        flags = ["--engine", "sim", "--profile", profile]
        flags += ["--decode-workers", str(args.decode_workers), "--max-num-seqs", "512"]
        with diptych_server("aggregated", *flags) as server:
            manifest = server.manifest()
            pid = int(manifest["frontend"]["pid"])
            workers = [int(v["pid"]) for k, v in manifest.items() if k.startswith("decode")]
            for _, c in (plan for plan in plans if plan[0] == profile):
                spying = args.py_spy and profile == "instant" and c == max(args.concurrency)
                row, top = _measure(args, builder, server.url, pid, workers, c, spying)
                rows.append({"workers": profile, **row})
                spy = top or spy
                print(rows[-1], flush=True)
    return {"rows": rows, "py_spy": spy}


def _measure(
    args: argparse.Namespace,
    builder: PromptBuilder,
    url: str,
    pid: int,
    workers: list[int],
    c: int,
    spying: bool,
) -> tuple[dict[str, Any], list[tuple[str, float]]]:
    argv = ["--base-url", url, "--dataset-name", "random", "--random-input-len", "16"]
    argv += ["--random-output-len", str(args.output_len), "--num-prompts", str(c * args.rounds)]
    argv += ["--max-concurrency", str(c), "--temperature", "0", "--disable-tqdm"]
    config = config_from_args(build_parser().parse_args([*argv, "--save-detailed"]))
    pool = ThreadPoolExecutor(1)
    top = pool.submit(py_spy_top, pid, 8, Path(f"/tmp/py-spy-{pid}.txt")) if spying else None
    workers0, client0 = sum(map(cpu_seconds, workers)), sum(os.times()[:2])
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    doc = asyncio.run(run_benchmark(config, builder))[0]
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    workers_cpu = sum(map(cpu_seconds, workers)) - workers0
    client_cpu = sum(os.times()[:2]) - client0
    tokens = doc["total_output_tokens"]
    # one SSE event per token unless a worker ran ahead of the frontend (then the
    # tokens waiting for a stream go out together)
    events = sum(len(itls) + 1 for itls in doc["itls"] if itls is not None)
    row = {
        "concurrency": c,
        "tok_s": doc["output_throughput"],
        "events_s": events / doc["duration"],
        "tokens_per_event": tokens / max(events, 1),
        "frontend_cpu_share": cpu / wall,
        "workers_cpu_share": workers_cpu / wall,
        "client_cpu_share": client_cpu / wall,
        "tok_per_cpu_s": tokens / cpu,
        "failed": doc["failed"],
    }
    return row, top.result() if top is not None else []


def render(result: dict[str, Any], env: str, args: argparse.Namespace) -> str:
    lines = [
        env,
        "",
        "```",
        f"python benchmarks/frontend_ceiling.py --concurrency "
        f"{','.join(map(str, args.concurrency))} --decode-workers {args.decode_workers} "
        f"--output-len {args.output_len}"
        f"{f' --paced-step-ms {args.paced_step_ms:g}' if args.paced_step_ms else ''}"
        f"{' --py-spy' if args.py_spy else ''} --write-docs",
        "```",
        "",
        "CPU in cores over each run: the frontend, the decode workers together, and the "
        "load generator (this process).",
        "",
        "| workers | clients | streamed tok/s | SSE events/s | tok/event | frontend CPU "
        "| workers CPU | load generator CPU | tok per frontend CPU-s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workers']} | {r['concurrency']} | {r['tok_s']:,.0f} | {r['events_s']:,.0f} "
            f"| {r['tokens_per_event']:.2f} | {r['frontend_cpu_share']:.2f} "
            f"| {r['workers_cpu_share']:.2f} | {r['client_cpu_share']:.2f} "
            f"| {r['tok_per_cpu_s']:,.0f} | {r['failed']} |"
        )
    if result["py_spy"]:
        lines += [
            "",
            "Where the frontend's event-loop thread spends its time at the largest load "
            "(py-spy, own time):",
            "",
        ]
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
    p.add_argument(
        "--paced-step-ms",
        type=float,
        default=0.0,
        help="also run the largest concurrency on workers whose every step takes this long",
    )
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

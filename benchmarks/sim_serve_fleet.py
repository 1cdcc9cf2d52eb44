"""Many simulated workers behind one frontend, on this machine, under a bursty load.

    python benchmarks/sim_serve_fleet.py [--prefill-workers 16] [--decode-workers 32]
        [--minutes 5] [--rate 4] [--write-docs]

`diptych serve --engine sim --profile H200:Llama-3.1-70B:tp8` with that many real
worker processes (real frontend, gRPC, embedded control plane, shm KV transfer),
driven by `diptych bench --dataset-name bursty --burstiness 0.5` for `--minutes`, on
etcd and NATS JetStream (started here, on loopback): their watches and fetches wait
on the server, so an idle worker costs almost nothing, where the embedded control
plane's SQLite polling costs each worker 2-4 % of a core.
Reports errors, every worker's KV blocks in use afterwards (must be 0), and the CPU
and memory of one idle and one busy decode and prefill worker (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import build_parser, config_from_args, run_benchmark  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server, free_port  # noqa: E402

PROFILE = "H200:Llama-3.1-70B:tp8"


def proc_stats(pid: int) -> tuple[float, float]:
    """(CPU seconds so far, proportional set size in MiB) of a process. PSS, not RSS:
    a prefill worker maps every decode worker's KV pool, which RSS counts whole."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return cpu, int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss for {pid}")


def cpu_share(pid: int, seconds: float) -> tuple[float, float]:
    c0, _ = proc_stats(pid)
    time.sleep(seconds)
    c1, rss = proc_stats(pid)
    return (c1 - c0) / seconds, rss


def kv_used(metrics_address: str) -> float:
    text = httpx.get(f"http://{metrics_address}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("diptych_worker_kv_used_blocks "):
            return float(line.split()[-1])
    raise RuntimeError(f"{metrics_address} exports no diptych_worker_kv_used_blocks")


def control_plane(workdir: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """nats-server (JetStream) and etcd on free loopback ports; their processes and the
    `diptych serve` flags that point at them."""
    nats, etcd, peer = free_port(), free_port(), free_port()
    procs = [
        subprocess.Popen(
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats), "-sd", str(workdir / "js")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                "etcd",
                "--data-dir",
                str(workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    time.sleep(3)
    return procs, ["--etcd", f"127.0.0.1:{etcd}", "--nats", f"127.0.0.1:{nats}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prefill-workers", type=int, default=16)
    p.add_argument("--decode-workers", type=int, default=32)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    n = int(args.rate * args.minutes * 60)
    flags = [
        "--engine",
        "sim",
        "--profile",
        PROFILE,
        "--prefill-workers",
        str(args.prefill_workers),
        "--decode-workers",
        str(args.decode_workers),
    ]
    builder = PromptBuilder(load_tokenizer(None))
    planes, plane_flags = control_plane(Path(tempfile.mkdtemp(prefix="sim-fleet-cp-")))
    t0 = time.perf_counter()
    try:
        return run(args, flags + plane_flags, builder, n, start, t0)
    finally:
        for proc in planes:
            proc.terminate()
            proc.wait(30)


def run(
    args: argparse.Namespace,
    flags: list[str],
    builder: PromptBuilder,
    n: int,
    start: dict[str, Any],
    t0: float,
) -> int:
    with diptych_server("disaggregated", *flags) as server:
        started_s = time.perf_counter() - t0
        manifest: dict[str, Any] = server.manifest()
        workers = {k: v for k, v in manifest.items() if k != "frontend"}
        dec, pre = int(workers["decode-0"]["pid"]), int(workers["prefill-0"]["pid"])
        idle = {"decode": cpu_share(dec, 10), "prefill": cpu_share(pre, 10)}
        total_rss = sum(proc_stats(int(w["pid"]))[1] for w in workers.values())
        argv = [
            "--base-url",
            server.url,
            "--dataset-name",
            "bursty",
            "--num-prompts",
            str(n),
            "--request-rate",
            str(args.rate),
            "--burstiness",
            "0.5",
            "--temperature",
            "0",
            "--disable-tqdm",
        ]
        busy: dict[str, tuple[float, float]] = {}

        def sample() -> None:
            time.sleep(min(60.0, args.minutes * 30))
            busy["decode"] = cpu_share(dec, 20)
            busy["prefill"] = cpu_share(pre, 20)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        config = config_from_args(build_parser().parse_args(argv))
        doc = asyncio.run(run_benchmark(config, builder))[0]
        sampler.join()
        time.sleep(2)
        leaks = {k: kv_used(v["metrics"]) for k, v in workers.items()}
    env = f"{machine.describe(start, machine.snapshot())}"
    used = {k: v for k, v in leaks.items() if v}
    lines = [
        env,
        "",
        "```",
        f"python benchmarks/sim_serve_fleet.py --prefill-workers {args.prefill_workers} "
        f"--decode-workers {args.decode_workers} --minutes {args.minutes:g} --rate "
        f"{args.rate:g} --write-docs   # starts its own nats-server and etcd",
        "```",
        "",
        f"`diptych serve --engine sim --profile {PROFILE} --etcd ... --nats ...` with "
        f"{args.prefill_workers} "
        f"prefill and {args.decode_workers} decode worker processes (ready in "
        f"{started_s:.0f} s; {total_rss / 1024:.1f} GiB PSS in all), "
        f"{doc['completed']} requests of `--dataset-name bursty` at {args.rate:g} req/s "
        f"(burstiness 0.5) over {doc['duration']:.0f} s: {doc['failed']} failed; TTFT "
        f"p50/p99 {doc['median_ttft_ms']:.0f}/{doc['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
        f"{doc['median_tpot_ms']:.1f}/{doc['p99_tpot_ms']:.1f} ms. KV blocks in use "
        f"afterwards: {used if used else '0 on every worker'}.",
        "",
        "| worker | idle CPU | busy CPU | memory (PSS) |",
        "|---|---:|---:|---:|",
    ]
    for role in ("decode", "prefill"):
        lines.append(
            f"| {role}-0 | {100 * idle[role][0]:.1f} % | {100 * busy[role][0]:.1f} % "
            f"| {busy[role][1]:.0f} MiB |"
        )
    body = "\n".join(lines)
    print(body)
    if args.write_docs:
        write_subsection(
            "### Many simulated workers behind one frontend", body, "## Fleet simulation"
        )
    return 0 if doc["failed"] == 0 and not used else 1


if __name__ == "__main__":
    sys.exit(main())

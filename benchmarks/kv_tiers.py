"""KV tiers on real processes: agent sessions that outgrow the device pool, with the
host tier off and on, side by side in one run.

One `diptych serve --prefill-workers 0` (a decode worker, the default model) per row,
its KV pool cut to `--num-blocks` blocks so that the live sessions' contexts are
several times what it holds; `diptych bench --dataset-name agentic` drives the same
sessions each time (a system prompt and a task, then turns of the model's output and a
tool result arriving after a tool latency; each request names its session in an
X-Session-Id header). Rows: no tier (an evicted prefix is prefilled again next turn),
the host tier (`--kv-host-memory`), the host tier with session holds
(`--kv-session-ttl`: a session's last turn keeps its blocks on the device through the
tool wait), and the disk tier alone (`--kv-disk-dir`, no host tier). Per-turn TTFT
p50, the prompt tokens prefilled and found cached (the server's usage), output
throughput, and the worker's tier counters.

    python -m benchmarks.kv_tiers --docs
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import machine
from benchmarks.docs_section import write_subsection
from benchmarks.servers import ROOT, diptych_server, scrape

HEADING = "### KV tiers: agent sessions that outgrow the device pool"


def workload(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "agentic", "--multiturn-turns", str(args.turns),
        "--multiturn-system-len", str(args.system_len), "--multiturn-num-system-prompts", "1",
        "--multiturn-user-len", str(args.task_len), "--multiturn-output-len", str(args.output_len),
        "--agentic-tool-len", str(args.tool_len), "--agentic-tool-latency", str(args.tool_latency),
        "--num-prompts", str(args.sessions * args.turns), "--seed", str(args.seed),
        "--request-rate", "inf", "--max-concurrency", str(args.sessions), "--session-header",
    ]  # fmt: skip


def run(args: argparse.Namespace, name: str, flags: list[str], out: Path) -> dict[str, Any]:
    serve = ["--num-blocks", str(args.num_blocks), "--dtype", "float32", *flags]
    with diptych_server("aggregated", *serve) as server:
        cmd = [
            sys.executable, "-m", "diptych.cli", "bench", "--base-url", server.url,
            *workload(args), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json",
            "--request-timeout", "600",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        metrics = scrape(f"http://{server.manifest()['decode-0']['metrics']}")
    doc: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    doc["name"] = name
    doc["tiers"] = {k.removeprefix("diptych_worker_kv_tier_"): v for k, v in metrics.items()
                    if k.startswith("diptych_worker_kv_tier_")}  # fmt: skip
    turns = {t: m["median_ttft_ms"] for t, m in sorted(doc.get("per_tag", {}).items())}
    print(f"{name:10s} TTFT p50 by turn {turns}  prefilled {doc.get('total_prefilled_tokens')}"
          f"  cached {doc.get('total_cached_tokens')}  output {doc['output_throughput']:.1f} "
          f"tok/s  failed {doc['failed']}", flush=True)  # fmt: skip
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16, help="sessions in flight")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--task-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--tool-len", type=int, default=64)
    p.add_argument("--tool-latency", type=float, default=1.0, help="mean seconds")
    p.add_argument("--num-blocks", type=int, default=200, help="the device pool's blocks")
    p.add_argument("--session-ttl", type=float, default=5.0, help="the holds row's seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", default="off,host,host+holds,disk",
                   help="which rows, of off, host, host+holds, disk")  # fmt: skip
    p.add_argument("--heading", default=HEADING, help="the docs subsection to write")
    p.add_argument("--docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    out = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    ttl = str(args.session_ttl)
    flags = {
        "off": [],
        "host": ["--kv-host-memory", "4"],
        "host+holds": ["--kv-host-memory", "4", "--kv-session-ttl", ttl],
        "disk": ["--kv-disk-dir", str(out / "disk"), "--kv-disk-gib", "4"],
    }
    rows = [run(args, name, flags[name], out) for name in args.rows.split(",")]
    end = machine.snapshot()
    body = _table(args, rows, machine.describe(start, end))
    print(body)
    if args.docs:
        write_subsection(args.heading, body, section="## Engine")
    return 0


def _command(args: argparse.Namespace) -> str:
    """This run's command line: the options that differ from their defaults."""
    default = {"sessions": 16, "turns": 8, "system_len": 256, "task_len": 64,
               "output_len": 16, "tool_len": 64, "num_blocks": 200,
               "rows": "off,host,host+holds,disk", "heading": HEADING}  # fmt: skip
    extra = [f"--{k.replace('_', '-')} {shlex.quote(str(getattr(args, k)))}"
             for k, v in default.items() if getattr(args, k) != v]  # fmt: skip
    return " ".join(["python -m benchmarks.kv_tiers", *extra, "--docs"])


def _p50(row: dict[str, Any], turn: str) -> float:
    return float(row["per_tag"][turn]["median_ttft_ms"])


def _table(args: argparse.Namespace, rows: list[dict[str, Any]], conditions: str) -> str:
    turns = sorted(rows[0].get("per_tag", {}))
    context = args.system_len + args.task_len + (args.turns - 1) * (args.output_len + args.tool_len)
    lines = [
        f"`{_command(args)}`: a fresh `diptych serve --prefill-workers 0 "
        f"--num-blocks {args.num_blocks} --dtype float32` (the default model, one decode "
        f"worker, {args.num_blocks - 1} usable blocks of 16 tokens) per row, driven by "
        f"`diptych bench --dataset-name agentic`: {args.sessions} sessions in flight, "
        f"{args.turns} turns each (a {args.system_len}-token system prompt and a "
        f"{args.task_len}-token task, then each turn the model's {args.output_len} tokens and "
        f"a tool result of {args.tool_len} tokens on average after {args.tool_latency:g} s on "
        f"average), greedy, each request naming its session (`--session-header`); the "
        f"holds row adds `--kv-session-ttl {args.session_ttl:g}`. A session's last turn "
        f"holds about {context} tokens, so the live "
        f"sessions want about {args.sessions * context // 16} blocks, "
        f"{args.sessions * context / 16 / (args.num_blocks - 1):.1f}x the pool.",
        "",
        "| tiers | " + " | ".join(f"TTFT p50 {t}" for t in turns)
        + " | prompt tokens prefilled | found cached | output tok/s | blocks restored "
        "| restore time | failed |",
        "|---|" + "---:|" * (len(turns) + 6),
    ]
    for r in rows:
        per = r.get("per_tag", {})
        t = r["tiers"]
        lines.append(
            f"| {r['name']} | " + " | ".join(f"{per[k]['median_ttft_ms']:,.0f} ms" for k in turns)
            + f" | {r.get('total_prefilled_tokens', 0):,} | {r.get('total_cached_tokens', 0):,} "
            f"| {r['output_throughput']:.1f} | {t.get('restored_blocks_total', 0):,.0f} | "
            f"{1e3 * t.get('restore_seconds_total', 0):,.0f} ms | {r['failed']} |"
        )  # fmt: skip
    named = {r["name"]: r for r in rows}
    off, host, holds = named["off"], named["host"], named.get("host+holds")
    later = [k for k in turns if k != "turn1"]
    ratios = [host["per_tag"][k]["median_ttft_ms"] / off["per_tag"][k]["median_ttft_ms"]
              for k in later]  # fmt: skip
    prefilled = host.get("total_prefilled_tokens", 0) / max(off.get("total_prefilled_tokens", 1), 1)
    lines += [
        "",
        "Host tier against none: TTFT p50 of turns 2 and later "
        + ", ".join(f"{x:.2f}x" for x in ratios)
        + f"; prompt tokens prefilled {prefilled:.4f}x; output throughput "
        f"{host['output_throughput'] / off['output_throughput']:.2f}x."
        + ("" if holds is None else
           " With session holds against the host tier alone: TTFT p50 of turns 2 and later "
           + ", ".join(f"{_p50(holds, k) / _p50(host, k):.2f}x" for k in later)
           + f"; output throughput {holds['output_throughput'] / host['output_throughput']:.2f}x."),
        "",
        conditions,
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

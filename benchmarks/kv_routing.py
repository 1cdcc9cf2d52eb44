"""KV-aware routing against least-loaded on real processes: two decode workers serving
the default model, aggregated and disaggregated, under `diptych bench`'s multi-turn load.

Every configuration runs the same workload (same seed) against a fresh `diptych serve
--decode-workers 2`, one after the other in one run, routers alternating:

    aggregated      --prefill-workers 0   --router least-loaded | kv
    disaggregated   --prefill-workers 2   --router least-loaded --no-prefill-affinity | kv

In disaggregated mode the baseline is the routing before KV awareness on both sides:
least-loaded decode workers and the plain shared prefill queue; KV-aware is the frontend's
router and the prefill affinity (a remote prefill offered first to the prefill worker
holding its prompt).

The workload: multi-turn sessions over a few system prompts, each turn sent when the
previous one ends (its history is the previous prompt plus a client-written reply and a
new user turn), a few sessions at once. With least-loaded routing a later turn lands on
the worker that holds its history about half the time and re-prefills it otherwise.

    python benchmarks/kv_routing.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server, scrape  # noqa: E402

MODES = ("aggregated", "disaggregated")
# "kv-no-pull": the KV router without prefix pulls between decode workers
# (`--no-router-peer-pull`), as it was before them
ROUTERS = ("least-loaded", "kv-no-pull", "kv")


def workload(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "multiturn", "--multiturn-turns", str(args.turns),
        "--multiturn-system-len", str(args.system_len),
        "--multiturn-num-system-prompts", str(args.systems),
        "--multiturn-user-len", str(args.user_len),
        "--multiturn-output-len", str(args.output_len),
        "--multiturn-think-time", str(args.think_time),
        "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
        *(["--request-rate", str(args.session_rate)] if args.session_rate else
          ["--request-rate", "inf", "--max-concurrency", str(args.concurrency)]),
    ]  # fmt: skip


def run(args: argparse.Namespace, mode: str, router: str, out: Path) -> dict[str, Any]:
    kind = "kv" if router.startswith("kv") else router
    flags = ["--decode-workers", "2", "--router", kind, *args.serve_flag]
    if router == "kv-no-pull":
        flags.append("--no-router-peer-pull")
    if mode == "disaggregated":
        flags += ["--prefill-workers", str(args.prefill_workers)]
        if router == "least-loaded":  # the routing before KV awareness: the shared queue
            flags.append("--no-prefill-affinity")
    name = f"{mode}-{router}"
    with diptych_server(mode, *flags) as server:
        cmd = [
            sys.executable, "-m", "diptych.cli", "bench", "--base-url", server.url,
            *workload(args), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--num-warmups", "2", "--save-result", "--result-dir", str(out),
            "--result-filename", f"{name}.json", "--request-timeout", "600",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        m = scrape(server.url)
    doc: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    prompt = m.get("diptych_frontend_prompt_tokens_total", 0.0)
    doc["cached_share"] = m.get("diptych_frontend_cached_prompt_tokens_total", 0.0) / max(prompt, 1)
    doc["mode"], doc["router"] = mode, router
    decisions = "diptych_frontend_router_decisions_total{"
    doc["decisions"] = {k.split('"')[1]: v for k, v in m.items() if k.startswith(decisions)}
    print(f"{mode:14s} {router:13s} TTFT p50 {doc['median_ttft_ms']:7.0f} ms  p99 "
          f"{doc['p99_ttft_ms']:7.0f} ms  TPOT p50 {doc['median_tpot_ms']:5.1f} ms  output "
          f"{doc['output_throughput']:6.1f} tok/s  cached {doc['cached_share']:.0%}  "
          f"failed {doc['failed']} {doc['decisions']}", flush=True)  # fmt: skip
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=6, help="sessions at once")
    p.add_argument(
        "--session-rate", type=float, default=None,
        help="new sessions per second (Poisson) instead of a fixed number at once",
    )  # fmt: skip
    p.add_argument(
        "--think-time", type=float, default=1.0,
        help="seconds between a turn's end and the next (a user reading, a tool running)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serve-flag", action="append", default=[],
        help="one more `diptych serve` flag (repeat; e.g. --serve-flag=--dtype=float32)",
    )  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prefill-workers", type=int, default=2, help="disaggregated mode")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    out = Path(tempfile.mkdtemp(prefix="kv-routing-"))
    rows = [run(args, mode, router, out) for mode in args.modes.split(",") for router in ROUTERS]
    end = machine.snapshot()
    lines = [
        "| mode | router | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s | prompt tokens "
        "cached | pulls | completed | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for mode in args.modes.split(","):
        ll, nopull, kv = (next(r for r in rows if r["mode"] == mode and r["router"] == rt)
                          for rt in ROUTERS)  # fmt: skip
        for r in (ll, nopull, kv):
            lines.append(
                f"| {mode} | {r['router']} | {r['median_ttft_ms']:,.0f} ms | "
                f"{r['p99_ttft_ms']:,.0f} ms | {r['median_tpot_ms']:.1f} ms | "
                f"{r['output_throughput']:.1f} | {r['cached_share']:.0%} | "
                f"{r['decisions'].get('pull', 0):.0f} | {r['completed']} | {r['failed']} |"
            )
        for base in (ll, nopull):
            ratio = kv["median_ttft_ms"] / base["median_ttft_ms"]
            gain = kv["output_throughput"] / base["output_throughput"]
            verdicts.append(f"{mode}: KV-aware TTFT p50 is {ratio:.2f}x {base['router']}'s, "
                            f"output throughput {gain:.2f}x")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    print("\n".join(verdicts))
    if args.write_docs:
        flags = " ".join(args.serve_flag)
        command = " ".join(["python benchmarks/kv_routing.py --write-docs",
                            *(f"--serve-flag={f}" for f in args.serve_flag)])  # fmt: skip
        serve = "the default model" + (f", {flags}" if flags else ", dtype auto")
        pace = (f"{args.session_rate:g} new sessions/s" if args.session_rate
                else f"{args.concurrency} sessions at once")
        body = f"""`{command}`: a fresh `diptych serve --decode-workers 2 --router ROUTER`
({serve}) per row, aggregated (`--prefill-workers 0`) and disaggregated
(`--prefill-workers {args.prefill_workers}`; the least-loaded row also
`--no-prefill-affinity`, the plain shared queue), driven by `diptych bench` with the
same workload each time: {args.num_prompts} requests in multi-turn sessions of
{args.turns} turns over {args.systems} system prompts of {args.system_len} tokens,
{args.user_len}-token user turns, {args.output_len}-token replies (the next turn's history
carries a client-written reply), {args.think_time:g} s between a turn's end and the next,
{pace}, greedy, `--ignore-eos`. "Prompt tokens cached" is the frontend's count of
prompt tokens the workers found in their prefix caches.

{table}

{chr(10).join('- ' + v for v in verdicts)}

{machine.describe(start, end)}"""
        write_subsection("### Real processes: two decode workers, multi-turn sessions", body,
                         section="## KV-aware routing")  # fmt: skip
        print("wrote docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    print(f"{time.monotonic() - t0:.0f} s")
    sys.exit(rc)

"""KV tiers at fleet scale, simulated: 32 decode workers (Llama-3.1-70B at TP 8 on
H200, the simulator's profile) serving agent sessions whose contexts outgrow their
pools, with no tier, with a host tier, and against an oracle whose pools never evict.

Each row is one `diptych simulate` run of the same agentic workload (256 sessions of
8 turns at once: a 2,000-token system prompt of 8, a 200-token task, 200-token model
turns, 800-token tool results after 5 s on average); the pools are cut to
`--num-blocks` so that the live sessions want about 3x what they hold. The host tier
restores a block at the host link's speed (engine/sim/runner.py).

    python -m benchmarks.kv_tiers_sim --docs
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from benchmarks import machine
from benchmarks.docs_section import write_subsection
from benchmarks.servers import ROOT

HEADING = "### KV tiers at fleet scale (simulated)"
WORKLOAD = [
    "--decode-workers", "32", "--prefill-workers", "0", "--dataset-name", "agentic",
    "--num-prompts", "2048", "--multiturn-turns", "8", "--multiturn-system-len", "2000",
    "--multiturn-num-system-prompts", "8", "--multiturn-user-len", "200",
    "--multiturn-output-len", "200", "--agentic-tool-len", "800",
    "--agentic-tool-latency", "5", "--request-rate", "inf", "--max-concurrency", "256",
]  # fmt: skip
NO_PULL = "--no-router-peer-pull"  # the router without prefix pulls between workers
ROWS = (
    ("no tier, no pulls", ["--num-blocks", "1500", NO_PULL]),
    ("no tier", ["--num-blocks", "1500"]),
    ("host tier, 256 GiB a worker, no pulls",
     ["--num-blocks", "1500", "--kv-host-memory", "256", NO_PULL]),
    ("host tier, 256 GiB a worker", ["--num-blocks", "1500", "--kv-host-memory", "256"]),
    ("oracle: pools that never evict", ["--num-blocks", "100000"]),
)
FIELDS = {
    "ttft_p50": r"Median TTFT \(ms\):\s+([\d.]+)",
    "ttft_p99": r"P99 TTFT \(ms\):\s+([\d.]+)",
    "output": r"Output token throughput \(tok/s\):\s+([\d.]+)",
    "hit": r"prefix hit rate ([\d.]+)%",
    "hours": r"([\d.]+) accelerator-hours",
}


def run(flags: list[str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "diptych.cli", "simulate", *WORKLOAD, *flags],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    row = {}
    for key, pattern in FIELDS.items():
        m = re.search(pattern, out)
        if m is None:
            raise RuntimeError(f"no {key} in the simulator's report:\n{out[-2000:]}")
        row[key] = float(m.group(1))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    began = time.monotonic()
    rows = [(name, run(flags)) for name, flags in ROWS]
    end = machine.snapshot()
    lines = [
        "`python -m benchmarks.kv_tiers_sim --docs`: `diptych simulate` of 32 decode workers "
        "(the H200:Llama-3.1-70B:tp8 profile, aggregated, KV-aware routing) on "
        "`--dataset-name agentic`: 256 sessions at once of 8 turns (one of 8 system prompts "
        "of 2,000 tokens, a 200-token task, 200-token model turns, tool results of 800 "
        "tokens on average after 5 s on average), 2,048 requests. `--num-blocks 1500` "
        "(24,000 tokens a worker) against sessions that reach about 9,000 tokens, 8 a "
        "worker: about 3x the pool.",
        "",
        "| pools | prefix hit rate | TTFT p50 | TTFT p99 | output tok/s | accelerator-hours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['hit']:.1f} % | {r['ttft_p50']:.0f} ms | "
                     f"{r['ttft_p99']:,.0f} ms | {r['output']:,.0f} | "
                     f"{r['hours']:.2f} |")  # fmt: skip
    r = dict(rows)
    none, tier = r["no tier, no pulls"], r["host tier, 256 GiB a worker, no pulls"]
    pulls, oracle = r["host tier, 256 GiB a worker"], r["oracle: pools that never evict"]
    lines += [
        "",
        "The sessions run closed-loop (each turn waits for its tool), so the run's length "
        "and the accelerator-hours are the tools' to set: what the tier changes is the "
        "prefill each turn does, seen in the hit rate and the TTFT. Without prefix pulls "
        f"the host tier lifts the hit rate from {none['hit']:.1f} % to {tier['hit']:.1f} % "
        f"(the oracle, pulls on: {oracle['hit']:.1f} %) and the TTFT p50 from "
        f"{none['ttft_p50']:.0f} to {tier['ttft_p50']:.0f} ms, with a TTFT p99 of "
        f"{tier['ttft_p99']:,.0f} ms against {none['ttft_p99']:,.0f} ms. Pulls (the "
        "default; each pulled block's copy charged to the puller's next step at 50 GB/s, "
        "the round trip's latency not simulated) let a busy holder's sessions move: with "
        f"the host tier they cut the TTFT p99 to {pulls['ttft_p99']:,.0f} ms and cost hit "
        f"rate ({pulls['hit']:.1f} %) and TTFT p50 ({pulls['ttft_p50']:.0f} ms): a pulled "
        "history lives on two workers, and a holder restores what it keeps in its tier "
        "before it writes. Simulated in "
        f"{time.monotonic() - began:.0f} s of wall time.",
        "",
        machine.describe(start, end),
    ]  # fmt: skip
    body = "\n".join(lines)
    print(body)
    if args.docs:
        write_subsection(HEADING, body, section="## Fleet simulation")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a KV handoff costs when prefill and decode split their pools over different
tensor-parallel sizes: the write of one prompt's KV between two agents in one
process (shm and tcp backends), for equal splits and for 1 -> 3 and 3 -> 1 (SmolLM2's
3 KV heads), side by side with a baseline tree.

The pools are SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, bf16, blocks of
16 tokens); the prompt is `--tokens` long. Each source rank posts its write
(`transfer.rank_writes`), and the time runs from building the
descriptor lists to the last write done (the receiver has the bytes); the best of
`--repeat`.

    python -m benchmarks.tp_handoff                        # this tree
    python -m benchmarks.tp_handoff --baseline ../old      # and a checkout beside it
    python -m benchmarks.tp_handoff --baseline ../old --docs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.docs_section import publish
from benchmarks.machine import commit, cpu_isa, cpu_name

PAIRS = [(1, 1), (1, 3), (3, 1), (3, 3)]

# run in a child process with the tree under test first on sys.path
_MEASURE = """
import dataclasses, json, sys, time
from protocol.kv_layout import KvLayout
from transfer import Agent
from prefill_worker.worker import rank_writes

tokens, repeat, pairs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
base = KvLayout(num_blocks=tokens // 16 + 8, num_layers=30, block_size=16, num_kv_heads=3,
                head_dim=64, dtype="bfloat16", model="SmolLM2-135M-Instruct")

def split(tp):
    if tp == 1:
        return base
    return dataclasses.replace(base, num_kv_heads=3 // tp, tp_size=tp, model_kv_heads=3)

out = []
for backend in ("shm", "tcp"):
    for stp, dtp in pairs:
        src, dst = split(stp), split(dtp)
        with Agent("p", backend=backend) as a, Agent("d", backend=backend) as b:
            sr = [a.allocate(src.total_bytes) for _ in range(stp)]
            dr = [b.allocate(dst.total_bytes) for _ in range(dtp)]
            a.add_remote(b.metadata())
            b.add_remote(a.metadata())
            blocks = list(range(-(-tokens // 16)))
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                ws = rank_writes(src, [r.id for r in sr], blocks, dst, [r.id for r in dr], blocks)
                for h in [a.write(w.src, "d", w.dst) for w in ws]:
                    h.result(120)
                best = min(best, time.perf_counter() - t0)
            out.append({"backend": backend, "prefill_tp": stp, "decode_tp": dtp,
                        "ms": round(best * 1e3, 1), "ranges": sum(len(w.src) for w in ws),
                        "mb": round(sum(w.nbytes for w in ws) / 1e6, 1)})
print(json.dumps(out))
"""


def measure(tree: Path, tokens: int, repeat: int) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tokens), str(repeat), json.dumps(PAIRS)],
        capture_output=True, text=True, env=env, cwd=tree, timeout=900, check=True,
    )  # fmt: skip
    rows: list[dict[str, Any]] = json.loads(run.stdout.strip().splitlines()[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout to compare with")
    ap.add_argument("--out", type=Path, default=Path("tp_handoff.json"))
    ap.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    doc: dict[str, Any] = {
        "cpu": cpu_name(), "isa": cpu_isa(), "tokens": args.tokens, "commit": commit(),
        "rows": measure(here, args.tokens, args.repeat),
    }  # fmt: skip
    if args.baseline is not None:
        rows = measure(args.baseline.resolve(), args.tokens, args.repeat)
        doc["baseline"] = {"commit": commit(args.baseline), "rows": rows}
    publish(doc, args.out, _table(doc), "### Tensor parallelism: a KV handoff between different "
            "splits", "## Engine", args.docs)  # fmt: skip


def _table(doc: dict[str, Any]) -> str:
    base = {(r["backend"], r["prefill_tp"], r["decode_tp"]): r
            for r in doc.get("baseline", {}).get("rows", [])}  # fmt: skip
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {doc['cpu']} ({doc['isa']}), commit "
        f"{doc['commit']}: the KV of one {doc['tokens']}-token prompt in SmolLM2-135M's "
        "geometry (30 layers, 3 KV heads of 64, bf16, 16-token blocks) written between two "
        "agents of one process, from building the descriptor lists to the last write done; "
        "best of 5. Prefill TP p -> decode TP d: each prefill rank writes the heads it holds "
        "into the decode ranks holding them (`rank_writes`); 1 -> 3 and 3 -> 1 cut every "
        "(block, layer, K/V, slot) row, 960 ranges a block for each head.",
        "",
        "| backend | prefill TP -> decode TP | ranges | MB | this tree |"
        + (f" baseline ({doc['baseline']['commit']}) |" if base else ""),
        "|---|---|---:|---:|---:|" + ("---:|" if base else ""),
    ]
    for r in doc["rows"]:
        key = (r["backend"], r["prefill_tp"], r["decode_tp"])
        cell = f" {base[key]['ms']:.1f} ms |" if key in base else (" - |" if base else "")
        lines.append(f"| {r['backend']} | {r['prefill_tp']} -> {r['decode_tp']} | {r['ranges']} "
                     f"| {r['mb']} | {r['ms']:.1f} ms |{cell}")  # fmt: skip
    lines += [
        "",
        "Reproduce: `python -m benchmarks.tp_handoff --baseline CHECKOUT --docs` (JSON in "
        "tp_handoff.json). A split handoff still costs several times an unsplit one: its "
        "ranges are 128 bytes each, and the descriptor lists, the plan and the receiver's "
        "grant check scale with their number; the copies themselves go by strided runs "
        "(transfer/memory.py `copy_ranges`). Pools laid out head-major within a block "
        "would make each head's slice one range a (block, layer, K/V); that is not done.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

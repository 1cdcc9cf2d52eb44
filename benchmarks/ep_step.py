"""Expert parallelism on this machine: a mixture of experts' decode step at TP 1, at TP 2
with every expert's width split (one all-reduce a sparse layer), and at TP 2 with the
experts spread whole over the two ranks (--expert-parallel-size 2: tokens sent to their
experts' rank and back by all-to-all, then the shares all-gathered); rank 0's bytes a
step, those of the all-to-alls apart, and whether the greedy tokens agree.

A synthetic Qwen3-MoE of random weights (hidden 1024, 16 heads over 8 KV heads,
8 layers, 32 experts of 512 a layer, top 4 renormalized, a 32000-token vocabulary:
about 470M parameters, 120M active a token) in fp32, so nothing is downloaded; a decode
batch of `--batch` sequences after a 128-token prompt each; TP 2 with cores / 2
threads a rank.

    python -m benchmarks.ep_step                 # prints a table, writes JSON
    python -m benchmarks.ep_step --docs          # and the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.docs_section import publish
from benchmarks.machine import commit, cpu_isa, cpu_name, load
from benchmarks.tp_step import DECODE, PROMPT, measure

SHAPE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True,
)  # fmt: skip
HEADING = "### Expert parallelism: all-to-all against a split of every expert"
SPLITS = (("TP 1", 1, 1), ("TP 2, experts' width split", 2, 1), ("TP 2, EP 2 (all-to-all)", 2, 2))


def checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SHAPE))
    model.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", type=Path, default=Path("ep_step.json"))
    ap.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint(Path(d) / "qwen3-moe")
        for batch in args.batch:
            runs = [
                (label, measure(path, tp, args.cores, batch, SHAPE["vocab_size"],
                                expert_parallel_size=ep))
                for label, tp, ep in SPLITS
            ]  # fmt: skip
            reference = runs[0][1]["tokens"]
            for label, r in runs:
                same = sum(a == b for a, b in zip(r.pop("tokens"), reference, strict=True))
                rows.append({"batch": batch, "split": label, "same_tokens": same, **r})
                print(rows[-1], flush=True)
    doc = {"cpu": cpu_name(), "isa": cpu_isa(), "cores": args.cores, "model": SHAPE,
           "commit": commit(), "load": load(), "rows": rows}  # fmt: skip
    publish(doc, args.out, _table(doc), HEADING, "## Engine", args.docs)


def _table(doc: dict[str, Any]) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {doc['cpu']} ({doc['isa']}), "
        f"{doc['cores']} cores in all, commit {doc['commit']}: a synthetic Qwen3-MoE (hidden "
        "1024, 16 heads / 8 KV heads, 8 layers of 32 experts of 512, top 4, vocabulary 32000) "
        f"in fp32; decode batches after {PROMPT}-token prompts, median of {DECODE - 1} decode "
        "steps; TP 2 runs two rank processes with half the threads each, collectives through "
        "shared memory. Bytes: what rank 0 put into a decode step's collectives (mean), and "
        "of them what its all-to-alls sent the other rank.",
        "",
        "| batch | split | decode step | collectives a step | bytes a step | of them "
        "all-to-all | greedy sequences equal to TP 1's |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['batch']} | {r['split']} | {r['decode_step_ms']:.1f} ms | "
            f"{r.get('collectives_per_step', '-')} | "
            f"{r.get('collective_bytes_per_step', 0):,} | {r.get('all_to_all_bytes_per_step', 0):,}"
            f" | {r['same_tokens']} / {r['batch']} |"
        )
    lines += [
        "",
        "Reproduce: `python -m benchmarks.ep_step --docs` (JSON in ep_step.json). With the "
        "experts whole a rank streams half of the layer's experts, each at full width, where "
        "the width split streams half of every expert; on two CPU ranks of one host the two "
        "cost about the same weight bytes, and the all-to-all adds two more rounds a sparse "
        "layer (counts travel with the data through shared memory). What EP is for is many "
        "devices, where the all-reduce of a width split grows with the ranks and an expert "
        "spread whole needs no cut of its GEMM; the collective bytes above are what would "
        "cross a link.",
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()

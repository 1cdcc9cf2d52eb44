#!/usr/bin/env python
"""Speculative decoding: batch-1 TPOT with and without drafts.

    python benchmarks/speculative.py [--rounds 3] [--tokens 128] [--json F] [--write-docs]
        [--draft-model default|PATH [--draft-quantization gguf]]

Drafts come from prompt lookup, or with --draft-model from that model (`default`: the
default GGUF, whose Q4_1 blocks with --draft-quantization gguf make a draft smaller
and faster than the fp32 or bf16 model it drafts for).

One process, one machine, in one run: the default model (`EngineCore` stepped
directly, load excluded), greedy, --tokens tokens after each prompt, for each dtype
(float32, and bfloat16 where the CPU has a fast bf16 path) and each workload:

- repetitive: a code edit (a source file to repeat with one rename) and a
  summarise-and-quote request (a passage to summarise, quoting its sentences);
- not repetitive: a short story and an open question, whose answers share little
  with their prompts.

Each is decoded with `num_speculative_tokens` 0 (the baseline) and K (default 3),
interleaved round by round; TPOT is the time from the first token to the last over
the tokens between (up to --tokens; a reply may end sooner at EOS: the model's own
answer, not a continuation past it), median of the rounds. The table reports the speed-up, whether
the greedy tokens were identical to the baseline's, and the drafts' acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.request import NewRequest  # noqa: E402
from engine.weights import default_model_path  # noqa: E402
from kernels import cpu_ops  # noqa: E402

PASSAGE = (
    "The harbour master opened the ledger at dawn. Three trawlers had left before "
    "first light, and the ferry from the island was late again because of the fog. "
    "A crate of oranges had been left on the quay overnight, and the gulls had found "
    "it. By eight the fish market was busy, and the café by the lighthouse had run "
    "out of bread. The council meeting about the new breakwater was moved to Friday."
)
WORKLOADS = {
    "code edit": (
        "Rewrite this code, renaming `tokens` to `context`, and keep everything else "
        "identical:\n\n" + (ROOT / "engine" / "spec" / "ngram.py").read_text()[:1500],
        True,
    ),
    "summarise and quote": (
        "Summarise this passage in three bullet points, quoting the sentence each "
        "point comes from:\n\n" + PASSAGE,
        True,
    ),
    "story": ("Write a short story about a lighthouse keeper and a lost cat.", False),
    "open question": ("Why do some birds migrate while others stay all winter?", False),
}


def tpot_ms(llm: LLM, ids: list[int], k: int, tokens: int) -> tuple[float, list[int]]:
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, num_speculative_tokens=k)
    core.submit(NewRequest(f"b{time.monotonic_ns()}", ids, params))
    out: list[int] = []
    stamps: list[tuple[float, int]] = []
    while core.has_unfinished_requests():
        for o in core.step():
            out += o.new_token_ids
            stamps.append((time.perf_counter(), len(out)))
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return (t1 - t0) / (n1 - n0) * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--draft-model", default=None, help="`default` or a model path")
    ap.add_argument("--draft-quantization", default=None, choices=["gguf", "int8", "int4"])
    args = ap.parse_args()
    draft: dict[str, Any] = {}
    if args.draft_model:
        path = default_model_path() if args.draft_model == "default" else args.draft_model
        draft = {"speculative_model": str(path),
                 "speculative_quantization": args.draft_quantization}  # fmt: skip
    start = machine.snapshot()
    dtypes = ["float32"] + (["bfloat16"] if cpu_ops.auto_dtype() == torch.bfloat16 else [])
    rows = []
    for dtype in dtypes:
        llm = LLM(dtype=dtype, **draft)
        spec = llm.engine.scheduler.speculator
        assert spec is not None
        for name, (prompt, repetitive) in WORKLOADS.items():
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            tpot_ms(llm, ids, args.k, 8)  # warm both paths
            times: dict[int, list[float]] = {0: [], args.k: []}
            outs: dict[int, list[int]] = {}
            before = (spec.steps, spec.drafted, spec.accepted)
            for _ in range(args.rounds):
                for k in times:
                    ms, out = tpot_ms(llm, ids, k, args.tokens)
                    times[k].append(ms)
                    outs.setdefault(k, out)
            now = (spec.steps, spec.drafted, spec.accepted)
            steps, drafted, accepted = (a - b for a, b in zip(now, before, strict=True))
            base, fast = statistics.median(times[0]), statistics.median(times[args.k])
            row = {
                "dtype": dtype, "workload": name, "repetitive": repetitive,
                "prompt_tokens": len(ids), "tpot_ms": base, "spec_tpot_ms": fast,
                "speedup": base / fast, "identical": outs[0] == outs[args.k],
                "acceptance": accepted / drafted if drafted else 0.0,
                "accepted_per_step": accepted / steps if steps else 0.0,
                "output_tokens": len(outs[0]),
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    report = {"machine": machine.describe(start, machine.snapshot()), "k": args.k,
              "tokens": args.tokens, "rows": rows}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.write_docs:
        heading = "### Draft model: batch-1 TPOT" if draft else "### Prompt lookup: batch-1 TPOT"
        write_subsection(heading, docs_body(report, args), section="## Speculative decoding")


def docs_body(report: dict[str, Any], args: argparse.Namespace) -> str:
    k = report["k"]
    lines = [
        report["machine"],
        "",
        f"| dtype | workload | output tokens | TPOT ms, no drafts | TPOT ms, k={k} | speed-up | "
        "greedy tokens identical | drafts accepted | accepted a verify step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['workload']} | {r['output_tokens']} | {r['tpot_ms']:.1f} | "
            f"{r['spec_tpot_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {'yes' if r['identical'] else 'no'} | "
            f"{r['acceptance'] * 100:.0f} % | {r['accepted_per_step']:.2f} |"
        )
    flags = f" --draft-model {args.draft_model}" if args.draft_model else ""
    flags += f" --draft-quantization {args.draft_quantization}" if args.draft_quantization else ""
    lines += [
        "",
        f"Reproduce: `python benchmarks/speculative.py -k {k}{flags} --write-docs`. Batch 1, "
        "greedy, "
        f"up to {report['tokens']} tokens, median of the rounds; the baseline and the "
        "drafting run alternate within each round.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

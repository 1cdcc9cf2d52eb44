"""Multi-LoRA decode throughput: a batch of 32 requests for 8 different adapters in
one batch, against 32 requests for the base model, and against the same 32 requests
served one adapter at a time (8 batches of 4, what an engine without mixed-adapter
batches does), on SmolLM2-135M with adapters `peft` makes here.

    python -m benchmarks.lora_batch                 # the table
    python -m benchmarks.lora_batch --docs          # and the docs/benchmarks.md section

Diptych's `EngineCore` is driven step by step (model load excluded); decode throughput
counts the tokens of steps that only decode (every row one token) over their time, so
the prompts' prefill is outside it. Each row runs `--repeats` times, the rows taking
turns, and reports the median. Prompts are distinct random token ids (no prefix hits),
greedy, EOS ignored. transformers + peft run the same base and mixed batches through
`generate` (`adapter_names`, peft's mixed-batch inference) on the same weights: its
rows are whole-run throughput, reported as the mixed batch's share of its own base
batch.

The adapters: `--adapters mix` the tests' eight (ranks 8 and 16, from q/v only to all
seven linears), `uniform` eight of rank 16 on all seven linears (the most work).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.docs_section import write_subsection
from benchmarks.lora_adapters import SPECS, UNIFORM, make_adapters, reference_model
from benchmarks.machine import commit, cpu_isa, cpu_name
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import NewRequest
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams

HEADINGS = {
    "mix": "### Multi-LoRA: a batch of eight adapters against the base model",
    "uniform": "### Multi-LoRA: eight rank-16 adapters on every linear against the base model",
}


def _requests(
    n: int, prompt_len: int, new: int, adapters: list[AdapterRef | None], seed: int, tag: str
) -> list[NewRequest]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [
        NewRequest(f"{tag}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params,
                   lora=adapters[i % len(adapters)])
        for i in range(n)
    ]  # fmt: skip


def run_batches(core: EngineCore, batches: list[list[NewRequest]]) -> tuple[float, float]:
    """(decode tokens per second, whole seconds) over `batches` run one after another."""
    tokens, decode_s = 0, 0.0
    began = time.perf_counter()
    for batch in batches:
        for r in batch:
            core.submit(r)
        while core.has_unfinished_requests():
            t = time.perf_counter()
            outs = core.step()
            dt = time.perf_counter() - t
            if outs and core.last_step_tokens == len(outs):  # every row a decode
                tokens += len(outs)
                decode_s += dt
    return tokens / decode_s, time.perf_counter() - began


def measure(args: argparse.Namespace, adapters: list[AdapterRef]) -> dict[str, dict[str, float]]:
    core = EngineCore(EngineConfig(
        dtype=args.dtype, enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
        num_blocks=args.batch * ((args.prompt_len + args.new) // 16 + 2) + 16,
        max_num_seqs=args.batch,
    ))  # fmt: skip
    per = args.batch // len(adapters)
    rows: dict[str, Callable[[int], list[list[NewRequest]]]] = {
        "base": lambda s: [_requests(args.batch, args.prompt_len, args.new, [None], s, "b")],
        "mixed": lambda s: [
            _requests(args.batch, args.prompt_len, args.new, list(adapters), s, "m")
        ],
        "separate": lambda s: [
            _requests(per, args.prompt_len, args.new, [a], s * 100 + k, f"s{k}")
            for k, a in enumerate(adapters)
        ],
    }
    run_batches(core, rows["mixed"](999))  # warm-up: kernels, every adapter in its slot
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    for rep in range(args.repeats):
        for name, make in rows.items():
            got[name].append(run_batches(core, make(rep)))
    assert core.is_idle()
    out = {}
    for name, runs in got.items():
        out[name] = {"decode_tok_s": statistics.median(r[0] for r in runs),
                     "seconds": statistics.median(r[1] for r in runs)}  # fmt: skip
    out["_engine"] = {
        "dtype": str(core.runner.dtype).removeprefix("torch."),
        "threads": float(core.runner.threads),
    }  # type: ignore[dict-item]
    return out


def measure_peft(args: argparse.Namespace, hf: Any, paths: dict[str, Path]) -> dict[str, float]:
    """transformers + peft: tokens per second of `generate` on the base batch and on the
    mixed batch (`adapter_names`), both of `--batch` prompts."""
    from peft import PeftModel

    names = list(paths)
    model = PeftModel.from_pretrained(hf, str(paths[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(paths[name]), adapter_name=name)
    model.eval()
    rng = random.Random(5)
    ids = torch.tensor([[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                        for _ in range(args.batch)])  # fmt: skip
    per_row = [names[i % len(names)] for i in range(args.batch)]
    kw = {"max_new_tokens": args.peft_new, "min_new_tokens": args.peft_new, "do_sample": False}
    out: dict[str, list[float]] = {"base": [], "mixed": []}
    with torch.inference_mode():
        model.generate(input_ids=ids[:2], adapter_names=per_row[:2], **kw)  # warm-up
        for _ in range(args.repeats):
            for row, adapters in (("base", ["__base__"] * args.batch), ("mixed", per_row)):
                t = time.perf_counter()
                model.generate(input_ids=ids, adapter_names=adapters, **kw)
                out[row].append(args.batch * args.peft_new / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64, help="tokens each request generates")
    p.add_argument("--peft-new", type=int, default=16, help="... under transformers + peft")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--adapters", choices=("mix", "uniform"), default="mix")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = p.parse_args(argv)
    hf = reference_model()  # the model's weights as the engine reads them, in transformers
    specs = SPECS if args.adapters == "mix" else UNIFORM
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(hf, Path(tmp), specs)
        refs = [AdapterRef(n, str(p)) for n, p in paths.items()]
        results = measure(args, refs)
        peft = None if args.skip_peft else measure_peft(args, hf, paths)
    table = report(args, results, peft)
    print(table)
    if args.docs:
        write_subsection(HEADINGS[args.adapters], table, section="## Engine")
    return 0


def report(
    args: argparse.Namespace, r: dict[str, dict[str, float]], peft: dict[str, float] | None
) -> str:
    base = r["base"]["decode_tok_s"]
    eng = r["_engine"]
    what = ("the tests' eight (ranks 8 and 16, q/v only up to all seven linears)"
            if args.adapters == "mix" else "eight of rank 16 on all seven linears")  # fmt: skip
    lines = [
        f"Command: `python -m benchmarks.lora_batch --adapters {args.adapters}"
        f"{' --docs' if args.docs else ''}`. {cpu_name()} ({cpu_isa()}), {eng['threads']:.0f} "
        f"threads, SmolLM2-135M in {eng['dtype']}, commit {commit()}, "
        f"{time.strftime('%Y-%m-%d')}. {args.batch} requests of {args.prompt_len} random "
        f"prompt tokens, {args.new} greedy tokens each; adapters: {what}, made by peft, in "
        f"{len(SPECS)} device slots (`--max-loras 8`, rank 16). Decode throughput: tokens "
        "of decode-only steps over their time; median of "
        f"{args.repeats} runs, the rows taking turns.",
        "",
        "| batch | decode tok/s | share of the base batch | whole run |",
        "|---|---:|---:|---:|",
    ]
    labels = {
        "base": f"{args.batch} requests, base model",
        "mixed": f"{args.batch} requests, 8 adapters mixed in one batch",
        "separate": f"the same, one adapter at a time (8 batches of {args.batch // 8})",
    }
    for key, label in labels.items():
        row = r[key]
        share = row["decode_tok_s"] / base
        lines.append(
            f"| {label} | {row['decode_tok_s']:.0f} | {share:.0%} | {row['seconds']:.1f} s |"
        )
    if peft is not None:
        lines += [
            "",
            f"transformers {__import__('transformers').__version__} + peft "
            f"{__import__('peft').__version__} (fp32, `generate`, {args.peft_new} new tokens, "
            "whole-run tokens per second): base batch "
            f"{peft['base']:.0f} tok/s, mixed batch (`adapter_names`) {peft['mixed']:.0f} "
            f"tok/s, {peft['mixed'] / peft['base']:.0%} of its base.",
        ]
    mixed = r["mixed"]["decode_tok_s"]
    lines += [
        "",
        f"The mixed batch decodes at {mixed / base:.0%} of the base batch's rate "
        f"(target: at least 80 %, after S-LoRA's mixed-batch result, arXiv 2311.03285) and "
        f"{mixed / r['separate']['decode_tok_s']:.1f}x the adapters served one at a time.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""FP8 weights (`--quantization fp8`) against bf16: accuracy, weight memory, decode speed.

    python benchmarks/fp8_weights.py [--rounds 3] [--tokens 128] [--json out.json]
        [--write-docs]

One process, one machine, one run, on the default SmolLM2-135M: the bf16 engine (the
baseline, with its packed copy for batched decode: our fastest bf16 path), the same
model with its linears in FP8 e4m3 (quantized at load, one scale per output channel;
the embedding and tied head stay bf16, as FP8 checkpoints publish them), and int8 for
reference. Accuracy is `benchmarks/quantized.py`'s (the next token after 64 cut points
of a fixed text: top-1 agreement and mean KL; greedy tokens before the first
divergence) against the bf16 model and against fp32. Memory: the linear weights'
bytes (FP8 codes and scales, bf16 without the packed copy), and every weight byte
the engine holds. Decode: batch-1 tok/s, rounds interleaved, median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.quantized import GREEDY_PROMPTS, accuracy, decode_rate  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.model_runner import ModelRunner, weight_bytes  # noqa: E402
from engine.models.llama import Linear  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.weights import default_model_path, resolve_model  # noqa: E402

VARIANTS = [  # (name, dtype, quantization)
    ("bf16 (baseline)", "bfloat16", None),
    ("fp8 e4m3 (--quantization fp8)", "bfloat16", "fp8"),
    ("int8 (--quantization int8)", "bfloat16", "int8"),
]


def linear_bytes(core: EngineCore) -> int:
    """Bytes of the linear layers' weights as held (a packed copy not counted)."""
    runner = core.runner
    assert isinstance(runner, ModelRunner)
    total = 0
    for m in runner.model.modules():
        if isinstance(m, Linear):
            total += sum(q.nbytes for q in m.quant) or m.weight.numel() * m.weight.element_size()
    return total


def _core(dtype: str, quantization: str | None) -> EngineCore:
    cfg = EngineConfig(model=str(default_model_path()), dtype=dtype, quantization=quantization,
                       enable_prefix_caching=False)  # fmt: skip
    return EngineCore(cfg, eos_token_ids=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    start = machine.snapshot()
    tok = Tokenizer.from_source(resolve_model(None))
    cores = {name: _core(dtype, q) for name, dtype, q in VARIANTS}
    rates: dict[str, list[float]] = {name: [] for name in cores}
    for r in range(args.rounds):
        prompt = tok.encode(f"Round {r}: " + GREEDY_PROMPTS[r % len(GREEDY_PROMPTS)])
        for name, core in cores.items():
            decode_rate(core, prompt, 8)  # warm
            rates[name].append(decode_rate(core, prompt, args.tokens))
            print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    fp32 = _core("float32", None)
    base_name = VARIANTS[0][0]
    fp32_cache: dict[str, Any] = {}
    bf16_cache: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    base_linear = linear_bytes(cores[base_name])
    base_rate = statistics.median(rates[base_name])
    for name, core in cores.items():
        runner = core.runner
        assert isinstance(runner, ModelRunner)
        vs_fp32 = accuracy(core, fp32, tok, fp32_cache)
        vs_bf16 = accuracy(core, cores[base_name], tok, bf16_cache)
        rows.append({
            "variant": name, "tok_s": statistics.median(rates[name]), "rounds": rates[name],
            "linear_mb": linear_bytes(core) / 1e6,
            "linear_vs_bf16": linear_bytes(core) / base_linear,
            "weight_mb": weight_bytes(runner.model) / 1e6,
            "vs_bf16": {k: vs_bf16[k] for k in ("top1", "kl", "greedy_agree")},
            "vs_fp32": {k: vs_fp32[k] for k in ("top1", "kl", "ppl")},
        })  # fmt: skip
        rows[-1]["speed_vs_bf16"] = rows[-1]["tok_s"] / base_rate
        print(json.dumps(rows[-1]), flush=True)
    report = {"machine": machine.describe(start, machine.snapshot()), "rows": rows,
              "tokens": args.tokens, "rounds": args.rounds}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.write_docs:
        write_subsection("### FP8 weights", docs_body(report), section="## Quantization")


def docs_body(report: dict[str, Any]) -> str:
    lines = [
        report["machine"],
        "",
        "| weights | linear weights MB | vs bf16 | all weights held MB | next-token top-1 vs "
        "bf16 | KL vs bf16 | greedy agreement vs bf16 | top-1 vs fp32 | KL vs fp32 | "
        "perplexity | decode tok/s (batch 1) | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        b, f = r["vs_bf16"], r["vs_fp32"]
        lines.append(
            f"| {r['variant']} | {r['linear_mb']:.1f} | {r['linear_vs_bf16']:.3f}x | "
            f"{r['weight_mb']:.0f} | {b['top1'] * 100:.0f} % | {b['kl']:.4f} | "
            f"{b['greedy_agree'] * 100:.0f} % | {f['top1'] * 100:.0f} % | {f['kl']:.4f} | "
            f"{f['ppl']:.2f} | {r['tok_s']:.1f} | {r['speed_vs_bf16']:.2f}x |"
        )
    lines += [
        "",
        "Reproduce: `python benchmarks/fp8_weights.py --write-docs`. SmolLM2-135M (the "
        "default GGUF, dequantized at load and re-quantized per row by `--quantization "
        "fp8`: one e4m3 byte a weight and one fp32 scale a row; the embedding and tied head "
        "stay bf16, as published FP8 checkpoints keep them). Linear weights: bytes of the "
        "linear layers as held, bf16 without its packed copy; all weights held: every byte "
        "the engine holds (bf16's packed copy for batched decode included). Accuracy as in "
        "the table above, against the bf16 engine and against fp32. Decode: "
        f"{report['tokens']} greedy tokens after a short prompt, batch 1, median of "
        f"{report['rounds']} interleaved rounds.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

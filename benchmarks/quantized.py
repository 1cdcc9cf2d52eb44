#!/usr/bin/env python
"""Quantized weights: batch-1 decode speed, memory and accuracy, beside bf16 and llama.cpp.

    python benchmarks/quantized.py --llama-server PATH [--gguf Q4_0=FILE ...]
        [--rounds 3] [--tokens 128] [--json out.json] [--write-docs]

One process, one machine, in one run:

- Diptych's engine at batch 1 (`EngineCore` stepped directly, model load excluded):
  the default SmolLM2-135M GGUF (Q4_1 blocks, Q8_0 embedding) dense in bf16 (the
  baseline: `--dtype auto` here), the same file with `--quantization gguf`, `int8` and
  `int4`, and each `--gguf` file (Q4_0, Q8_0, ... made with llama-quantize) with
  `--quantization gguf`, and the default file once more with the decode layer stack
  off (the per-op Python layer loop, `DIPTYCH_DECODE_STACK=0`'s path; see
  engine/models/llama.py). Decode tok/s = tokens after the first / the time from the first
  token to the last; greedy, EOS ignored, --tokens tokens from a 32-token prompt, a
  fresh prompt per round;
- llama.cpp's native `llama-server` on each of the same GGUF files, all CPU threads, one
  slot: its own per-request decode rate (`timings.predicted_per_second`), same prompt,
  same token count;
- rounds interleave every engine and server, so a noisy neighbour hurts all alike; the
  median round is reported;
- memory: every byte of weights the engine holds (`engine.model_runner.weight_bytes`;
  bf16 includes its packed copy), the GGUF file size for llama.cpp (it maps the file);
- accuracy against the dense fp32 model of the same file: the next token after each of
  64 cut points of a fixed text (prefill logits): top-1 agreement, mean KL divergence,
  and perplexity of the text's true next tokens at those points; and greedy agreement
  (tokens before the first divergence, 4 prompts x 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import ServerProcess, native_llama_server  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.engine_core import EngineCore, NewRequest  # noqa: E402
from engine.model_runner import ModelRunner, weight_bytes  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.weights import default_model_path, resolve_model  # noqa: E402

TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "Heat from the sun evaporates water from the surface of seas and lakes, and plants "
    "release water vapour through their leaves. As the warm, moist air rises it cools, "
    "and the vapour condenses into tiny droplets that form clouds. When the droplets "
    "grow heavy enough they fall as rain or snow. Some of that water soaks into the "
    "ground and fills underground stores called aquifers; the rest runs off into "
    "streams and rivers that carry it back to the sea. Over thousands of years a single "
    "molecule of water may travel through every part of this cycle many times. "
    "Scientists measure rainfall, river flow and soil moisture to understand how the "
    "cycle changes from season to season, and farmers, engineers and city planners use "
    "those measurements to decide when to plant crops, how large to build reservoirs and "
    "where it is safe to build new homes."
)
GREEDY_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "What is the difference between weather and climate?",
]


@dataclass
class Variant:
    name: str
    model: str
    quantization: str | None
    dtype: str
    stack: bool = True  # False: the per-op layer loop (no engine/models/decode_stack)
    engine: EngineCore | None = None
    rates: list[float] = field(default_factory=list)
    weight_mb: float = 0.0
    accuracy: dict[str, float] = field(default_factory=dict)


def _core(model: str, dtype: str, quantization: str | None) -> EngineCore:
    cfg = EngineConfig(
        model=model, dtype=dtype, quantization=quantization, enable_prefix_caching=False
    )
    return EngineCore(cfg, eos_token_ids=())


def decode_rate(core: EngineCore, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode tok/s: tokens after the first over the time they took."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    core.submit(NewRequest("bench", prompt, params))
    first = last = None
    n = 0
    while core.has_unfinished_requests():
        for o in core.step():
            n += len(o.new_token_ids)
            now = time.perf_counter()
            if first is None:
                first = now
                n_first = n
            last = now
    assert first is not None and last is not None
    return (n - n_first) / (last - first)


def llama_rate(server: ServerProcess, prompt: str, tokens: int) -> float:
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False}  # fmt: skip
    r = httpx.post(server.url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    timings = r.json()["timings"]
    return float(timings["predicted_per_second"])


def llama_bench_rate(binary: Path, gguf: str, tokens: int) -> float:
    """llama.cpp's own decode benchmark (tg`tokens`, all threads) on the file: its best
    case, with no server around it."""
    out = subprocess.run(
        [str(binary), "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(os.cpu_count() or 1),
         "-r", "1", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(json.loads(out.stdout)[0]["avg_ts"])


def _next_token_rows(core: EngineCore, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_logits=True)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(f"acc{i}", p, params))
    rows: dict[str, torch.Tensor] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.new_logits:
                rows[o.request_id] = o.new_logits[0]
    return torch.stack([rows[f"acc{i}"] for i in range(len(prompts))]).double()


def _greedy(core: EngineCore, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(f"g{i}", p, params))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"g{i}"] for i in range(len(prompts))]


def accuracy(
    core: EngineCore, ref: EngineCore, tok: Tokenizer, ref_cache: dict[str, Any]
) -> dict[str, float]:
    ids = tok.encode(TEXT)
    cuts = [16 + (len(ids) - 17) * i // 63 for i in range(64)]
    prompts = [ids[:c] for c in cuts]
    truth = torch.tensor([ids[c] for c in cuts])
    if "rows" not in ref_cache:
        ref_cache["rows"] = _next_token_rows(ref, prompts)
        ref_cache["greedy_prompts"] = [tok.encode(p) for p in GREEDY_PROMPTS]
        ref_cache["greedy"] = _greedy(ref, ref_cache["greedy_prompts"], 32)
    ref_rows = ref_cache["rows"]
    rows = _next_token_rows(core, prompts)
    logp, ref_logp = rows.log_softmax(-1), ref_rows.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    nll = -logp.gather(1, truth[:, None]).mean()
    greedy = _greedy(core, ref_cache["greedy_prompts"], 32)
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(greedy, ref_cache["greedy"])
    ]
    return {
        "top1": float((rows.argmax(-1) == ref_rows.argmax(-1)).double().mean()),
        "kl": float(kl),
        "ppl": math.exp(float(nll)),
        "greedy_agree": sum(agree) / (32 * len(agree)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server")
    ap.add_argument("--llama-bench", type=Path, default=None, help="llama.cpp's llama-bench")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=FILE, more GGUF files")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    start = machine.snapshot()
    default = str(default_model_path())
    files = {"Q4_1": default, **dict(g.split("=", 1) for g in args.gguf)}
    variants = [Variant("bf16 (dense, baseline)", default, None, "bfloat16")]
    variants += [Variant(f"{name} (--quantization gguf)", path, "gguf", "auto")
                 for name, path in files.items()]  # fmt: skip
    variants += [Variant("Q4_1 (--quantization gguf, per-op layer loop)", default, "gguf", "auto",
                         stack=False)]  # fmt: skip
    variants += [Variant("int8 (--quantization int8)", default, "int8", "auto"),
                 Variant("int4 (--quantization int4)", default, "int4", "auto")]  # fmt: skip
    tok = Tokenizer.from_source(resolve_model(None))
    for v in variants:
        v.engine = _core(v.model, v.dtype, v.quantization)
        runner = v.engine.runner
        assert isinstance(runner, ModelRunner)
        if not v.stack:
            runner.model.model.decode_stack = None
        v.weight_mb = weight_bytes(runner.model) / 1e6
        print(f"loaded {v.name}: {v.weight_mb:.1f} MB of weights", flush=True)
    servers: dict[str, ServerProcess] = {}
    llama_rates: dict[str, list[float]] = {name: [] for name in files}
    bench_rates: dict[str, list[float]] = {name: [] for name in files}
    if args.llama_server:
        for name, path in files.items():
            servers[name] = native_llama_server(args.llama_server, Path(path), slots=1)
    try:
        for r in range(args.rounds):
            prompt_text = f"Round {r}: " + GREEDY_PROMPTS[r % len(GREEDY_PROMPTS)]
            prompt = tok.encode(prompt_text)
            for v in variants:
                assert v.engine is not None
                decode_rate(v.engine, prompt, 8)  # warm
                v.rates.append(decode_rate(v.engine, prompt, args.tokens))
                print(f"round {r} {v.name}: {v.rates[-1]:.1f} tok/s", flush=True)
            for name, server in servers.items():
                server.start()
                try:
                    llama_rate(server, prompt_text, 8)
                    llama_rates[name].append(llama_rate(server, prompt_text, args.tokens))
                finally:
                    server.stop()
                print(f"round {r} llama-server {name}: {llama_rates[name][-1]:.1f} tok/s",
                      flush=True)  # fmt: skip
            if args.llama_bench:
                for name, path in files.items():
                    bench_rates[name].append(llama_bench_rate(args.llama_bench, path, args.tokens))
                    print(f"round {r} llama-bench {name}: {bench_rates[name][-1]:.1f} tok/s")
    finally:
        for server in servers.values():
            server.stop()
    refs: dict[str, EngineCore] = {}
    caches: dict[str, dict[str, Any]] = {}
    for v in variants:
        assert v.engine is not None
        if v.model not in refs:
            refs[v.model] = _core(v.model, "float32", None)
            caches[v.model] = {}
        v.accuracy = accuracy(v.engine, refs[v.model], tok, caches[v.model])
        print(f"accuracy {v.name}: {v.accuracy}", flush=True)
    end = machine.snapshot()
    rows = []
    base = statistics.median(variants[0].rates)
    for v in variants:
        med = statistics.median(v.rates)
        name = next(n for n, p in files.items() if p == v.model)
        peer = v.quantization == "gguf" and v.stack
        lr = llama_rates.get(name) if peer else None
        br = bench_rates.get(name) if peer else None
        rows.append({
            "variant": v.name, "tok_s": med, "rounds": v.rates, "vs_bf16": med / base,
            "llama_tok_s": statistics.median(lr) if lr else None,
            "llama_bench_tok_s": statistics.median(br) if br else None,
            "weight_mb": v.weight_mb, "file_mb": Path(v.model).stat().st_size / 1e6,
            **v.accuracy,
        })  # fmt: skip
    report = {"machine": machine.describe(start, end), "rows": rows, "tokens": args.tokens}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.write_docs:
        write_subsection("### Quantized weights: batch-1 decode", docs_body(report, args),
                         section="## Quantization")  # fmt: skip


def docs_body(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        report["machine"],
        "",
        "| weights | Diptych decode tok/s | vs bf16 | llama-server tok/s | llama-bench tok/s | "
        "Diptych vs llama.cpp's best | weight memory MB | next-token top-1 vs fp32 | KL | "
        "perplexity | greedy agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        peers = [x for x in (r["llama_tok_s"], r["llama_bench_tok_s"]) if x]
        llama = f"{r['llama_tok_s']:.1f}" if r["llama_tok_s"] else "-"
        bench = f"{r['llama_bench_tok_s']:.1f}" if r["llama_bench_tok_s"] else "-"
        ratio = f"{r['tok_s'] / max(peers):.2f}x" if peers else "-"
        lines.append(
            f"| {r['variant']} | {r['tok_s']:.1f} | {r['vs_bf16']:.2f}x | {llama} | {bench} | "
            f"{ratio} | "
            f"{r['weight_mb']:.0f} | {r['top1'] * 100:.0f} % | {r['kl']:.4f} | "
            f"{r['ppl']:.2f} | {r['greedy_agree'] * 100:.0f} % |"
        )
    cmd = "python benchmarks/quantized.py --llama-server SERVER --llama-bench BENCH " + " ".join(
        f"--gguf {g.split('=')[0]}=FILE" for g in args.gguf
    )
    lines += [
        "",
        f"Reproduce: `{cmd} --write-docs`. Batch-1 decode, {report['tokens']} greedy tokens "
        "after a short prompt, median of the rounds (each round runs every engine, then "
        "every llama-server, one at a time). Memory: every weight byte the engine holds "
        "(the bf16 row includes its packed copy); llama.cpp maps the GGUF file. Accuracy "
        "is against the dense fp32 model of the same file: the next token after 64 cut "
        "points of a fixed text (top-1 agreement, mean KL, perplexity of the true next "
        "tokens there) and greedy tokens before the first divergence (4 prompts x 32).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

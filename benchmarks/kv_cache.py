#!/usr/bin/env python
"""The int8 and fp8 KV caches beside the model-dtype one: bytes, capacity, speed,
accuracy.

    python benchmarks/kv_cache.py [--budget-mib 64] [--json out.json] [--write-docs]

One process, one machine, in one run, each measure taken for `--kv-cache-dtype auto`
(the baseline: the KV cache in the model's dtype, bf16 here), `int8` and `fp8`:

- pool: KV bytes a token holds in the engine's pool (`KvLayout.block_bytes` / block
  size), from the engines themselves;
- transfer: `diptych serve` with one prefill and one decode worker (shm), 4 prompts of
  ~600 tokens that all take the remote prefill path; the decode worker's
  `diptych_transfer_received_bytes_total` over the prompt tokens written;
- capacity: one engine per KV dtype, both with the same `--budget-mib` KV budget,
  24 requests of 512 prompt + 128 output tokens submitted at once (no shared prefix):
  the most sequences running together, and output tok/s over the whole run;
- speed: batch-1 decode tok/s after a 1,000-token prompt (the attention kernel reads
  the whole context every step; int8 runs the generic decode kernel);
- accuracy: greedy agreement with the baseline on the parity suite's 22 prompts
  (tests/engine/corpus.py, 24 tokens, EOS ignored), and the baseline's logit margin
  at each divergence (a near-tie flips, or a real error); bf16 against fp32 beside it
  for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server, scrape  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.engine_core import EngineCore, NewRequest  # noqa: E402
from tests.engine.corpus import parity_prompts  # noqa: E402

KV = ("auto", "int8", "fp8")
QUANT = KV[1:]
DTYPE = "bfloat16"


def _llm(kv: str, **kw: Any) -> LLM:
    return LLM(dtype=kw.pop("dtype", DTYPE), kv_cache_dtype=kv, **kw)


def pool_bytes_per_token(llm: LLM) -> float:
    layout = llm.engine.runner.layout
    return layout.block_bytes / layout.block_size


def transfer_bytes_per_token(kv: str, prompts: list[str]) -> dict[str, float]:
    """Bytes the prefill worker wrote into the decode worker, per prompt token."""
    server = diptych_server(
        "disaggregated", "--dtype", DTYPE, "--kv-cache-dtype", kv,
        "--min-remote-prefill-tokens", "32", "--no-prefix-caching",
    )  # fmt: skip
    server.start()
    try:
        manifest = server.manifest()
        decode = f"http://{manifest['decode-0']['metrics']}"
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        tokens = 0
        for p in prompts:
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"model": model, "prompt": p, "max_tokens": 4})  # fmt: skip
            r.raise_for_status()
            tokens += r.json()["usage"]["prompt_tokens"]
        m = scrape(decode)
    finally:
        server.stop()
    remote = m.get('diptych_worker_requests_total{prefill="remote"}', 0)
    received = m["diptych_transfer_received_bytes_total"]
    return {"remote": remote, "bytes": received, "prompt_tokens": tokens,
            "per_token": received / tokens}  # fmt: skip


def capacity(kv: str, budget: int, n: int, prompt: int, out: int) -> dict[str, float]:
    llm = _llm(kv, kv_cache_memory_bytes=budget, enable_prefix_caching=False)
    core: EngineCore = llm.engine
    params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
    for i in range(n):
        ids = [(31 * i + 7 * j) % 20000 + 100 for j in range(prompt)]
        core.submit(NewRequest(f"c{i}", ids, params))
    peak, tokens = 0, 0
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        for o in core.step():
            tokens += len(o.new_token_ids)
        peak = max(peak, len(core.scheduler.running))
    secs = time.perf_counter() - t0
    layout = core.runner.layout
    return {"blocks": layout.num_blocks - 1, "peak_running": peak,
            "tok_s": tokens / secs, "seconds": secs}  # fmt: skip


def decode_rate(llm: LLM, prompt: list[int], tokens: int) -> float:
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    core.submit(NewRequest(f"d{time.monotonic_ns()}", prompt, params))
    stamps: list[float] = []
    while core.has_unfinished_requests():
        for o in core.step():
            stamps += [time.perf_counter()] * len(o.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def agreement(ref: list[Any], got: list[Any]) -> dict[str, Any]:
    full, firsts, margins = 0, [], []
    for a, b in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        firsts.append(len(a.token_ids) if n is None else n)
        if n is None:
            full += 1
        elif a.logits is not None:
            row = a.logits[n]
            margins.append(float(row[a.token_ids[n]] - row[b.token_ids[n]]))
    return {"full": full, "prompts": len(ref), "mean_first_divergence": statistics.mean(firsts),
            "max_margin": max(margins, default=0.0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    start = machine.snapshot()
    report: dict[str, Any] = {"budget_mib": args.budget_mib, "rows": {}}
    rows: dict[str, dict[str, Any]] = report["rows"]
    llms = {kv: _llm(kv, kv_cache_memory_bytes=256 << 20) for kv in KV}
    tok = llms["auto"].tokenizer
    for kv in KV:
        rows[kv] = {"pool_bytes_per_token": pool_bytes_per_token(llms[kv])}

    long_prompt = tok.encode(" ".join(f"item {i} is {i * 7 % 13}." for i in range(170)))[:1000]
    rates: dict[str, list[float]] = {kv: [] for kv in KV}
    for r in range(args.rounds):  # interleaved: a noisy neighbour hurts both alike
        for kv in KV:
            decode_rate(llms[kv], long_prompt[:64], 4)  # warm
            rates[kv].append(decode_rate(llms[kv], [r + 1, *long_prompt], 64))
            print(f"round {r} {kv}: {rates[kv][-1]:.1f} tok/s", flush=True)
    for kv in KV:
        rows[kv]["decode_tok_s"] = statistics.median(rates[kv])

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, output_logits=True)
    prompts = parity_prompts(tok.encode)
    outs = {kv: llms[kv].generate(prompts, params) for kv in KV}
    del llms
    fp32 = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20).generate(prompts, params)
    for kv in QUANT:
        rows[kv]["agreement"] = agreement(outs["auto"], outs[kv])
    report["bf16_vs_fp32"] = agreement(fp32, outs["auto"])

    budget = args.budget_mib << 20
    for kv in KV:
        rows[kv]["capacity"] = capacity(kv, budget, 24, 512, 128)
        print(f"capacity {kv}: {rows[kv]['capacity']}", flush=True)

    text = " ".join(f"Line {i}: the harbour log records boat {i % 17} at dawn." for i in range(60))
    transfer_prompts = [f"Report {k}. {text}" for k in range(4)]
    for kv in KV:
        rows[kv]["transfer"] = transfer_bytes_per_token(kv, transfer_prompts)
        print(f"transfer {kv}: {rows[kv]['transfer']}", flush=True)

    report["machine"] = machine.describe(start, machine.snapshot())
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.write_docs:
        write_subsection("### Quantized KV cache (int8, fp8)", docs_body(report, args),
                         section="## Quantization")  # fmt: skip


def docs_body(report: dict[str, Any], args: argparse.Namespace) -> str:
    rows, ref = report["rows"], report["bf16_vs_fp32"]
    a = rows["auto"]

    def cells(get: Any, fmt: str = "{:.0f}") -> str:
        base = get(a)
        out = [fmt.format(base)]
        for kv in QUANT:
            x = get(rows[kv])
            out.append(f"{fmt.format(x)} ({x / base:.2f}x)")
        return " | ".join(out)

    measures = [
        ("pool bytes a token", lambda r: r["pool_bytes_per_token"], "{:.0f}"),
        ("remote prefill: bytes written a prompt token",
         lambda r: r["transfer"]["per_token"], "{:.0f}"),
        (f"blocks in a {report['budget_mib']} MiB KV budget",
         lambda r: r["capacity"]["blocks"], "{:.0f}"),
        ("sequences running together (512 + 128 tokens each)",
         lambda r: r["capacity"]["peak_running"], "{:.0f}"),
        ("output tok/s, 24 such requests at once", lambda r: r["capacity"]["tok_s"], "{:.1f}"),
        ("batch-1 decode tok/s after 1,000 tokens", lambda r: r["decode_tok_s"], "{:.1f}"),
    ]  # fmt: skip
    lines = [
        report["machine"],
        "",
        f"| measure | KV in {DTYPE} (baseline) | {' | '.join(f'{kv} KV' for kv in QUANT)} |",
        "|---|---|" + "---|" * len(QUANT),
        *(f"| {name} | {cells(get, fmt)} |" for name, get, fmt in measures),
        "",
        "An int8 or fp8 row carries its fp16 scale (per token and KV head): 66 bytes where "
        f"{DTYPE} takes 128 at head_dim 64, hence 0.52x rather than 0.50x; against an fp32 "
        "KV cache (`--dtype auto` on CPUs without fast bf16) it is 0.26x.",
        "",
        f"Greedy agreement with the {DTYPE} KV cache on the parity suite's "
        f"{rows[QUANT[0]]['agreement']['prompts']} prompts (24 tokens):",
        "",
        "| KV cache | identical | mean first divergence (token) "
        "| largest baseline margin at a divergence (logits) |",
        "|---|---|---|---|",
        *(f"| {kv} | {rows[kv]['agreement']['full']} | "
          f"{rows[kv]['agreement']['mean_first_divergence']:.1f} | "
          f"{rows[kv]['agreement']['max_margin']:.3f} |" for kv in QUANT),
        f"| for scale: {DTYPE} weights and KV against fp32 | {ref['full']} | "
        f"{ref['mean_first_divergence']:.1f} | {ref['max_margin']:.3f} |",
        "",
        "A small margin at a divergence is a near-tie flipped, not an error. int8 and fp8 "
        "rows take the same bytes; on this model int8 stays closer to the baseline: its "
        "127 even steps a row are finer for the row's largest values than e4m3's three "
        "mantissa bits, which keep more of the small ones. Decode over a long context is "
        "slower with either: the generic decode kernel widens the codes, where a bf16 "
        "cache takes the register-tiled bf16 kernel; the time comes back when the doubled "
        "capacity lets more sequences run at once (the output tok/s row).",
        "",
        f"Reproduce: `python benchmarks/kv_cache.py --budget-mib {report['budget_mib']} "
        "--write-docs`. Decode: median of the rounds, the caches interleaved. "
        "Transfer: `diptych serve` (1 prefill + 1 decode worker, shm), 4 prompts "
        f"({a['transfer']['prompt_tokens'] // 4} tokens each) prefilled remotely, the decode "
        "worker's received bytes. Capacity: one engine per cache, the same KV budget.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

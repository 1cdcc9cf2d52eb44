"""The checks that need a GPU, in one run that fits a 15-minute lease (issue 38).

    scripts/gpu-check                        # on the lent machine: see that script

Four parts, each timed and recorded in one JSON whatever the others do (a part that
fails records its error and the run goes on):

1. kernels: the Triton kernel tests (tests/kernels/test_triton_*.py, the quantized and
   FP8 linears', the mixture of experts' grouped GEMM), compiled for this GPU and
   compared with their torch references;
2. parity: a tiny random Llama (8 heads, 4 KV heads) built here by transformers, greedy
   in fp32 on the GPU through the engine (Triton kernels) against transformers on the
   same GPU: tokens equal, logits within 1e-3;
3. decode: TP 1 decode throughput of a synthetic Llama (about 1.2B parameters: hidden
   2048, 16 layers, 32 heads over 8 KV heads) in bf16, batches of 64 and 1 after
   512-token prompts, by default and under `--deterministic`;
4. attention bandwidth: the Triton decode attention kernel over a bf16 cache (64
   sequences of 4096 tokens, 8 KV heads of 128), bytes of K and V read per second
   against the card's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PEAK_TBS = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth by the vendors' data sheets
DEV = "cuda"  # "cpu" under --smoke: the script's own logic, checked without a GPU


def part(name: str, doc: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    began = time.monotonic()
    try:
        doc[name] = {"ok": True, **fn()}
    except Exception as e:  # recorded; the next part runs
        doc[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    doc[name]["seconds"] = round(time.monotonic() - began, 1)
    print(f"[gpu-check] {name}: {json.dumps(doc[name])[:600]}", flush=True)


def kernels(out_dir: Path) -> dict[str, Any]:
    found = (ROOT / "tests" / "kernels").glob("test_triton_*.py")
    tests = sorted(str(p.relative_to(ROOT)) for p in found)
    tests += ["tests/kernels/test_quant_linear.py", "tests/kernels/test_fp8_linear.py",
              "tests/kernels/test_moe.py", "tests/kernels/test_lora_kernels.py"]
    xml = out_dir / "kernels.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *tests]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = (run.stdout + run.stderr)[-4000:]
    summary = [line for line in tail.splitlines() if " passed" in line or " failed" in line]
    return {"returncode": run.returncode, "summary": summary[-1:] or tail[-500:].splitlines(),
            "tail": tail if run.returncode else ""}  # fmt: skip


def _tiny_llama(path: Path) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model.eval()


def parity() -> dict[str, Any]:
    from engine import EngineConfig, EngineCore, NewRequest, SamplingParams

    new = 16
    with tempfile.TemporaryDirectory() as d:
        hf = _tiny_llama(Path(d) / "tiny").to(DEV)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 17, 100, 300)]
        refs = []
        with torch.inference_mode():
            for ids in prompts:
                seq, toks, rows = list(ids), [], []
                for _ in range(new):
                    logits = hf(torch.tensor([seq], device=DEV)).logits[0, -1].float().cpu()
                    rows.append(logits)
                    toks.append(int(logits.argmax()))
                    seq.append(toks[-1])
                refs.append((toks, torch.stack(rows)))
        core = EngineCore(EngineConfig(model=str(Path(d) / "tiny"), dtype="float32",
                                       device=DEV, num_blocks=256,
                                       max_num_batched_tokens=64))  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, output_logits=True)
        for i, p in enumerate(prompts):
            core.submit(NewRequest(str(i), p, params))
        outs: dict[str, tuple[list[int], list[torch.Tensor]]] = {str(i): ([], []) for i in range(4)}
        while core.has_unfinished_requests():
            for o in core.step():
                outs[o.request_id][0].extend(o.new_token_ids)
                outs[o.request_id][1].extend(o.new_logits or [])
        paths = core.runner.kernel_paths()
    same = [outs[str(i)][0] == refs[i][0] for i in range(4)]
    worst = max(float((torch.stack(outs[str(i)][1]).cpu() - refs[i][1]).abs().max())
                for i in range(4))  # fmt: skip
    return {"tokens_equal": same, "max_logits_diff": worst, "kernel_paths": paths,
            "pass": all(same) and worst < 1e-3}  # fmt: skip


def decode() -> dict[str, Any]:
    """Decode throughput at batch 64 (and 1), by default and under `--deterministic`
    (its cost on this GPU: the batch-invariant GEMM and attention against cuBLAS and
    the split-KV kernel)."""
    import transformers

    batch, prompt, steps = (64, 512, 128) if DEV == "cuda" else (4, 32, 8)
    layers, hidden = (16, 2048) if DEV == "cuda" else (2, 256)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        cfg = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
            max_position_embeddings=4096, tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device(DEV):
            model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(Path(d) / "llama")
        out["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
        del model
        torch.cuda.empty_cache()
        # the CPU smoke run's heads (8 wide) are too narrow for the CPU's batch-invariant kernel
        for det in (False, True) if DEV == "cuda" else (False,):
            for b in (batch, 1):
                key = f"{'deterministic' if det else 'default'}_batch{b}"
                out[key] = _decode_run(Path(d) / "llama", b, prompt, steps, det)
    return out


def _decode_run(path: Path, batch: int, prompt: int, steps: int, det: bool) -> dict[str, Any]:
    from engine import EngineConfig, EngineCore, NewRequest, SamplingParams

    core = EngineCore(EngineConfig(
        model=str(path), dtype="bfloat16", device=DEV, deterministic=det,
        max_num_seqs=batch, max_num_batched_tokens=8192, num_blocks=max(batch, 8) * 48,
    ))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    sp = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, 32000, (prompt,), generator=g).tolist()
        core.submit(NewRequest(str(i), ids, sp))
    times = []
    while core.has_unfinished_requests():
        sync()
        began = time.perf_counter()
        outs = core.step()
        sync()
        if core.last_step_tokens == len(outs) == batch:  # a pure decode step
            times.append(time.perf_counter() - began)
    core.close()
    step = statistics.median(times)
    return {"decode_steps": len(times), "median_step_ms": round(step * 1e3, 2),
            "tokens_per_s": round(batch / step, 1)}  # fmt: skip


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def attention_bandwidth() -> dict[str, Any]:
    from kernels.ops import Kernels, KernelSelection
    from kernels.paged import PagedBatch, PagedLayer

    k = Kernels(KernelSelection("triton"))
    seqs, ctx, kvh, d, group, bs = 64, 4096, 8, 128, 4, 16
    blocks_per = ctx // bs
    nblocks = seqs * blocks_per + 1
    dev = torch.device("cuda")
    kc = torch.randn(nblocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(nblocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    table = (torch.randperm(nblocks - 1, device=dev)[: seqs * blocks_per] + 1).view(seqs, -1)
    batch = PagedBatch(torch.full((seqs,), ctx, device=dev, dtype=torch.int32),
                       table.to(torch.int32), None, 1, ctx)  # fmt: skip
    q = torch.randn(seqs, kvh * group, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    layer = PagedLayer(kc, vc, d**-0.5)
    for _ in range(5):
        k.unified_attention(q, layer, batch, out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 50
    start.record()
    for _ in range(reps):
        k.unified_attention(q, layer, batch, out)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / reps
    read = 2 * seqs * ctx * kvh * d * 2  # K and V, bf16
    tbs = read / (ms / 1e3) / 1e12
    name = torch.cuda.get_device_name()
    peak = next((v for key, v in PEAK_TBS.items() if key in name), None)
    return {"seqs": seqs, "context": ctx, "kv_heads": kvh, "head_dim": d, "ms": round(ms, 3),
            "kv_bytes": read, "tb_per_s": round(tbs, 2),
            "share_of_peak": round(tbs / peak, 3) if peak else None}  # fmt: skip


def tier_copy() -> dict[str, Any]:
    """A 64-block prefix of Llama-3.1-8B-sized blocks (128 KiB a layer, 32 layers: 4 MiB
    a block) out of a device pool into pinned host rows and back (the KV tiers' copies,
    engine/kv_cache/layout.py), against one memcpy of the same bytes each way (issue 40:
    a host-tier restore at >= 80 % of memcpy)."""
    from engine.kv_cache.layout import read_block_bytes, write_block_bytes

    block = 4 << 20 if DEV == "cuda" else 64 << 10  # (--smoke: the logic, small)
    pool = torch.randint(0, 255, (128, block), dtype=torch.uint8, device=DEV)
    ids = list(range(1, 129, 2))  # 64 blocks, not one run
    rows = read_block_bytes(pool, ids)
    pinned = all(r.is_pinned() for r in rows) if DEV == "cuda" else None
    copy = pool.clone()
    copy[ids] = 0
    write_block_bytes(copy, ids, rows)
    sync()
    same = bool(torch.equal(copy[ids], pool[ids]))
    nbytes = len(ids) * block

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        began = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return (time.perf_counter() - began) / 5

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")
    flat = pool[ids].reshape(-1)
    out = {
        "pinned": pinned, "roundtrip_equal": same, "bytes": nbytes,
        "read_gbs": nbytes / timed(lambda: read_block_bytes(pool, ids)) / 1e9,
        "write_gbs": nbytes / timed(lambda: write_block_bytes(copy, ids, rows)) / 1e9,
        "memcpy_d2h_gbs": nbytes / timed(lambda: host.copy_(flat, non_blocking=True)) / 1e9,
        "memcpy_h2d_gbs": nbytes / timed(lambda: flat.copy_(host, non_blocking=True)) / 1e9,
    }  # fmt: skip
    out["restore_vs_memcpy"] = out["write_gbs"] / out["memcpy_h2d_gbs"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu-check.json")
    ap.add_argument("--skip", nargs="*", default=[], help="parts to leave out")
    ap.add_argument("--smoke", action="store_true",
                    help="parity and a tiny decode on the CPU: this script's logic, no GPU")
    args = ap.parse_args()
    global DEV
    if args.smoke:
        DEV = "cpu"
        args.skip += ["kernels", "attention_bandwidth"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                           "cuda": torch.cuda.is_available()}  # fmt: skip
    if not torch.cuda.is_available() and not args.smoke:
        print("[gpu-check] no CUDA device", file=sys.stderr)
        return 2
    doc["gpu"] = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    try:
        import triton

        doc["triton"] = triton.__version__
    except ImportError:
        doc["triton"] = None
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "kernels": lambda: kernels(args.out.parent),
        "parity": parity,
        "attention_bandwidth": attention_bandwidth,
        "decode": decode,
        "tier_copy": tier_copy,
    }
    for name, fn in parts.items():
        if name not in args.skip:
            part(name, doc, fn)
            args.out.write_text(json.dumps(doc, indent=2) + "\n")  # what ran so far, kept
    ok = all(doc[n].get("ok") for n in parts if n in doc)
    print(f"[gpu-check] {'all parts ran' if ok else 'some parts failed'}: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""GPU kernels: achieved bandwidth against the device's peak, and time against torch.

    python benchmarks/kernels.py                  # full run on the current CUDA device
    python benchmarks/kernels.py --quick          # smoke run, seconds
    python benchmarks/kernels.py --json out.json --write-docs   # refresh docs/benchmarks.md

Needs a CUDA device and the triton package; without them it says so and exits 2
(the CPU kernels are measured by benchmarks/engine_throughput.py).

What it measures, in bf16 with Llama-3-8B attention geometry (32 query heads, 8 KV
heads, head_dim 128) on a paged pool of 16-token blocks in shuffled order:

- decode attention (one query token per sequence) at several batch sizes and
  context lengths: the unified kernel with one program per (sequence, KV head),
  the same with the split-KV heuristic (`choose_num_splits`), torch SDPA over K/V
  gathered from the pool (the reference path: gather + SDPA), and SDPA alone over
  K/V already contiguous (a dense lower bound that the paged layout cannot have).
  Bandwidth counts the bytes a decode must read, K and V of every cached token plus
  q, out and the block table, over the kernel time;
- KV store (the step's new K/V rows into their slots) against torch's indexed copy;
  bandwidth counts bytes read + written;
- prefill attention (a fresh prompt, and a chunk after a cached prefix) against
  SDPA's causal flash kernel on contiguous tensors, in TFLOP/s of causal attention;
- block gather (packing whole blocks into a staging buffer) against index_select.

Peak bandwidth comes from the device's memory clock and bus width when torch reports
them, else from a table of known parts; a measured device-to-device copy is reported
beside it. Times are medians of `triton.testing.do_bench`, which flushes the L2 cache
before every run (a small decode's KV would otherwise be read from L2). Each
configuration's Triton output is checked against SDPA (or the reference store)
before it is timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `kernels` importable without an editable install
    sys.path.insert(0, str(REPO_ROOT))

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
# HBM peak in GB/s of parts whose properties may not carry clock and bus width
KNOWN_PEAK_GBS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
}


def refuse_without_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py measures the Triton GPU kernels and needs a CUDA device "
            "(torch.cuda.is_available() is False here). The CPU kernels are measured by "
            "benchmarks/engine_throughput.py.",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/kernels.py needs the triton package", file=sys.stderr)
        sys.exit(2)


def bench(fn: Callable[[], Any]) -> float:
    """Median time of fn in microseconds over ~100 ms of runs, the L2 cache flushed
    before each (a decode's KV can fit in L2 and would be read from it on repeats).
    The GPU runs the flush while the host launches fn, so the time is device time."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def device_limits(dev: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(dev)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        peak, source = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    else:
        name = next((k for k in KNOWN_PEAK_GBS if k in props.name), None)
        peak, source = (KNOWN_PEAK_GBS[name], f"table entry {name!r}") if name else (0.0, "")
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_us = bench(lambda: b.copy_(a))
    copy_gbs = 2 * n / copy_us / 1e3  # read + write
    if not peak:
        peak, source = copy_gbs, "measured copy (no clock/bus width, unknown part)"
    return {
        "name": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "peak_gbs": peak,
        "peak_source": source,
        "copy_gbs": copy_gbs,
    }


def paged_pool(lens: list[int], dev: torch.device, g: torch.Generator) -> torch.Tensor:
    """A one-layer pool [blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM] of random bf16 with
    room for sequences of `lens` tokens (and the null block)."""
    blocks = sum(-(-n // BLOCK) for n in lens) + 1
    shape = (blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16)


def shuffled_table(lens: list[int], num_blocks: int, dev: torch.device) -> torch.Tensor:
    nb = [-(-n // BLOCK) for n in lens]
    ids = torch.randperm(num_blocks - 1, device=dev)[: sum(nb)] + 1
    table = torch.zeros(len(lens), max(nb), dtype=torch.int32, device=dev)
    for i, chunk in enumerate(torch.split(ids, nb)):
        table[i, : len(chunk)] = chunk
    return table


def decode_case(batch: int, ctx: int, peak: float, dev: torch.device) -> dict[str, Any]:
    from kernels import reference
    from kernels.paged import PagedBatch, PagedLayer
    from kernels.triton import split_decode, unified_attention

    g = torch.Generator(device=dev).manual_seed(batch * 7919 + ctx)
    pool = paged_pool([ctx] * batch, dev, g)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    table = shuffled_table([ctx] * batch, pool.shape[0], dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    splits = split_decode.choose_num_splits(batch, KV_HEADS, ctx, dev)
    paged = PagedBatch(lens, table, max_seq_len=ctx)
    layer = PagedLayer(kc, vc, scale)

    def triton_call(num_splits: int) -> Callable[[], Any]:
        return lambda: unified_attention(q, layer, paged, out, num_splits=num_splits)

    # dense K/V [B, KV_HEADS, ctx, D]: what SDPA reads after a gather
    kd = kc[table.long()].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2)
    vd = vc[table.long()].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2)
    kd, vd = kd.contiguous(), vd.contiguous()
    q4 = q.view(batch, HEADS, 1, HEAD_DIM)

    def sdpa_dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, kd, vd, scale=scale, enable_gqa=True)

    def gather_sdpa() -> torch.Tensor:
        return reference.paged_decode_attention(q, layer, paged)

    want = sdpa_dense().view(batch, HEADS, HEAD_DIM).float()
    errs = []
    for s in sorted({1, splits}):
        triton_call(s)()
        errs.append(float((out.float() - want).abs().max()))
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    io_bytes = kv_bytes + 2 * q.numel() * 2 + table.numel() * 4
    t_plain = bench(triton_call(1))
    t_split = bench(triton_call(splits)) if splits > 1 else t_plain
    t_dense = bench(sdpa_dense)
    t_gather = bench(gather_sdpa)
    best = min(t_plain, t_split)
    return {
        "batch": batch,
        "context": ctx,
        "splits": splits,
        "max_abs_err": max(errs),
        "triton_us": t_plain,
        "triton_split_us": t_split,
        "sdpa_dense_us": t_dense,
        "gather_sdpa_us": t_gather,
        "bytes": io_bytes,
        "gbs": io_bytes / best / 1e3,
        "peak_fraction": io_bytes / best / 1e3 / peak,
    }


def store_case(tokens: int, peak: float, dev: torch.device) -> dict[str, Any]:
    from kernels import reference
    from kernels.triton import store_kv

    g = torch.Generator(device=dev).manual_seed(tokens)
    pool = paged_pool([max(tokens, 4096) * 2], dev, g)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    slots = torch.randperm(pool.shape[0] * BLOCK - BLOCK, device=dev)[:tokens] + BLOCK
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device=dev)
    qkv = qkv.bfloat16()
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    store_kv(k, v, kc, vc, slots)
    check = pool.clone()
    reference.store_kv(k, v, check[:, 0, 0], check[:, 0, 1], slots)
    exact = bool(torch.equal(check, pool))
    moved = 2 * 2 * tokens * KV_HEADS * HEAD_DIM * 2  # K and V, read + written
    t_triton = bench(lambda: store_kv(k, v, kc, vc, slots))
    t_torch = bench(lambda: reference.store_kv(k, v, kc, vc, slots))
    return {
        "tokens": tokens,
        "exact": exact,
        "triton_us": t_triton,
        "torch_us": t_torch,
        "gbs": moved / t_triton / 1e3,
        "peak_fraction": moved / t_triton / 1e3 / peak,
    }


def prefill_case(ctx: int, q_len: int, dev: torch.device) -> dict[str, Any]:
    from kernels.paged import PagedBatch, PagedLayer
    from kernels.triton import store_kv, unified_attention

    g = torch.Generator(device=dev).manual_seed(ctx + q_len)
    n = ctx + q_len
    pool = paged_pool([n], dev, g)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    table = shuffled_table([n], pool.shape[0], dev)
    pos = torch.arange(n, device=dev)
    slots = table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g, device=dev).bfloat16()
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g, device=dev).bfloat16()
    store_kv(k, v, kc, vc, slots)
    q = torch.randn(q_len, HEADS, HEAD_DIM, generator=g, device=dev).bfloat16()
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    paged = PagedBatch(lens, table, qsl, max_query_len=q_len, max_seq_len=n)
    scale = HEAD_DIM**-0.5

    def triton_call() -> torch.Tensor:
        return unified_attention(q, PagedLayer(kc, vc, scale), paged)

    qt, kt_, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if ctx == 0:
        mask = None
    else:  # query i sits at ctx + i
        pos = ctx + torch.arange(q_len, device=dev)
        mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            qt, kt_, vt, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    err = float((triton_call().float() - sdpa()[0].transpose(0, 1).float()).abs().max())
    # causal: query i attends ctx + i + 1 keys; 2 matmuls x 2 FLOPs per multiply-add
    pairs = q_len * ctx + q_len * (q_len + 1) / 2
    flops = 4 * pairs * HEADS * HEAD_DIM
    t_triton, t_sdpa = bench(triton_call), bench(sdpa)
    return {
        "context": ctx,
        "q_len": q_len,
        "max_abs_err": err,
        "triton_us": t_triton,
        "sdpa_us": t_sdpa,
        "triton_tflops": flops / t_triton / 1e6,
        "sdpa_tflops": flops / t_sdpa / 1e6,
    }


def gather_case(blocks: int, peak: float, dev: torch.device) -> dict[str, Any]:
    from kernels.triton import gather_blocks

    layers = 32  # a block of all layers, as the transfer layer moves it
    pool = torch.empty(2 * blocks + 1, layers, 2, BLOCK, KV_HEADS, HEAD_DIM,
                       dtype=torch.bfloat16, device=dev)  # fmt: skip
    ids = torch.randperm(pool.shape[0], device=dev)[:blocks]
    out = torch.empty(blocks, *pool.shape[1:], dtype=pool.dtype, device=dev)
    moved = 2 * out.numel() * 2
    t_triton = bench(lambda: gather_blocks(pool, ids, out))
    t_torch = bench(lambda: torch.index_select(pool, 0, ids, out=out))
    return {
        "blocks": blocks,
        "mib": out.numel() * 2 / 2**20,
        "triton_us": t_triton,
        "torch_us": t_torch,
        "gbs": moved / t_triton / 1e3,
        "peak_fraction": moved / t_triton / 1e3 / peak,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    limits = device_limits(dev)
    peak = limits["peak_gbs"]
    print(f"{limits['name']}: peak {peak:.0f} GB/s ({limits['peak_source']}), "
          f"measured copy {limits['copy_gbs']:.0f} GB/s")  # fmt: skip
    batches = [1, 8] if args.quick else [1, 4, 16, 64, 128]
    contexts = [512] if args.quick else [1024, 4096, 16384]
    res: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": limits,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/kernels.py " + shlex.join(args.argv),
        "decode": [],
        "store": [],
        "prefill": [],
        "gather": [],
    }
    free = torch.cuda.mem_get_info(dev)[0]
    for b in batches:
        for c in contexts:
            if 2 * b * c * KV_HEADS * HEAD_DIM * 2 * 4 > free:  # pool + dense copies
                continue
            r = decode_case(b, c, peak, dev)
            res["decode"].append(r)
            print(f"decode batch {b:4d} ctx {c:6d}: {r['gbs']:7.0f} GB/s "
                  f"({r['peak_fraction']:.0%} of peak), splits {r['splits']}")  # fmt: skip
    for t in [1, 64] if args.quick else [1, 64, 1024, 16384]:
        res["store"].append(store_case(t, peak, dev))
    for ctx, ql in [(0, 512)] if args.quick else [(0, 1024), (0, 4096), (4096, 512)]:
        res["prefill"].append(prefill_case(ctx, ql, dev))
    for nb in [4] if args.quick else [16, 256]:
        res["gather"].append(gather_case(nb, peak, dev))
    return res


def markdown(res: dict[str, Any]) -> str:
    d = res["device"]
    lines = [
        "## Kernels",
        "",
        f"Measured {res['date']} on {d['name']} ({d['sms']} SMs, {d['memory_gib']:.0f} GiB), "
        f"torch {res['torch']}, triton {res['triton']}, Python {res['python']}; bf16, "
        f"{HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {BLOCK}-token blocks "
        "in shuffled order.",
        "",
        f"Peak bandwidth {d['peak_gbs']:.0f} GB/s ({d['peak_source']}); a device-to-device "
        f"copy measured {d['copy_gbs']:.0f} GB/s (read + write).",
        "",
        "```",
        res["command"],
        "```",
        "",
        "Decode attention (one query token per sequence); µs, median, L2 flushed before each run:",
        "",
        "| batch | context | Triton | Triton split-KV (splits) | gather + SDPA | SDPA, dense K/V "
        "| GB/s | of peak | max err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["decode"]:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['triton_us']:.1f} | "
            f"{r['triton_split_us']:.1f} ({r['splits']}) | {r['gather_sdpa_us']:.1f} | "
            f"{r['sdpa_dense_us']:.1f} | {r['gbs']:.0f} | {r['peak_fraction']:.0%} | "
            f"{r['max_abs_err']:.1e} |"
        )
    lines += [
        "",
        "KV store (K and V rows of new tokens into random slots):",
        "",
        "| tokens | Triton µs | torch µs | GB/s (read + write) | of peak | exact |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["store"]:
        lines.append(
            f"| {r['tokens']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | {r['gbs']:.0f} | "
            f"{r['peak_fraction']:.0%} | {'yes' if r['exact'] else 'NO'} |"
        )
    lines += [
        "",
        "Prefill attention (causal), Triton over the paged cache vs SDPA on contiguous tensors:",
        "",
        "| cached context | new tokens | Triton µs | SDPA µs | Triton TFLOP/s | SDPA TFLOP/s "
        "| max err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["prefill"]:
        lines.append(
            f"| {r['context']} | {r['q_len']} | {r['triton_us']:.0f} | {r['sdpa_us']:.0f} | "
            f"{r['triton_tflops']:.0f} | {r['sdpa_tflops']:.0f} | {r['max_abs_err']:.1e} |"
        )
    lines += [
        "",
        "Block gather (whole 32-layer blocks into a staging buffer):",
        "",
        "| blocks | MiB | Triton µs | index_select µs | GB/s (read + write) | of peak |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["gather"]:
        lines.append(
            f"| {r['blocks']} | {r['mib']:.0f} | {r['triton_us']:.1f} | {r['torch_us']:.1f} | "
            f"{r['gbs']:.0f} | {r['peak_fraction']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def write_docs(path: Path, section: str) -> None:
    """Replace the "## Kernels" section (up to the next "## " heading) and nothing else."""
    text = path.read_text()
    match = re.search(r"^## Kernels[ \t]*\n", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f'{path} has no "## Kernels" heading')
    nxt = re.search(r"^## ", text[match.end() :], flags=re.MULTILINE)
    end = len(text) if nxt is None else match.end() + nxt.start()
    body = section if nxt is None else section.rstrip("\n") + "\n\n"
    path.write_text(text[: match.start()] + body + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="write raw results here")
    ap.add_argument("--write-docs", action="store_true",
                    help='rewrite the "## Kernels" section of docs/benchmarks.md')  # fmt: skip
    ap.add_argument("--docs-path", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    refuse_without_cuda()
    res = run(args)
    text = markdown(res)
    print()
    print(text)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if args.write_docs:
        write_docs(args.docs_path, text)
        print(f'rewrote the "## Kernels" section of {args.docs_path}')
    return 0


if __name__ == "__main__":
    sys.exit(main())

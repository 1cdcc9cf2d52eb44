"""Compile every Triton kernel variant the engine launches for real GPU targets, with
no GPU: the interpreter proves the arithmetic, this proves the kernels also lower
through Triton's compiler to PTX and cubin (and reports their shared memory).

The launchers run on CPU tensors with each kernel swapped for a recorder
(`kernels.triton.record`), so they do their host-side checks and pick their tile
shapes exactly as on a GPU; each recorded launch is then compiled ahead of time with
`triton.compile` for the targets.

    python -m tests.kernels.compile_check [--arch 90 --arch 80] [--full]

Must run without TRITON_INTERPRET (the kernels must be defined for compilation).
Exit status 0 only when exactly the expected number of variants was recorded
(`EXPECTED_VARIANTS`; none at all is a failure) and every one compiled for every target.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kernels.paged import PagedBatch, PagedLayer

TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
}
# Shared memory a block may use. sm_80 code is what sm_86/89 run too, and they offer
# only ~99 KiB (sm_80 itself 163); Hopper offers 227.
SHARED_LIMIT = {80: 99 * 1024, 90: 227 * 1024}


def signature(fn: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of one recorded launch. Like a real
    launch, pointers 16-byte aligned and integers divisible by 16 are marked so (the
    compiler vectorizes and pipelines loads on that knowledge)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = v
            continue
        aligned = v.data_ptr() % 16 == 0 if isinstance(v, torch.Tensor) else v % 16 == 0
        if aligned and not isinstance(v, (bool, float)):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TRITON_TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={v!r}")
    return sig, consts, attrs, options


# (dtype, head_dim, gqa, block_size, windows, kinds, quantized KV dtype or None): the CI
# set covers the engine's usual shapes plus the shared-memory extremes (fp32, 256-wide
# heads), and the int8 and fp8 KV caches (kernels/kv_quant.py) at the usual shapes.
INT8, FP8 = torch.int8, torch.float8_e4m3fn
CI_ATTENTION: list[tuple[torch.dtype, int, int, int, tuple[int | None, ...], tuple[str, ...],
                         torch.dtype | None]] = [
    (torch.bfloat16, 128, 4, 16, (None, 24), ("prefill", "decode", "split"), None),
    (torch.float16, 64, 1, 32, (None,), ("prefill", "decode"), None),
    (torch.float32, 128, 8, 16, (None,), ("prefill", "decode", "split"), None),
    (torch.bfloat16, 256, 8, 16, (None,), ("prefill", "decode"), None),
    (torch.bfloat16, 128, 4, 16, (None,), ("prefill", "decode", "split"), INT8),
    (torch.float16, 64, 3, 16, (None,), ("prefill", "decode"), INT8),
    (torch.bfloat16, 128, 4, 16, (None,), ("prefill", "decode", "split"), FP8),
]  # fmt: skip
FULL_ATTENTION = [
    (dt, d, gqa, bs, (None, 24), ("prefill", "decode", "split"), codes)
    for dt in (torch.bfloat16, torch.float16, torch.float32)
    for d, gqa, bs in [(128, 4, 16), (64, 1, 32), (128, 8, 16), (256, 3, 16)]
    for codes in (None, INT8, FP8)
]


def attention_cases(full: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    import kernels.triton as kt

    for dt, d, gqa, bs, windows, kinds, codes in FULL_ATTENTION if full else CI_ATTENTION:
        kvh, heads = 2, 2 * gqa
        pool = torch.zeros(8, 2, 2, bs, kvh, d + 2 if codes else d, dtype=codes or dt)
        kc, vc = pool[:, 0, 0], pool[:, 0, 1]
        table = torch.zeros(3, 4, dtype=torch.int32)
        lens = torch.tensor([40, 50, 60], dtype=torch.int32)
        qsl = torch.tensor([0, 1, 2, 42], dtype=torch.int32)
        for window in windows:
            for kind in kinds:
                decode = kind != "prefill"
                q = torch.zeros(3 if decode else 42, heads, d, dtype=dt)
                batch = PagedBatch(
                    lens, table, None if decode else qsl, 1 if decode else 40, max_seq_len=60
                )
                splits = 8 if kind == "split" else 1

                def launch(
                    q: torch.Tensor = q,
                    kc: torch.Tensor = kc,
                    vc: torch.Tensor = vc,
                    b: PagedBatch = batch,
                    w: int | None = window,
                    n: int = splits,
                ) -> None:
                    kt.unified_attention(q, PagedLayer(kc, vc, 0.1, w), b, num_splits=n)

                kv = f" {str(codes).removeprefix('torch.')} KV" if codes else ""
                yield f"attention {kind} {dt} d={d} gqa={gqa} bs={bs} window={window}{kv}", launch


def cases(full: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, launcher call) for each variant."""
    import kernels.triton as kt

    yield from attention_cases(full)
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        x = torch.zeros(4, 4096, dtype=dt)
        yield f"rms_norm {dt}", lambda x=x: kt.rms_norm(x, x, x[0], 1e-6)
        yield f"rms_norm no residual {dt}", lambda x=x: kt.rms_norm(x, None, x[0], 1e-6)
        cos = torch.zeros(4, 64)
        qkv = torch.zeros(4, 48 * 128, dtype=dt)
        for il in (False, True):
            yield (
                f"rotary interleaved={il} {dt}",
                lambda qkv=qkv, il=il, c=cos: kt.rotary_(
                    qkv[:, : 32 * 128].view(4, 32, 128), c, c, il
                ),
            )
        yield f"silu_and_mul {dt}", lambda x=x: kt.silu_and_mul(x)
    pool = torch.zeros(8, 2, 2, 16, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    for idx in (torch.int32, torch.int64):
        slots = torch.zeros(4, dtype=idx)
        yield (
            f"store_kv slots {idx}",
            lambda slots=slots: kt.store_kv(k, k, pool[:, 0, 0], pool[:, 0, 1], slots),
        )
        ids = torch.zeros(2, dtype=idx)
        yield f"gather_blocks ids {idx}", lambda ids=ids: kt.gather_blocks(pool, ids)
        yield f"scatter_blocks ids {idx}", lambda ids=ids: kt.scatter_blocks(pool[:2], pool, ids)
        yield f"copy_blocks ids {idx}", lambda ids=ids: kt.copy_blocks(pool, ids, ids)
    slots = torch.zeros(4, dtype=torch.int64)
    for codes in (INT8, FP8):
        pool8 = torch.zeros(8, 2, 2, 16, 8, 130, dtype=codes)
        yield (
            f"store_kv {str(codes).removeprefix('torch.')} KV",
            lambda p=pool8: kt.store_kv(k, k, p[:, 0, 0], p[:, 0, 1], slots),
        )
    yield from quant_linear_cases(full)
    yield from fused_moe_cases(full)
    yield from lora_cases(full)
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        # `--deterministic`'s GEMM: one launch shape; the bias and fp32 sums are variants
        x, w = torch.zeros(4, 576, dtype=dt), torch.zeros(192, 576, dtype=dt)
        bias = torch.zeros(192, dtype=dt)
        yield f"batch_invariant_linear {dt}", lambda x=x, w=w: kt.batch_invariant_linear(x, w)
        yield (f"batch_invariant_linear bias {dt}",
               lambda x=x, w=w, b=bias: kt.batch_invariant_linear(x, w, b))  # fmt: skip
        yield (f"batch_invariant_linear fp32_out {dt}",
               lambda x=x, w=w: kt.batch_invariant_linear(x, w, None, True))  # fmt: skip


def lora_cases(full: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """The LoRA shrink and expand of a mixed batch at Llama-3.1-8B's shapes (hidden
    4096, a fused q/k/v of 6144 in three slices, down_proj from 14336 in one), rank 16
    in 8 slots, a decode batch and a prompt chunk."""
    import kernels.triton as kt

    h, kv, inter, rank, slots = 4096, 1024, 14336, 16, 8
    shapes = {"qkv": (h, (0, h, h + kv, h + 2 * kv)), "down": (inter, (0, h))}
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        for name, (k, bounds) in shapes.items():
            j, n = len(bounds) - 1, bounds[-1]
            a = torch.zeros(slots, j * rank, k, dtype=dt)
            b = torch.zeros(slots, rank, n, dtype=dt)
            for rows in (32, 256):
                x, out = torch.zeros(rows, k, dtype=dt), torch.zeros(rows, n, dtype=dt)
                idx = torch.zeros(rows, dtype=torch.int64)
                yield (
                    f"lora {name} {dt} rows={rows}",
                    lambda x=x, out=out, a=a, b=b, i=idx, bd=bounds: kt.lora_add_(
                        out, x, a, b, i, bd
                    ),
                )


def fused_moe_cases(full: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """The mixture of experts' grouped GEMM (gate/up, then down) at Qwen3-30B-A3B's
    shapes (128 experts of 768, hidden 2048), a decode token's 8 experts and a batch."""
    import kernels.triton as kt
    from kernels import moe

    e, i, h = 128, 768, 2048
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        w13, w2 = torch.zeros(e, 2 * i, h, dtype=dt), torch.zeros(e, h, i, dtype=dt)
        for tokens in (1, 64):
            x = torch.zeros(tokens, h, dtype=dt)
            weights, ids = moe.route(torch.randn(tokens, e), 8, True)
            yield (
                f"fused_moe {dt} tokens={tokens}",
                lambda x=x, w13=w13, w2=w2, weights=weights, ids=ids: kt.fused_moe(
                    x, w13, w2, weights, ids
                ),
            )


def quant_linear_cases(full: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """The quantized linear on each kept layout (q4 with fp16 / fp32 scales, q8 in
    groups of 32 / 16, f8 in 128x128 blocks and per channel, f8 also w8a8), a decode
    row and a batch, rounded and fp32 (the head)."""
    import kernels.triton as kt
    from kernels.quant import FP8, fp8_from_checkpoint, pack_q4, pack_q8

    n, k = 576, 1536
    codes4 = torch.zeros(n, k // 32, 32, dtype=torch.uint8)
    codes8 = torch.zeros(n, k, dtype=torch.int8)
    half = torch.zeros(n, k // 32, dtype=torch.float16)
    weights = {
        "q4 fp16": pack_q4(codes4, half, half, "Q4_1", k),
        "q4 fp32": pack_q4(codes4, half.float(), half.float(), "Q4_K", k),
        "q8 g32": pack_q8(codes8, half, 32, "Q8_0", k),
        "q8 g16": pack_q8(codes8, torch.zeros(n, k // 16), 16, "Q6_K", k),
        "f8 block": fp8_from_checkpoint(codes8.view(FP8), torch.zeros(5, k // 128), "b",
                                        (128, 128)),
        "f8 channel": fp8_from_checkpoint(codes8.view(FP8), torch.zeros(n), "c"),
    }
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        for rows in (1, 32):
            x = torch.zeros(rows, k, dtype=dt)
            for name, w in weights.items():
                for fp32 in (False, True) if rows == 1 else (False,):
                    for a8 in (False, True) if w.kind == "f8" else (False,):
                        yield (
                            f"quant_linear {name} {dt} rows={rows} fp32_out={fp32} a8={a8}",
                            lambda x=x, w=w, f=fp32, a=a8: kt.quant_linear(x, w, None, f, a),
                        )


@dataclass(frozen=True)
class Variant:
    """One distinct launch to compile: the kernel, its signature and specialization."""

    label: str  # the first case that launched it
    fn: Any
    sig: dict[str, str]
    consts: dict[str, Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]


# Distinct variants `cases` launches: the CI set, and with --full. They change when the
# cases or a launcher's tile choice change; update them then, knowing why.
EXPECTED_VARIANTS = {False: 68, True: 335}


def record_variants(full: bool) -> list[Variant]:
    """Run every launcher of `cases` with its kernels swapped for recorders; one
    `Variant` per distinct launch."""
    from kernels.triton.record import record

    variants: dict[str, Variant] = {}
    for label, launch in cases(full):
        for fn, a, kw in record(launch):
            sig, consts, attrs, options = signature(fn, a, dict(kw))
            key = repr((fn.__name__, sig, consts, sorted(attrs), options))
            variants.setdefault(key, Variant(label, fn, sig, consts, attrs, options))
    return list(variants.values())


def check_variants(variants: list[Variant], expected: int) -> None:
    """Refuse to report success over nothing: no variants, or not the expected count,
    means the launchers no longer reach the kernels the way this script records them."""
    if not variants:
        raise RuntimeError(
            "no kernel variant was recorded: the launchers launched nothing (a kernel "
            "renamed or launched through another name escapes the recorders)"
        )
    if len(variants) != expected:
        raise RuntimeError(
            f"{len(variants)} kernel variants recorded, {expected} expected "
            "(compile_check.EXPECTED_VARIANTS)"
        )


# FP8 tensor-core dots (the w8a8 linear) exist from sm_89 (Ada, Hopper) on
FP8_MIN_ARCH = 89


def min_arch(v: Variant) -> int:
    """The oldest target a variant is for: w8a8's FP8 dots need sm_89."""
    return FP8_MIN_ARCH if v.consts.get("A8") else 0


def compile_variants(variants: list[Variant], archs: list[int]) -> tuple[int, int]:
    """Compile each variant for each target it is for, print one line per compilation
    (and per target skipped), and return (how many compiled and fit in shared memory,
    how many were not for their target)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = skipped = 0
    for v in variants:
        for arch in archs:
            if arch < min_arch(v):
                skipped += 1
                print(f"skip sm_{arch} {v.fn.__name__:26s} needs sm_{min_arch(v)}  [{v.label}]")
                continue
            src = ASTSource(v.fn, v.sig, constexprs=v.consts, attrs=v.attrs)
            try:
                c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=v.options)
            except Exception as e:
                print(f"FAIL sm_{arch} {v.fn.__name__} [{v.label}]: {type(e).__name__}: {e}")
                continue
            shared = c.metadata.shared
            ok = shared <= SHARED_LIMIT.get(arch, 99 * 1024) and "cubin" in c.asm
            compiled += ok
            print(
                f"{'ok  ' if ok else 'FAIL'} sm_{arch} {v.fn.__name__:26s} shared "
                f"{shared / 1024:6.1f} KiB  warps {c.metadata.num_warps}  [{v.label}]"
            )
    return compiled, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, action="append", help="SM version (default: 90)")
    ap.add_argument("--full", action="store_true", help="every dtype x head geometry x window")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check needs TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    import kernels.triton as kt

    assert not kt.INTERPRETED
    archs = args.arch or [90]
    t0 = time.time()
    variants = record_variants(args.full)
    try:
        check_variants(variants, EXPECTED_VARIANTS[args.full])
    except RuntimeError as e:
        print(f"FAIL {e}")
        return 1
    compiled, skipped = compile_variants(variants, archs)
    failures = len(variants) * len(archs) - compiled - skipped
    print(f"{len(variants)} variants x {len(archs)} targets in {time.time() - t0:.0f} s, "
          f"{compiled} compiled, {skipped} not for the target, {failures} failures")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fill Triton's cache ahead of time, with no GPU: `python -m engine.triton_warm
--arch 80,90 [--model NAME|PATH ...] [--kv-cache-dtype auto|int8|fp8 ...]` compiles,
for each SM version, the kernel variants a model of that geometry launches (decode and
prefill batches, split decode, the KV store, block copies, the quantized linears, the
LoRA shrink and expand, `--deterministic`'s GEMM, and a mixture of experts' grouped GEMMs)
into $TRITON_CACHE_DIR, for each KV cache dtype asked for (default: the model's). A
container image does this at build time, so pods do not stall compiling on their
first requests.

The launchers run on CPU tensors with their kernels recorded (`kernels.triton.record`),
and every recorded launch is replayed through the kernel's own `warmup` against a
stand-in driver reporting the target GPU, so the cache keys are the ones a launch on
that GPU computes (Triton's own specialization: dtypes, 16-byte alignment, integers
divisible by 16). A shape not covered here (an unusual batch) compiles on first use.

It lives in the engine, not in `kernels/`: it needs the engine's model geometry (the
shipped architectures, a checkpoint's config) to know which variants a model launches,
and `kernels/` imports nothing internal.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.config import KV_CACHE_DTYPES, ModelConfig
from kernels.paged import PagedBatch, PagedLayer
from kernels.triton.record import Launch, record

# Multiprocessors of the usual part of each SM version (split decode sizes by them).
SMS = {80: 108, 86: 84, 89: 128, 90: 132, 100: 148}
BATCHES = (1, 3, 8, 16, 32, 64, 128)  # decode batch sizes (variants: divisibility by 16)
PROMPTS = (17, 64, 500)  # prefill query lengths
DEFAULT_MODELS = ("Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-7B", "Qwen2.5-72B")


def model_config(name: str) -> ModelConfig:
    """A shipped architecture (engine.sim's table) or a checkpoint's (path)."""
    from engine.sim.roofline import models

    shipped = models()
    if name in shipped:
        return shipped[name]
    from engine.weights import load_model_config

    return load_model_config(name)


def _all(*calls: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def cases(
    cfg: ModelConfig, dtype: torch.dtype, block_size: int, sms: int, kv_cache_dtype: str = "auto"
) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, launcher calls) for what one forward of `cfg` launches, laid out as the
    engine lays it out (qkv split views, the [blocks, layers, 2, slot, head, dim] pool,
    its rows quantized for an int8 / fp8 `kv_cache_dtype`)."""
    import kernels.triton as kt
    from kernels import kv_quant
    from kernels.triton.split_decode import splits_for

    heads, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if kv_cache_dtype == "auto":
        pool = torch.zeros(4, 1, 2, block_size, kvh, d, dtype=dtype)
    else:
        codes = getattr(torch, kv_quant.POOL_DTYPES[kv_cache_dtype])
        pool = torch.zeros(4, 1, 2, block_size, kvh, kv_quant.row_width(d), dtype=codes)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    layer = PagedLayer(kc, vc, d**-0.5, cfg.sliding_window)
    for t in sorted({*BATCHES, *PROMPTS}):  # the per-token kernels at each token count
        x = torch.zeros(t, cfg.hidden_size, dtype=dtype)
        w = torch.zeros(cfg.hidden_size, dtype=dtype)
        qkv = torch.zeros(t, cfg.q_size + 2 * cfg.kv_size, dtype=dtype)
        q, k, v = torch.split(qkv, [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, k, v = q.view(t, heads, d), k.view(t, kvh, d), v.view(t, kvh, d)
        cos = torch.zeros(t, d // 2)
        gate_up = torch.zeros(t, 2 * cfg.intermediate_size, dtype=dtype)
        yield (
            f"layer t={t}",
            _all(
                partial(kt.rms_norm, x, x, w, 1e-6),
                partial(kt.rms_norm, x, None, w, 1e-6),
                partial(kt.rotary_, q, cos, cos),
                partial(kt.rotary_, k, cos, cos),
                partial(kt.silu_and_mul, gate_up),
                partial(kt.store_kv, k, v, kc, vc, torch.zeros(t, dtype=torch.int64)),
            ),
        )
    for n in BATCHES:  # decode: one query token per sequence
        for seq_len in (100, 4096):
            lens = torch.full((n,), seq_len, dtype=torch.int32)
            batch = PagedBatch(lens, torch.zeros(n, 4, dtype=torch.int32), None, 1, seq_len)
            qd = torch.zeros(n, heads, d, dtype=dtype)
            splits = splits_for(n, kvh, seq_len, sms)
            yield (
                f"decode n={n} len={seq_len}",
                _all(partial(kt.unified_attention, qd, layer, batch, num_splits=splits)),
            )
    for t in PROMPTS:  # prefill: one sequence of t new tokens
        lens, qsl = torch.tensor([t], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32)
        batch = PagedBatch(lens, torch.zeros(1, 4, dtype=torch.int32), qsl, t, max_seq_len=t)
        qp = torch.zeros(t, heads, d, dtype=dtype)
        yield f"prefill t={t}", _all(partial(kt.unified_attention, qp, layer, batch))
    yield from quant_linear_cases(cfg, dtype)
    yield from lora_cases(cfg, dtype)
    yield from deterministic_cases(cfg, dtype)
    if cfg.num_experts:
        yield from moe_cases(cfg, dtype)
    ids = torch.zeros(2, dtype=torch.int64)
    yield (
        "block copies",
        _all(
            partial(kt.gather_blocks, pool, ids),
            partial(kt.scatter_blocks, pool[:2], pool, ids),
            partial(kt.copy_blocks, pool, ids, ids),
        ),
    )


def quant_linear_cases(
    cfg: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, Callable[[], None]]]:
    """The quantized linears (`--quantization`) at decode sizes: q4 with fp16 scales
    (GGUF Q4_0 / Q4_1, int4) and q8 in groups of 32 (Q8_0), the model's qkv and down
    shapes, and the head's fp32 sums. The weights are uninitialised stand-ins (only
    their shapes and dtypes reach the cache keys)."""
    import kernels.triton as kt
    from kernels.quant import QuantTensor

    def weight(kind: str, n: int, k: int) -> QuantTensor:
        tiles, blocks = -(-n // 8), -(-k // 32)
        scales = torch.empty(tiles, blocks, 8, dtype=torch.float16)
        if kind == "q4":
            codes = torch.empty(tiles, blocks, 4, 8, 4, dtype=torch.uint8)
            return QuantTensor("q4", "Q4_0", (n, k), codes, scales, scales.clone(), 32)
        codes = torch.empty(tiles, blocks, 8, 8, 4, dtype=torch.int8)
        return QuantTensor("q8", "Q8_0", (n, k), codes, scales, None, 32)

    shapes = [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
              (cfg.hidden_size, cfg.intermediate_size)]  # fmt: skip
    for kind in ("q4", "q8"):
        ws = [weight(kind, n, k) for n, k in shapes]
        for t in (1, 3, 16, 32):
            xs = [torch.zeros(t, k, dtype=dtype) for _, k in shapes]
            calls = [partial(kt.quant_linear, x, w) for x, w in zip(xs, ws, strict=True)]
            if t <= 3:
                calls.append(partial(kt.quant_linear, xs[0], ws[0], None, True))
            yield f"quant_linear {kind} t={t}", _all(*calls)


def deterministic_cases(
    cfg: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, Callable[[], None]]]:
    """`--deterministic`'s GEMM (`kernels/triton/matmul.py`) at the model's linear
    shapes and the head's fp32 sums, for row counts of both parities of 16 (its
    attention is the decode tile, warmed above). Uninitialised stand-in weights."""
    import kernels.triton as kt

    h = cfg.hidden_size
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]  # fmt: skip
    head = torch.empty(cfg.vocab_size, h, dtype=dtype)
    for t in (3, 32):
        calls = [partial(kt.batch_invariant_linear, torch.zeros(t, k, dtype=dtype),
                         torch.empty(n, k, dtype=dtype)) for n, k in shapes]  # fmt: skip
        calls.append(partial(kt.batch_invariant_linear, torch.zeros(t, h, dtype=dtype), head,
                             None, True))  # fmt: skip
        yield f"deterministic linears t={t}", _all(*calls)


def lora_cases(cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], None]]]:
    """The LoRA deltas of a mixed batch (`kernels/triton/lora.py`, `--enable-lora`) on
    the model's fused q/k/v (three slices) and down projection, rank 16 in 4 slots, a
    decode batch and a prompt chunk (uninitialised stand-in weights)."""
    import kernels.triton as kt

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    rank, slots = 16, 4
    for k, bounds in ((h, (0, q, q + kv, q + 2 * kv)), (inter, (0, h))):
        a = torch.empty(slots, (len(bounds) - 1) * rank, k, dtype=dtype)
        b = torch.empty(slots, rank, bounds[-1], dtype=dtype)
        for t in (32, 500):
            x, out = torch.zeros(t, k, dtype=dtype), torch.zeros(t, bounds[-1], dtype=dtype)
            idx = torch.zeros(t, dtype=torch.int64)
            launch = partial(kt.lora_add_, out, x, a, b, idx, bounds)
            yield f"lora n={bounds[-1]} t={t}", _all(launch)


def moe_cases(cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], None]]]:
    """A mixture of experts' grouped GEMMs (`kernels/triton/fused_moe.py`) at the
    model's expert shapes, a decode token and a batch. The stacked weights are
    uninitialised (`torch.empty` leaves the pages untouched)."""
    import kernels.triton as kt
    from kernels import moe

    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w13, w2 = torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)
    for t in (1, 64):
        x = torch.zeros(t, h, dtype=dtype)
        weights, ids = moe.route(torch.randn(t, e), cfg.num_experts_per_tok, True)
        yield f"fused_moe t={t}", _all(partial(kt.fused_moe, x, w13, w2, weights, ids))


class _Mock:
    """A tensor as Triton's specialization sees it: dtype, and a data pointer with the
    tensor's byte offset into its storage (device allocations are 256-byte aligned)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._offset = int(t.storage_offset()) * t.element_size()

    def data_ptr(self) -> int:
        return (1 << 20) + int(self._offset)


class _TargetDriver:
    """The parts of Triton's active driver a warmup asks for, reporting `arch`."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def warm(launches: list[Launch], arch: int) -> int:
    """Compile each launch for `arch` into the cache; returns how many were compiled."""
    from triton.runtime import driver

    previous = driver._active  # None until something asked (reset_active would probe)
    driver.set_active(_TargetDriver(arch))
    try:
        for fn, args, kwargs in launches:
            mocked = [_Mock(a) if isinstance(a, torch.Tensor) else a for a in args]
            fn.warmup(*mocked, grid=(1,), **kwargs)
    finally:
        driver._active = previous
    return len(launches)


def _spec(a: Any) -> Any:
    """What Triton specializes an argument on (a superset: no variant is missed)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.storage_offset() * a.element_size() % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return (type(a).__name__, a if isinstance(a, bool) else None)
    return ("int", a % 16 == 0, a == 1, -(2**31) <= a < 2**31)


def distinct(launches: list[Launch]) -> list[Launch]:
    """One launch per kernel and specialization (what a cache entry is keyed by)."""
    out: dict[str, Launch] = {}
    for fn, args, kwargs in launches:
        key = repr((fn.__name__, [_spec(a) for a in args], sorted(kwargs.items())))
        out.setdefault(key, (fn, args, kwargs))
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90", help="SM versions, comma-separated (80,90)")
    ap.add_argument("--model", action="append", help=f"architectures (default {DEFAULT_MODELS})")
    ap.add_argument("--dtype", action="append", help="KV/activation dtypes (default bfloat16)")
    ap.add_argument("--block-size", type=int, action="append", help="KV block sizes (16)")
    ap.add_argument("--kv-cache-dtype", action="append", choices=KV_CACHE_DTYPES,
                    help="KV cache dtypes (default auto: the model's)")  # fmt: skip
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("engine.triton_warm needs TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    archs = [int(a) for a in args.arch.split(",")]
    cache = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    t0 = time.time()
    configs = [model_config(name) for name in args.model or DEFAULT_MODELS]
    grid = list(itertools.product(configs, args.dtype or ["bfloat16"], args.block_size or [16],
                                  args.kv_cache_dtype or ["auto"]))  # fmt: skip
    for arch in archs:
        launches: list[Launch] = []
        for cfg, dt, bs, kv in grid:
            for _, launch in cases(cfg, getattr(torch, dt), bs, SMS.get(arch, 132), kv):
                launches += record(launch)
        variants = distinct(launches)
        if not variants:
            print("FAIL: no kernel launch was recorded", file=sys.stderr)
            return 1
        warm(variants, arch)
        print(f"sm_{arch}: {len(variants)} kernel variants compiled into {cache}", flush=True)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

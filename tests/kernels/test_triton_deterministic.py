"""`--deterministic` on the Triton path: the batch-invariant GEMM (one launch shape
for every row count) and attention (every token a decode row, never split) give each
row the same bits alone and in any batch, close to the references; and the engine on
those kernels gives a request the same logits alone, beside others over its cached
prefix, and in chunks. Through Triton's interpreter on CPU here (fp32/fp16), compiled
on a GPU by scripts/gpu-check (bf16 too)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.paged import PagedBatch, PagedLayer
from tests.kernels.conftest import DEVICE, DTYPES, KT, TOL, needs_triton
from tests.kernels.mma_dot import mma_dot
from tests.kernels.paged import make_step, reference_attention
from tests.kernels.test_triton_engine import ROOT, _checkpoint

pytestmark = [needs_triton, pytest.mark.slow]


@pytest.fixture(autouse=True)
def gpu_like_dot() -> Iterator[None]:
    """On CPU the interpreter's `tl.dot` gets a GPU's row-alike sums (tests/kernels/mma_dot.py)."""
    if DEVICE.type == "cuda":
        yield
        return
    with mma_dot():
        yield


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_are_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    assert KT is not None
    g = torch.Generator().manual_seed(0)
    m, n, k = 70, 96, 200  # K's tail is not a whole step; M spans two row tiles
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    full = KT.batch_invariant_linear(x, w, bias)
    want = x.float() @ w.float().T + bias.float()
    assert (full.float() - want).abs().max().item() <= TOL[dtype] * 10
    for lo, hi in [(0, 1), (69, 70), (5, 6), (3, 40), (31, 70), (63, 66)]:
        assert torch.equal(KT.batch_invariant_linear(x[lo:hi], w, bias), full[lo:hi]), (lo, hi)
    sums = KT.batch_invariant_linear(x, w, None, fp32_out=True)
    assert sums.dtype == torch.float32
    assert torch.equal(KT.batch_invariant_linear(x[9:10], w, None, fp32_out=True), sums[9:10])
    assert KT.batch_invariant_linear(x.view(7, 10, k), w).shape == (7, 10, n)
    assert KT.batch_invariant_linear(x[:0], w).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_linear_rows_are_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """A weight kept int8 at one tile height: a row alone, among 17 (over the default's
    16-row tile) and among 40."""
    from kernels.quant import quantize_int8

    assert KT is not None
    g = torch.Generator().manual_seed(2)
    w = quantize_int8(torch.randn(96, 128, generator=g) / 128**0.5).to(DEVICE)
    x = torch.randn(40, 128, generator=g).to(dtype).to(DEVICE)
    full = KT.quant_linear(x, w, fixed_tile=True)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (23, 40)]:
        assert torch.equal(KT.quant_linear(x[lo:hi], w, fixed_tile=True), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_rows_are_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """A mixed batch of two adapters and the base (slot -1), fused q/k/v slices."""
    assert KT is not None
    g = torch.Generator().manual_seed(1)
    t, k, rank, bounds = 21, 96, 16, (0, 64, 96, 128)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    a = (torch.randn(2, 3 * rank, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = (torch.randn(2, rank, 128, generator=g) * 0.1).to(dtype).to(DEVICE)
    base = torch.randn(t, 128, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([i % 3 - 1 for i in range(t)], dtype=torch.int32, device=DEVICE)
    full = base.clone()
    KT.lora_add_(full, x, a, b, slots, bounds)
    for keep in ([4], [5], [3, 4, 5], list(range(7, 19)), [20, 1]):
        part = base[keep].clone()
        KT.lora_add_(part, x[keep], a, b, slots[keep], bounds)
        assert torch.equal(part, full[keep]), keep


def _rows(step: Any, keep: list[int]) -> tuple[PagedBatch, torch.Tensor]:
    """The rows of tokens `keep` of a step: each token's causal length and sequence."""
    lens, seqs = [], []
    qsl = step.query_start_loc.tolist()
    for i, (lo, hi) in enumerate(itertools.pairwise(qsl)):
        ctx = int(step.seq_lens[i]) - (hi - lo)
        for t in range(lo, hi):
            lens.append(ctx + t - lo + 1)
            seqs.append(i)
    dev = step.q.device
    batch = PagedBatch(
        seq_lens=torch.tensor([lens[t] for t in keep], dtype=torch.int32, device=dev),
        block_table=step.block_table,
        max_seq_len=max(lens[t] for t in keep),
    )
    return batch, torch.tensor([seqs[t] for t in keep], dtype=torch.int32, device=dev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3])
def test_attention_rows_are_the_same_bits_in_any_step(dtype: torch.dtype, gqa: int) -> None:
    """A prompt of 40 tokens, a chunk over a cached prefix, decodes: each token's row
    alone, inside its own chunk, or beside the others, is the same bits."""
    assert KT is not None
    bs = 16
    step = make_step([(0, 40), (2 * bs + 2, 1), (bs + 2, 9), (0, 1)], block_size=bs,
                     head_dim=64, kv_heads=2, group=gqa, dtype=dtype, device=DEVICE)  # fmt: skip
    KT.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slots)
    t = step.num_tokens
    layer = PagedLayer(step.k_cache, step.v_cache, 64**-0.5, None)
    q = step.q[:t]
    every = list(range(t))
    full = KT.det_attention(q, layer, *_rows(step, every))
    want = reference_attention(step, 64**-0.5, None)
    assert (full.float().cpu() - want).abs().max().item() <= TOL[dtype] * 10
    for keep in ([39], [0], [30, 31, 32, 39], [40], [41, 44, 49], [50, 39, 7]):
        got = KT.det_attention(q[keep], layer, *_rows(step, keep))
        assert torch.equal(got, full[keep]), keep
    # the engine's form: the block table a row a token, no row_seq
    batch, seqs = _rows(step, every)
    per_token = PagedBatch(batch.seq_lens, step.block_table[seqs.long()],
                           max_seq_len=batch.max_seq_len)  # fmt: skip
    assert torch.equal(KT.det_attention(q, layer, per_token, None), full)


def _engine_results(path: Path, deterministic: bool, tmp: Path) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DIPTYCH_KERNELS")}
    env["DIPTYCH_KERNELS"] = "triton"
    if DEVICE.type != "cuda":
        env["TRITON_INTERPRET"] = "1"
    out = tmp / f"det-{int(deterministic)}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.det_engine_child", str(path), str(DEVICE),
         str(int(deterministic)), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    assert res["kernels"] == "triton"
    results: dict[str, dict[str, Any]] = res["results"]
    return results


def test_engine_logits_are_the_same_alone_batched_cached_and_chunked(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "llama-gqa")
    res = _engine_results(path, True, tmp_path)
    alone = res.pop("alone")
    for case, r in res.items():
        assert r["tokens"] == alone["tokens"], case
        assert torch.equal(r["logits"], alone["logits"]), case

"""The int8 and fp8 KV caches (kernels/kv_quant.py): the row formats, the C++ and
Triton stores against the torch one, and every attention path over quantized caches
against attention over the same values dequantized in fp32.

Pools are built by `tests.kernels.paged.make_step` (NaN outside every sequence's
context) and then quantized: a NaN row gets a NaN scale, so a kernel that reads a
row it should not still turns its output into NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.attention.backend import BatchLayout, TorchAttention
from kernels import cpu_ops, kv_quant, ops, reference
from kernels.paged import PagedBatch, PagedLayer
from tests.kernels.conftest import DEVICE, KT, needs_triton
from tests.kernels.paged import PagedStep, make_step

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
CODES = [torch.int8, FP8]
needs_cpu_ops = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available() and os.environ.get("DIPTYCH_REQUIRE_CPU_OPS") != "1",
    reason="no C++ toolchain to build the CPU ops",
)


def test_rows_hold_codes_then_an_fp16_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0]])
    rows = kv_quant.quantize(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (2, 6)
    scale = float(torch.tensor(1.27 / 127, dtype=torch.float16))
    assert kv_quant.scales(rows)[0].item() == scale
    assert rows[0, :4].tolist() == [round(0.5 / scale), -127, 0, round(0.01 / scale)]
    assert rows[1].tolist() == [0] * 6  # an all-zero row: scale 0, codes 0
    assert torch.equal(kv_quant.dequantize(rows[1:], torch.float32), x[1:])


def test_fp8_rows_hold_e4m3_codes_then_an_fp16_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0]])
    rows = kv_quant.quantize(x, FP8)
    assert rows.dtype == FP8 and rows.shape == (2, 6)
    scale = float(torch.tensor(1.27 / 448, dtype=torch.float16))
    assert kv_quant.scales(rows)[0].item() == scale
    codes = rows[0, :4].view(torch.uint8).tolist()
    assert codes[1] == 0xFE  # -448: sign, exponent 15, mantissa 6
    assert codes[2] == 0
    # 0.5 / scale lies between two e4m3 values; the nearer one is kept
    got = float(rows[0, 0].float()) * scale
    assert abs(got - 0.5) <= 0.5 * 2**-4
    assert rows[1].view(torch.uint8).tolist() == [0] * 6
    assert kv_quant.row_width(64) == 66


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_bounded(codes: torch.dtype, dtype: torch.dtype) -> None:
    """int8: half a step (the scale) for every value; fp8: 2^-4 of the value (three
    mantissa bits), or half a subnormal step (2^-10 of the scale) near zero."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 64, generator=g) * torch.logspace(-3, 2, 64)).to(dtype)
    rows = kv_quant.quantize(x, codes)
    step = kv_quant.scales(rows).float()[..., None]
    xf = x.float()
    err = (kv_quant.dequantize(rows, torch.float32) - xf).abs()
    if codes == torch.int8:
        bound = step * 0.5 + 1e-6 * xf.abs()
    else:
        bound = torch.maximum(xf.abs() * 2**-4, step * 2**-10) * (1 + 1e-3)
    assert bool((err <= bound).all())
    assert kv_quant.row_width(64) == rows.shape[-1] == 66


@needs_cpu_ops
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_store_equals_the_torch_store(codes: torch.dtype, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    pool = torch.zeros(6, 2, 2, 16, 2, 66, dtype=codes)  # [blocks, layers, kv, block, h, d+2]
    ref = pool.clone()
    k = (torch.randn(5, 2, 64, generator=g) * 4).to(dtype)
    v = torch.randn(5, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([17, -1, 40, 95, 3])
    torch.ops.diptych_cpu.store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    reference.store_kv(k, v, ref[:, 1, 0], ref[:, 1, 1], slots)
    assert torch.equal(pool.view(torch.uint8), ref.view(torch.uint8))
    assert pool[:, 0].view(torch.uint8).sum() == 0  # the other layer is untouched
    narrow = pool[..., :64]  # rows without room for the scale
    with pytest.raises(RuntimeError, match="head geometry"):
        torch.ops.diptych_cpu.store_kv(k, v, narrow[:, 1, 0], narrow[:, 1, 1], slots)


def _quant_step(
    seqs: list[tuple[int, int]],
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    codes: torch.dtype = torch.int8,
) -> PagedStep:
    step = make_step(
        seqs, block_size=16, head_dim=head_dim, kv_heads=2, group=group,
        dtype=torch.float32, device=CPU, index_dtype=index_dtype, seed=seed,
    )  # fmt: skip
    step.pool = kv_quant.quantize(step.pool, codes)
    step.q = step.q.to(dtype)
    step.k, step.v = step.k.to(dtype), step.v.to(dtype)
    return step


def _oracle(step: PagedStep, scale: float, window: int | None) -> torch.Tensor:
    """fp32 attention over the quantized pool's values, this step's K/V stored
    quantized."""
    pool = step.pool.clone()
    reference.store_kv(step.k, step.v, pool[:, 1, 0], pool[:, 1, 1], step.slots)
    values = kv_quant.dequantize(pool, torch.float32)
    t = step.num_tokens
    layer = PagedLayer(values[:, 1, 0], values[:, 1, 1], scale, window)
    return reference.unified_attention(step.q[:t].float(), layer, step.batch)


@needs_cpu_ops
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (2, 128)])
@pytest.mark.parametrize("window", [None, 21])
def test_cpu_decode_kernel_reads_quantized_caches(
    codes: torch.dtype,
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    group: int,
    head_dim: int,
    window: int | None,
) -> None:
    seqs = [(0, 1), (16, 1), (47, 1), (130, 1)]
    step = _quant_step(seqs, group, head_dim, dtype, index_dtype, codes=codes)
    scale = head_dim**-0.5
    kc, vc = step.pool[:, 1, 0], step.pool[:, 1, 1]
    ops.store_kv(step.k, step.v, kc, vc, step.slots.long())
    batch = PagedBatch(step.seq_lens, step.block_table, max_seq_len=step.max_seq_len)
    got = cpu_ops.paged_decode_attention(step.q, PagedLayer(kc, vc, scale, window), batch)
    want = _oracle(step, scale, window)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_step_over_quantized_caches(codes: torch.dtype, dtype: torch.dtype) -> None:
    """A mixed step (decodes, a fresh prompt, a chunk after a cached prefix) through
    the torch backend and `ops.unified_attention`'s ragged reference, both quantized."""
    seqs = [(20, 1), (33, 1), (0, 9), (35, 7)]
    step = _quant_step(seqs, 2, 64, dtype, torch.int64, seed=3, codes=codes)
    scale = 0.125
    want = _oracle(step, scale, None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    pool = step.pool.clone()
    layout = BatchLayout.build(
        [n for _, n in seqs], [c for c, _ in seqs],
        [[int(b) for b in row if b] for row in step.block_table], 16, CPU,
    )  # fmt: skip
    backend = TorchAttention(4, 2, 64, scale)
    t = step.num_tokens
    got = backend.forward(step.q[:t], step.k[:t], step.v[:t], pool[:, 1], backend.prepare(layout))
    # the fresh prompt attends over its own unquantized K/V, as on every path
    fresh = slice(int(step.query_start_loc[2]), int(step.query_start_loc[3]))
    keep = torch.ones(t, dtype=torch.bool)
    keep[fresh] = False
    torch.testing.assert_close(got.view(t, 4, 64)[keep].float(), want[keep], atol=tol, rtol=tol)

    pool = step.pool.clone()
    ops.store_kv(step.k[:t], step.v[:t], pool[:, 1, 0], pool[:, 1, 1], step.slots[:t])
    layer = PagedLayer(pool[:, 1, 0], pool[:, 1, 1], scale)
    ragged = ops.unified_attention(step.q[:t], layer, step.batch)
    torch.testing.assert_close(ragged.float(), want, atol=tol, rtol=tol)


@needs_cpu_ops
@pytest.mark.parametrize("codes", CODES)
def test_decode_kernel_refuses_a_row_width_that_is_not_head_dim_plus_scale(
    codes: torch.dtype,
) -> None:
    step = _quant_step([(5, 1)], 1, 64, torch.float32, codes=codes)
    kc = step.pool[:, 1, 0, ..., :64]
    batch = PagedBatch(step.seq_lens, step.block_table)
    with pytest.raises(RuntimeError, match="head dims differ"):
        cpu_ops.paged_decode_attention(step.q[:1], PagedLayer(kc, kc, 1.0), batch)


# -- Triton: the same checks through Triton's interpreter on CPU, compiled on a GPU --


@needs_triton
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_store_equals_the_torch_store(codes: torch.dtype, dtype: torch.dtype) -> None:
    assert KT is not None
    g = torch.Generator().manual_seed(5)
    pool = torch.zeros(6, 2, 2, 16, 3, 66, dtype=codes, device=DEVICE)
    ref = pool.clone()
    k = (torch.randn(7, 3, 64, generator=g) * 4).to(dtype).to(DEVICE)
    v = torch.randn(7, 3, 64, generator=g).to(dtype).to(DEVICE)
    k[2, 1] = 0.0  # an all-zero row: scale 0
    k[3, 0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0], dtype=dtype)  # exact int8 ties
    # a row of 448 (its scale 1) and e4m3 ties: at 2^-6 and above, and subnormal
    k[4, 2, :6] = torch.tensor([448.0, 17.0, -19.0, 2**-6 + 2**-10, 1.5 * 2**-9, -(2.5 * 2**-9)])
    k[4, 2, 6:] = 0.0
    slots = torch.tensor([17, -1, 40, 95, 3, 64, 80], device=DEVICE)
    KT.store_kv(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    reference.store_kv(k, v, ref[:, 1, 0], ref[:, 1, 1], slots)
    scales_got, scales_want = kv_quant.scales(pool), kv_quant.scales(ref)
    assert torch.equal(scales_got, scales_want)
    # the interpreter divides as torch does; a GPU's division may land a code one off
    # (e4m3 codes are ordered by magnitude, so one off is one step of the format)
    got, want = pool[..., :64], ref[..., :64]
    if codes == FP8:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert int((got.int() - want.int()).abs().max()) <= (0 if DEVICE.type == "cpu" else 1)
    assert pool[:, 0].view(torch.uint8).sum() == 0


@needs_triton
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [None, 2])
def test_triton_attention_over_quantized_caches(
    codes: torch.dtype, dtype: torch.dtype, splits: int | None
) -> None:
    """A ragged step (prefill, a chunk after a cached prefix, decodes), and a decode
    batch through the plain and the split-KV kernels."""
    assert KT is not None
    ragged = [(0, 5), (34, 1), (18, 9), (0, 1), (15, 1)]
    decodes = [(40, 1), (3, 1), (70, 1)]
    seqs = ragged if splits is None else decodes
    step = _quant_step(seqs, 2, 64, dtype, seed=7, codes=codes)
    for name in ("q", "k", "v", "pool", "seq_lens", "block_table", "slots", "query_start_loc"):
        setattr(step, name, getattr(step, name).to(DEVICE))
    scale = 0.125
    want = _oracle(_on_cpu(step), scale, None)
    kc, vc = step.pool[:, 1, 0], step.pool[:, 1, 1]
    KT.store_kv(step.k, step.v, kc, vc, step.slots)
    t = step.num_tokens
    batch = step.batch if splits is None else PagedBatch(step.seq_lens, step.block_table)
    got = KT.unified_attention(step.q[:t], PagedLayer(kc, vc, scale), batch, num_splits=splits)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def _on_cpu(step: PagedStep) -> PagedStep:
    s = PagedStep(**step.__dict__)
    for name in ("q", "k", "v", "pool", "seq_lens", "block_table", "slots", "query_start_loc"):
        setattr(s, name, getattr(step, name).cpu())
    return s

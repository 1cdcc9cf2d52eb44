"""The kernels of `--deterministic` (engine/determinism.py): every output row is a
function of that row's own inputs, bit for bit, whatever rows share the call.

- The batch-invariant attention (`cpu_ops.det_attention`) matches the math, and a
  token's row is the same alone (a decode), inside its whole prompt, inside any chunk
  of it, beside other sequences, with its keys transposed (items of 8 or more rows) or
  not; also over int8 / fp8 caches, a sliding window and blocks of 8, 16 and 32. With
  AVX512-BF16 a bf16 cache's items of 8 or more rows take 16 rows at once, one a lane,
  held to the same, at several head dims; at the amx level the AMX kernel takes them.
- A linear on a weight packed with `fixed_order` gives each row the same bits at 1, 2,
  7, 15-17, 31-33, 63 and 200 rows (the AMX GEMM's tiles are 16 rows), with and
  without fp32 sums, and is within bf16's rounding of the fp32 product; a quantized one under
  `ops.deterministic` too, past the integer kernel's usual 64 rows; and a mixture of
  experts' token, however many rows its experts get.

The CI's forced ISA levels run this module (scripts/test), so each level's build is held
to it.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, kv_quant, ops
from kernels.paged import PagedBatch, PagedLayer
from kernels.quant import QuantTensor, quantize_int4, quantize_int8
from tests.kernels.test_cpu_ops import _reference
from tests.kernels.test_kv_quant import needs_cpu_ops

pytestmark = needs_cpu_ops

KVH, GQA = 2, 3


def _cache(bs: int, d: int, blocks: int, dtype: torch.dtype, kv: str, seed: int) -> PagedLayer:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, bs, KVH, d, generator=g)
    v = torch.randn(blocks, bs, KVH, d, generator=g)
    if kv == "model":
        return PagedLayer(k.to(dtype), v.to(dtype), d**-0.5, None)
    cache_dtype = torch.int8 if kv == "int8" else torch.float8_e4m3fn
    return PagedLayer(
        kv_quant.quantize(k, cache_dtype), kv_quant.quantize(v, cache_dtype), d**-0.5, None
    )


def _run(q: torch.Tensor, layer: PagedLayer, table: torch.Tensor, lens: list[int],
         seqs: list[int]) -> torch.Tensor:  # fmt: skip
    batch = PagedBatch(torch.tensor(lens, dtype=torch.int32), table, max_seq_len=max(lens))
    return cpu_ops.det_attention(q, layer, batch, torch.tensor(seqs, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["model", "int8", "fp8"])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 21])
def test_a_token_is_the_same_in_any_step(
    dtype: torch.dtype, kv: str, bs: int, window: int | None
) -> None:
    _same_in_any_step(dtype, kv, bs, window, d=64)


@pytest.mark.parametrize("d", [32, 96, 128])
def test_other_head_dims(d: int) -> None:
    _same_in_any_step(torch.bfloat16, "model", 16, None, d)


def _same_in_any_step(dtype: torch.dtype, kv: str, bs: int, window: int | None, d: int) -> None:
    n = 70
    nb = -(-n // bs)
    layer = _cache(bs, d, 2 * nb + 1, dtype, kv, seed=bs)
    layer = PagedLayer(layer.k_cache, layer.v_cache, layer.scale, window)
    # two sequences with their own blocks; the first is the one we follow
    table = torch.stack([torch.arange(1, nb + 1), torch.arange(nb + 1, 2 * nb + 1)]).int()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n, KVH * GQA, d, generator=g).to(dtype)
    other = torch.randn(n, KVH * GQA, d, generator=g).to(dtype)
    prompt = _run(q, layer, table, list(range(1, n + 1)), [0] * n)  # the whole prompt

    k, v = layer.k_cache, layer.v_cache
    if kv != "model":
        k, v = kv_quant.dequantize(k, torch.float32), kv_quant.dequantize(v, torch.float32)
    ref = _reference(q, k, v, table[[0] * n], torch.arange(1, n + 1), layer.scale, window)
    tol = 1e-5 if dtype == torch.float32 and kv == "model" else 2e-2
    assert (prompt.float() - ref).abs().max() < tol

    for p in (0, bs - 1, bs, n - 1):  # decodes: one row, keys not transposed
        one = _run(q[p : p + 1].contiguous(), layer, table, [p + 1], [0])
        assert torch.equal(one[0], prompt[p])
    for a, b in ((0, 5), (5, 37), (37, n)):  # chunks, the first of them short
        assert torch.equal(_run(q[a:b].contiguous(), layer, table, list(range(a + 1, b + 1)),
                                [0] * (b - a)), prompt[a:b])  # fmt: skip
    # decodes of the other sequence around a chunk of ours, in one call
    mixed = torch.cat([other[:3], q[40:52], other[3:4]])
    out = _run(mixed, layer, table, [9, 30, 61, *range(41, 53), 5], [1, 1, 1, *[0] * 12, 1])
    assert torch.equal(out[3:15], prompt[40:52])


def test_the_amx_level_attends_on_the_tile_unit() -> None:
    """A bf16 query over a bf16 cache with head dims a multiple of 32 takes the AMX
    kernel exactly where the level is amx (whose numerics key names it apart); every
    other case, and every other level, the portable one. The test above then holds
    whichever this CPU runs."""
    amx = cpu_ops.amx_gemm_available()
    assert cpu_ops.det_attention_on_amx(torch.bfloat16, torch.bfloat16, 64) == amx
    assert cpu_ops.det_attention_on_amx(torch.bfloat16, torch.bfloat16, 128) == amx
    assert not cpu_ops.det_attention_on_amx(torch.bfloat16, torch.bfloat16, 48)
    assert not cpu_ops.det_attention_on_amx(torch.float32, torch.float32, 64)
    assert not cpu_ops.det_attention_on_amx(torch.bfloat16, torch.int8, 64)
    assert not cpu_ops.det_attention_on_amx(torch.bfloat16, torch.float8_e4m3fn, 64)


def _rows(run: object, x: torch.Tensor) -> None:
    """Row i of every prefix x[:m] equals row i of the largest call, bit for bit."""
    assert callable(run)
    whole = run(x)
    for m in (1, 2, 7, 15, 16, 17, 31, 32, 33, 63):
        assert torch.equal(run(x[:m]), whole[:m]), m


@pytest.mark.parametrize("fp32_out", [False, True])
# 544 columns: 17 panels of the VNNI GEMM, whose few-row tiles take up to 4 at once
@pytest.mark.parametrize("shape", [(192, 576), (544, 576), (100, 96)])
def test_a_fixed_order_linear_is_the_same_at_every_row_count(
    fp32_out: bool, shape: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=g).to(torch.bfloat16)
    x = torch.randn(200, shape[1], generator=g).to(torch.bfloat16)
    bias = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    packed = cpu_ops.pack_linear_weight(w, fp32_out, fixed_order=True)
    assert packed.kind in ("amx", "vnni", "f32acc") and packed.serves_all_rows
    # the AMX GEMM wherever it runs and K is whole tiles of 32 (a shape's choice alone)
    amx = cpu_ops.amx_gemm_available() and shape[1] % 32 == 0 and shape[0] % 32 == 0
    assert (packed.kind == "amx") == amx
    with ops.deterministic():
        out = ops.linear(x, w.new_empty(0), bias, packed, True).float()
        ref = x.float() @ w.float().T + bias.float()
        assert (out - ref).abs().max() <= 1e-3 * ref.abs().max()  # fp32 sums of bf16 products
        _rows(lambda r: ops.linear(r, w.new_empty(0), bias, packed, fp32_out), x)
        # a verify step's row-invariant GEMV does not take over under it
        with ops.row_invariant(cpu_ops.SMALL_M_MAX):
            _rows(lambda r: ops.linear(r, w.new_empty(0), None, packed, fp32_out), x)


def test_a_deterministic_step_refuses_a_linear_it_cannot_fix() -> None:
    w = torch.randn(64, 64).to(torch.bfloat16)
    with ops.deterministic(), pytest.raises(RuntimeError, match="fixed-order"):
        ops.linear(torch.randn(4, 64).to(torch.bfloat16), w, None)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_quantized_linears_past_the_integer_kernels_rows(quantize: object) -> None:
    assert callable(quantize)
    g = torch.Generator().manual_seed(4)
    q: QuantTensor = quantize(torch.randn(128, 256, generator=g))
    x = torch.randn(200, 256, generator=g)
    with ops.deterministic():
        _rows(lambda r: ops.quant_linear(r, q, None, True), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tokens_experts_are_the_same_in_any_batch(dtype: torch.dtype) -> None:
    """A mixture of experts under `ops.deterministic`: a token's output is the same
    bits alone and among 200 tokens, however many rows its experts get (the grouped
    kernels switch from the GEMV to a GEMM past a few rows, in another order)."""
    g = torch.Generator().manual_seed(4)
    t, h, i, e, k = 200, 128, 96, 8, 2
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    weights, ids = torch.rand(t, k, generator=g), torch.randint(0, e, (t, k), generator=g)
    with ops.deterministic():
        full = ops.fused_moe(x, w13, w2, weights, ids)
        for keep in ([0], [17], [3, 9, 150], list(range(40, 90))):
            assert torch.equal(ops.fused_moe(x[keep], w13, w2, weights[keep], ids[keep]),
                               full[keep]), keep  # fmt: skip
    plain = ops.fused_moe(x, w13, w2, weights, ids)
    assert (plain.float() - full.float()).abs().max() < 0.05  # the same math
    if dtype == torch.float32:  # where the grouped path's orders show in the bits
        alone = [ops.fused_moe(x[j : j + 1], w13, w2, weights[j : j + 1], ids[j : j + 1])
                 for j in range(8)]  # fmt: skip
        assert not torch.equal(torch.cat(alone), plain[:8])

"""Weights kept quantized: GGUF blocks re-laid out exactly, and the C++ integer
dot-product kernel against an emulation of its arithmetic in float64."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.weights.dequant import dequantize
from engine.weights.gguf_quant import KEPT_TYPES, from_gguf
from kernels import cpu_ops, ops
from kernels.quant import QuantTensor, cat_rows, quantize_int4, quantize_int8

Q = GGMLQuantizationType
needs_cpu_ops = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available() and os.environ.get("DIPTYCH_REQUIRE_CPU_OPS") != "1",
    reason="no C++ toolchain to build the CPU ops",
)


def gguf_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """A GGUF tensor of `qtype` [rows, row bytes]: gguf-py's quantizer where it has one,
    else random valid blocks (`random_blocks`)."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1):
        dense = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return np.asarray(gguf_quants.quantize(dense, qtype))
    return random_blocks(rows, cols, qtype, seed)


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Valid random data for a type gguf-py cannot quantize (small positive scales)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scales = np.abs(rng.standard_normal((blocks.shape[0], 2)) * 0.02).astype(np.float16)
    if qtype == Q.Q6_K:  # d closes the block
        blocks[:, -2:] = scales[:, :1].view(np.uint8)
    else:  # d and dmin open it
        blocks[:, :4] = scales.view(np.uint8)
    return raw


# (type, columns): 3 blocks (odd) for the 32-value types, one super-block for K-quants
SHAPES = [
    (Q.Q4_0, 96), (Q.Q4_1, 96), (Q.Q8_0, 96), (Q.Q5_0, 96), (Q.Q4_K, 256), (Q.Q6_K, 256),
]  # fmt: skip


@pytest.mark.parametrize(("qtype", "cols"), SHAPES)
@pytest.mark.parametrize("rows", [8, 20])
def test_gguf_layout_is_exact(qtype: GGMLQuantizationType, cols: int, rows: int) -> None:
    raw = gguf_blocks(rows, cols, qtype, seed=rows)
    ref = torch.from_numpy(dequantize(raw, qtype))
    w = from_gguf(raw, qtype)
    assert w.kind == KEPT_TYPES[qtype] and w.shape == (rows, cols)
    assert torch.equal(w.dequantize(), ref)
    picked = torch.tensor([rows - 1, 0, 3, 3])
    assert torch.equal(w.dequantize_rows(picked, torch.float32), ref[picked])
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(from_gguf(raw, qtype, order).dequantize(), ref[order])
    if cpu_ops.cpu_ops_available():
        cpp = torch.ops.diptych_cpu.quant_dequantize(w.codes, w.scales, w.mins, w.group, rows,
                                                    torch.float32)  # fmt: skip
        assert torch.equal(cpp[:, :cols], ref)


def emulate(x: torch.Tensor, w: QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in float64: x quantized to int8 per 32 values (scale
    amax / 127, round half to even), exact integer dot products per weight group,
    times the scales; q4's mins times the activation block sums. Returns (y, a bound on
    fp32 summation error: 1e-5 of the sum of the terms' magnitudes)."""
    m, k = x.shape
    codes, scales, mins = w.unpacked()
    kp = codes.shape[1]
    xp = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // 32, 32)
    amax = xp.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    # torch.div, not 127 / amax: a tensor's __rtruediv__ multiplies by the reciprocal,
    # which can land an ulp away (24.499998 became 24.5, rounded to 25, once)
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), 0.0)
    q = torch.round(xp * inv).clamp(-127, 127).double()  # [M, blocks, 32]
    d = d.double()[..., 0]  # [M, blocks]
    g = w.group
    qg = q.reshape(m, kp // g, g)  # [M, groups, G]
    dots = torch.einsum("mgv,ngv->mng", qg, codes.double().view(-1, kp // g, g))
    dg = d.repeat_interleave(32 // g, dim=1)  # [M, groups]
    terms = dots * scales.double()[None] * dg[:, None, :]
    if mins is not None:
        sums = q.sum(-1) * d  # [M, blocks]
        terms = torch.cat([terms, mins.double()[None] * sums[:, None, :]], dim=-1)
    return terms.sum(-1), terms.abs().sum(-1) * 1e-5 + 1e-6


def _weights() -> list[QuantTensor]:
    out = [from_gguf(gguf_blocks(20, c, t, seed=i), t) for i, (t, c) in enumerate(SHAPES)]
    dense = torch.randn(44, 80, generator=torch.Generator().manual_seed(3))
    return [*out, quantize_int8(dense), quantize_int4(dense)]


@needs_cpu_ops
@pytest.mark.parametrize("w", _weights(), ids=lambda w: w.source)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_its_arithmetic(w: QuantTensor, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, w.shape[1], generator=gen) * 3).to(dtype)
    x[0, :7] = 0  # a block partly zero; with K=96 or 80 the last block is partial
    ref, tol = emulate(x, w)
    y = torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales, w.mins, w.group, w.shape[0], True)
    assert y.shape == (rows, w.shape[0])
    assert ((y.double() - ref).abs() <= tol).all()
    rounded = torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales, w.mins, w.group,
                                                w.shape[0], False)  # fmt: skip
    assert rounded.dtype == dtype and torch.equal(rounded, y.to(dtype))


@needs_cpu_ops
def test_zero_rows_and_padding_give_zero() -> None:
    w = from_gguf(gguf_blocks(13, 96, Q.Q4_1, seed=1), Q.Q4_1)
    y = ops.quant_linear(torch.zeros(2, 96), w)
    assert y.shape == (2, 13) and not y.any()


@needs_cpu_ops
@pytest.mark.parametrize("rows", [2, ops.QUANT_DOT_MAX_ROWS + 3])
def test_dispatch_close_to_the_dense_product(rows: int) -> None:
    """Both CPU paths (integer kernel, dequantize + dense) against x @ W^T in fp32: the
    activations' int8 rounding costs well under 1 %."""
    w = from_gguf(gguf_blocks(64, 256, Q.Q4_K, seed=5), Q.Q4_K)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(64)
    exact = x @ w.dequantize().T + bias
    y = ops.quant_linear(x.view(1, rows, 256), w, bias).view(rows, 64)
    assert (y - exact).norm() / exact.norm() < 1e-2


def test_int8_and_int4_round_to_the_nearest_level() -> None:
    w = torch.randn(24, 70, generator=torch.Generator().manual_seed(7))
    q8, q4 = quantize_int8(w), quantize_int4(w)
    scale8 = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q8.dequantize() - w).abs() <= scale8 / 2 + 1e-6).all()
    _, scales, _ = q4.unpacked()
    step = scales.float().repeat_interleave(32, dim=1)[:, :70]
    # half a level, plus the fp16 rounding of the group's min
    assert ((q4.dequantize() - w).abs() <= step / 2 + 2e-3).all()
    # K 70 is padded to 96: int4 is 0.5 byte a value + two fp16 per 32; int8 1 byte +
    # one fp32 scale per 32
    assert q4.nbytes == 24 * 96 * (0.5 + 4 / 32) and q8.nbytes == 24 * 96 * (1 + 4 / 32)


def test_stacked_parts_equal_the_parts() -> None:
    a = from_gguf(gguf_blocks(16, 256, Q.Q4_K, seed=1), Q.Q4_K)
    b = from_gguf(gguf_blocks(8, 256, Q.Q4_K, seed=2), Q.Q4_K)
    both = cat_rows([a, b])
    assert both.shape == (24, 256)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    odd = from_gguf(gguf_blocks(5, 256, Q.Q4_K, seed=3), Q.Q4_K)
    with pytest.raises(ValueError, match="whole row tiles"):
        cat_rows([odd, a])
    with pytest.raises(ValueError, match="one quantized layout"):
        cat_rows([a, from_gguf(gguf_blocks(8, 256, Q.Q6_K, seed=4), Q.Q6_K)])


@needs_cpu_ops
def test_bad_shapes_are_refused() -> None:
    w = from_gguf(gguf_blocks(8, 96, Q.Q4_0, seed=0), Q.Q4_0)
    with pytest.raises(RuntimeError, match="columns do not match"):
        torch.ops.diptych_cpu.quant_linear(torch.randn(1, 160), w.codes, w.scales, w.mins, 32, 8)
    with pytest.raises(RuntimeError, match="row count"):
        torch.ops.diptych_cpu.quant_linear(torch.randn(1, 96), w.codes, w.scales, w.mins, 32, 9)


def test_torch_reference_path_is_the_dense_product() -> None:
    """Off the C++ ops (another device, DIPTYCH_KERNELS=torch) the weight is dequantized
    and multiplied densely: the reference the integer kernel approximates."""
    from kernels.ops import Kernels, KernelSelection

    w = from_gguf(gguf_blocks(20, 96, Q.Q4_1, seed=2), Q.Q4_1)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    y = Kernels(KernelSelection("torch")).quant_linear(x, w, fp32_out=True)
    torch.testing.assert_close(y, x @ w.dequantize().T)

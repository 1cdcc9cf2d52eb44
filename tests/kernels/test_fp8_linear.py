"""FP8 (e4m3) weights kept as stored (`kernels.quant`, kind "f8"): each published scale
layout read exactly, the at-load quantizer's error, and the C++ kernel and the Triton
one against x @ the dequantized weight in float64."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from kernels import cpu_ops, ops
from kernels.quant import (
    FP8,
    FP8_MAX,
    QuantTensor,
    cat_rows,
    fp8_from_checkpoint,
    pack_q8,
    quantize_fp8,
)
from tests.kernels.conftest import DEVICE, DTYPES, KT, TOL, needs_triton

needs_cpu_ops = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available() and os.environ.get("DIPTYCH_REQUIRE_CPU_OPS") != "1",
    reason="no C++ toolchain to build the CPU ops",
)


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    """Random e4m3 codes over the whole range, subnormals and zeros included, no NaN."""
    raw = torch.randint(0, 256, (n, k), generator=torch.Generator().manual_seed(seed),
                        dtype=torch.uint8)  # fmt: skip
    raw[(raw & 0x7F) == 0x7F] = 0x7E  # 0x7F / 0xFF are e4m3fn's NaN
    return raw.view(FP8)


def _weights() -> list[QuantTensor]:
    """One f8 weight of each scale layout, at shapes with partial row tiles and K not
    a multiple of the group."""
    gen = torch.Generator().manual_seed(1)
    c = _codes(300, 200, 0)
    return [
        fp8_from_checkpoint(c[:20], torch.tensor(0.01), "per-tensor"),
        fp8_from_checkpoint(c[:44, :96], torch.rand(44, 1, generator=gen) * 0.01, "per-channel"),
        fp8_from_checkpoint(c, torch.rand(3, 2, generator=gen) * 0.01, "block", (128, 128)),
        quantize_fp8(torch.randn(36, 160, generator=gen)),
    ]


def test_each_scale_layout_dequantizes_exactly() -> None:
    c = _codes(300, 200, 0)
    values = c.float()
    per_tensor = fp8_from_checkpoint(c, torch.tensor([0.5]), "t")
    assert per_tensor.kind == "f8" and per_tensor.shape == (300, 200)
    assert per_tensor.group == 224  # one group a row, K padded to 32
    assert torch.equal(per_tensor.dequantize(), values * 0.5)
    rows = torch.rand(300, 1)
    assert torch.equal(fp8_from_checkpoint(c, rows, "c").dequantize(), values * rows)
    assert torch.equal(fp8_from_checkpoint(c, rows[:, 0], "c").dequantize(), values * rows)
    blocks = torch.rand(3, 2)
    ref = values * blocks.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    w = fp8_from_checkpoint(c, blocks, "b", (128, 128))
    assert w.group == 128 and torch.equal(w.dequantize(), ref)
    picked = torch.tensor([299, 0, 130, 130])
    assert torch.equal(w.dequantize_rows(picked, torch.float32), ref[picked])
    # fused projections stack by rows, whatever their block grids
    fused = cat_rows([fp8_from_checkpoint(c[:128], blocks[:1], "b", (128, 128)),
                      fp8_from_checkpoint(c[128:], blocks[1:], "b", (128, 128))])  # fmt: skip
    assert torch.equal(fused.dequantize(), ref)


def test_bad_scales_are_refused() -> None:
    c = _codes(20, 64, 0)
    with pytest.raises(ValueError, match="block scales"):
        fp8_from_checkpoint(c, torch.ones(2, 2), "b", (128, 128))
    with pytest.raises(ValueError, match="one per"):
        fp8_from_checkpoint(c, torch.ones(7), "c")
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_from_checkpoint(c, torch.ones(1, 1), "b", (128, 100))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_from_checkpoint(c.float(), torch.ones(1), "t")


def test_quantizing_at_load_stays_within_e4m3_rounding() -> None:
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    w[3] = 0  # an all-zero row keeps zero codes
    q = quantize_fp8(w)
    assert q.source == "fp8" and q.group == 96
    err = (q.dequantize() - w).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value's power of two
    assert (err <= w.abs() / 16 + w.abs().amax(1, keepdim=True) / FP8_MAX * 2**-9).all()
    assert torch.equal(q.dequantize()[3], torch.zeros(96))
    assert q.nbytes <= w.numel() * 1.05  # a byte a weight, and a scale a row


def _reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return x.double() @ w.dequantize().double().T


@needs_cpu_ops
@pytest.mark.parametrize("w", _weights(), ids=lambda w: w.source)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_the_dequantized_product(w: QuantTensor, rows: int,
                                                    dtype: torch.dtype) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
    ref = _reference(x, w)
    y = torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales, None, w.group, w.shape[0], True)
    assert y.dtype == torch.float32 and y.shape == (rows, w.shape[0])
    terms = x.double().abs() @ w.dequantize().double().abs().T
    assert ((y.double() - ref).abs() <= terms * 1e-6 + 1e-9).all()
    rounded = torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales, None, w.group,
                                                w.shape[0], False)  # fmt: skip
    assert rounded.dtype == dtype and torch.equal(rounded, y.to(dtype))
    dense = torch.ops.diptych_cpu.quant_dequantize(w.codes, w.scales, None, w.group, w.shape[0],
                                                  torch.float32)  # fmt: skip
    assert torch.equal(dense[:, : w.shape[1]], w.dequantize())


@needs_cpu_ops
def test_the_engine_op_takes_decode_and_prefill_sizes() -> None:
    w = _weights()[2]
    for rows in (2, ops.QUANT_DOT_MAX_ROWS + 3):  # the kernel; the dequantized GEMM
        x = torch.randn(rows, w.shape[1])
        bias = torch.randn(w.shape[0])
        y = ops.quant_linear(x[None], w, bias)
        assert y.shape == (1, rows, w.shape[0])
        assert torch.allclose(y[0].double(), _reference(x, w) + bias.double(), atol=1e-3)


@needs_cpu_ops
def test_cpu_kernel_refuses_bad_input() -> None:
    w = _weights()[0]
    x = torch.randn(2, w.shape[1])
    with pytest.raises(RuntimeError, match="columns"):
        wide = torch.randn(2, w.padded_k + 1)
        torch.ops.diptych_cpu.quant_linear(wide, w.codes, w.scales, None, w.group, 20, False)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales.half(), None, w.group, 20, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.diptych_cpu.quant_linear(x, w.codes, w.scales, None, 100, 20, False)


def _triton_cases(test: Callable[..., None]) -> Callable[..., None]:
    """The Triton kernel's cases: each weight layout, a decode row and a batch, each dtype."""
    for mark in (
        pytest.mark.parametrize("dtype", DTYPES),
        pytest.mark.parametrize("rows", [1, 17]),
        pytest.mark.parametrize("w", _weights(), ids=lambda w: w.source),
        needs_triton,
    ):
        test = mark(test)
    return test


def _on_device(w: QuantTensor, rows: int, dtype: torch.dtype) -> tuple[QuantTensor, torch.Tensor]:
    """`w` on the Triton tests' device, and `rows` random activations of `dtype` for it."""
    assert KT is not None
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    return w.to(DEVICE), x.to(DEVICE)


@_triton_cases
def test_triton_kernel_matches_the_dequantized_product(w: QuantTensor, rows: int,
                                                       dtype: torch.dtype) -> None:  # fmt: skip
    w, x = _on_device(w, rows, dtype)
    ref = x.float() @ w.dequantize(dtype).float().T
    y = KT.quant_linear(x, w, None, fp32_out=True)
    assert y.dtype == torch.float32 and y.shape == (rows, w.shape[0])
    assert (y - ref).abs().max().item() <= TOL[dtype] * (ref.abs().max().item() + 1) * 4


@_triton_cases
def test_triton_w8a8_matches_x_rounded_to_e4m3(w: QuantTensor, rows: int,
                                               dtype: torch.dtype) -> None:  # fmt: skip
    """w8a8: x rounded to e4m3 a row at a time, one FP8 dot a block of 32 values: the
    product of x so rounded and the dequantized weight (fp32 sums), within the fp32
    rounding of summing in another order; and the rounding of x is e4m3's (a few % of a
    row's largest value), so against x unrounded it is close, not equal."""
    from kernels.triton.quant_linear import w8a8_reference

    w, x = _on_device(w, rows, dtype)
    x[0, :7] = 0.0  # zeros round to zero
    assert KT is not None
    y = KT.quant_linear(x, w, None, fp32_out=True, a8=True)
    ref = w8a8_reference(x, w)
    scale = ref.abs().max().item() + 1
    assert y.shape == (rows, w.shape[0])
    assert (y - ref).abs().max().item() <= 1e-5 * scale
    exact = x.float() @ w.dequantize(torch.float32)[:, : w.shape[1]].float().T
    assert (y - exact).abs().max().item() <= 0.1 * scale
    q8 = pack_q8(torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 1, dtype=torch.float16),
                 32, "Q8_0", 32).to(DEVICE)  # fmt: skip
    with pytest.raises(ValueError, match="w8a8 runs FP8 weights"):
        KT.quant_linear(x[:, :32].contiguous(), q8, None, a8=True)

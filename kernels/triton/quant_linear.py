"""y = x @ W^T on a weight kept quantized (`kernels.quant.QuantTensor`), for GPUs.

The weight stays in the layout the CPU kernels read (`kernels/quant.py`): eight
output rows side by side, codes apart from their scales, so one `QuantTensor` serves
both and nothing is re-laid out per device. A program owns BLOCK_N output rows and
BLOCK_M rows of x; for each 32 values of K it gathers the rows' codes (q4: two values
a byte, low nibble first; q8: int8), dequantizes them in registers (q4: scale * code +
min; q8: scale * code, a scale per GROUP of 16 or 32 values; f8: e4m3 bytes widened
by shifts, times a scale per GROUP), and multiplies the tile
with `tl.dot` into fp32 sums. Weights move once per BLOCK_M rows of x, so a decode
batch reads each weight byte about once. Unlike the CPU kernel the activations are
not rounded to int8: the weight is dequantized to x's dtype, as the torch reference
(`QuantTensor.dequantize(x.dtype)` then a linear) does.

FP8 weights also run w8a8 (`a8`: what GPUs with FP8 tensor cores, sm_89 and later,
run): x is rounded to e4m3 a row at a time (a scale per row, its largest magnitude
over 448: `fp8_rows`), and each 32 values of K is one FP8 `tl.dot` of the codes as
they are, its fp32 sums times the weight group's scale; the row's scale multiplies the
total. Its reference is x rounded so, then the dequantized linear (`w8a8_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import BLOCK, QuantTensor
from kernels.triton.contract import float_tensor, next_pow2
from kernels.triton.jit import kernel


@kernel
def quant_linear_kernel(
    x_ptr: tl.tensor,
    codes_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    mins_ptr: tl.tensor,
    x_scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    KB: tl.tensor,  # blocks of 32 values in a padded row
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    Q4: tl.constexpr,
    F8: tl.constexpr,
    A8: tl.constexpr,  # x is e4m3 codes (with F8): one FP8 dot a block, x_scale_ptr's scales
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    tile = (rows // 8).to(tl.int64)
    lane = rows % 8
    kk = tl.arange(0, 32)
    groups = KB * 32 // GROUP  # scale groups in a padded row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, KB):
        k = b * 32 + kk
        x = tl.load(
            x_ptr + ms[:, None] * stride_x + k[None, :],
            mask=(ms < M)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        if A8:
            # the codes of this block as they are (one group's scale for its 32 values)
            at = (tile[:, None] * groups + (b * 32 // GROUP)) * (GROUP // 4) + (
                (b * 32 % GROUP + kk) // 4)[None, :]
            code = tl.load(
                codes_ptr + at * 32 + (lane * 4)[:, None] + (kk % 4)[None, :],
                mask=row_ok[:, None], other=0,
            )  # fmt: skip
            s = tl.load(scales_ptr + (tile * groups + b * 32 // GROUP) * 8 + lane,
                        mask=row_ok, other=0.0)  # fmt: skip
            part = tl.dot(x.to(tl.float8e4nv, bitcast=True),
                          tl.trans(code.to(tl.float8e4nv, bitcast=True)))  # fmt: skip
            acc += part * s[None, :]
        elif Q4:
            # [tile, block, i, row, byte]: value j of the block is byte j % 4 of
            # i = (j % 16) // 4, low nibble for j < 16, high for the rest
            at = ((tile * KB + b) * 4)[:, None] + ((kk % 16) // 4)[None, :]
            byte = tl.load(
                codes_ptr + at * 32 + (lane * 4)[:, None] + (kk % 4)[None, :],
                mask=row_ok[:, None], other=0,
            )  # fmt: skip
            code = (byte.to(tl.int32) >> ((kk // 16) * 4)[None, :]) & 15
            at_s = (tile * KB + b) * 8 + lane
            s = tl.load(scales_ptr + at_s, mask=row_ok, other=0.0).to(tl.float32)
            mn = tl.load(mins_ptr + at_s, mask=row_ok, other=0.0).to(tl.float32)
            w = code.to(tl.float32) * s[:, None] + mn[:, None]
        else:
            # [tile, group, t, row, byte]: value v of a group is byte v % 4 of t = v // 4
            g = k // GROUP
            v = k % GROUP
            at = (tile[:, None] * groups + g[None, :]) * (GROUP // 4) + (v // 4)[None, :]
            code = tl.load(
                codes_ptr + at * 32 + (lane * 4)[:, None] + (v % 4)[None, :],
                mask=row_ok[:, None], other=0,
            )  # fmt: skip
            at_s = (tile[:, None] * groups + g[None, :]) * 8 + lane[:, None]
            s = tl.load(scales_ptr + at_s, mask=row_ok[:, None], other=0.0).to(tl.float32)
            if F8:
                # e4m3 bytes (loaded as uint8): sign to bit 31, exponent and mantissa to
                # bits 20-26 of an fp32, times 2^120 (bias 7 against 127; subnormals too)
                c = code.to(tl.uint32)
                bits = ((c & 0x80) << 24) | ((c & 0x7F) << 20)
                w = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36 * s
            else:
                w = code.to(tl.float32) * s
        if not A8:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if A8:
        acc *= tl.load(x_scale_ptr + ms, mask=ms < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + ms[:, None] * stride_out + rows[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(ms < M)[:, None] & row_ok[None, :],
    )


FP8_MAX = 448.0  # e4m3's largest finite value


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded to e4m3 a row at a time: (codes [M, K] float8_e4m3fn, the rows'
    fp32 scales [M]: a row's largest magnitude over 448, 1 for a row of zeros)."""
    amax = x.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def w8a8_reference(x: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
    """What the w8a8 kernel computes, in torch: x rounded to e4m3 a row at a time, times
    the dequantized weight, in fp32."""
    codes, scale = fp8_rows(x)
    w = weight.dequantize(torch.float32)[:, : x.shape[1]]
    return (codes.float() * scale[:, None]) @ w.T


def quant_linear(
    x: torch.Tensor,
    weight: QuantTensor,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
    a8: bool = False,
    fixed_tile: bool = False,
) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ dequant(weight)^T (+ bias): [M, N] in x's dtype, or
    fp32 sums with `fp32_out`. `a8`: an FP8 weight runs w8a8 (x rounded to e4m3 a row at
    a time; GPUs of FP8 tensor cores, sm_89 and later). `fixed_tile`: one tile height at
    every M (`--deterministic`: a row's sums then do not depend on how many rows share
    the call)."""
    float_tensor("x", x)
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if weight.codes.device != x.device:
        raise ValueError(f"the weight is on {weight.codes.device}, x on {x.device}")
    q4, f8 = weight.kind == "q4", weight.kind == "f8"
    if q4 and (weight.mins is None or weight.group != BLOCK):
        raise ValueError("a q4 weight needs mins and groups of 32")
    if f8 and weight.group % BLOCK:
        raise ValueError(f"f8 groups are a multiple of 32 values, got {weight.group}")
    if weight.kind == "q8" and weight.group not in (16, 32):
        raise ValueError(f"q8 groups are 16 or 32 values, got {weight.group}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}]")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=torch.float32 if fp32_out else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    kb = weight.padded_k // BLOCK
    block_m = 16 if m <= 16 and not fixed_tile else 32
    block_n = 64 if n >= 64 else max(16, next_pow2(n))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    if a8 and not f8:
        raise ValueError(f"w8a8 runs FP8 weights, not {weight.kind}")
    mins = weight.mins if weight.mins is not None else weight.scales
    codes = weight.codes.view(torch.uint8) if f8 else weight.codes
    x_in, x_scale = x, weight.scales
    if a8:  # e4m3 codes a row at a time
        x8, x_scale = fp8_rows(x)
        x_in = x8.view(torch.uint8)
    quant_linear_kernel[grid](
        x_in, codes, weight.scales, mins, x_scale, bias if bias is not None else x, out,
        m, n, k, kb, x_in.stride(0), out.stride(0),
        Q4=q4, F8=f8, A8=a8, GROUP=weight.group, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return out

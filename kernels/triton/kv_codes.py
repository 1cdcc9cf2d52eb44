"""The quantized KV cache formats (kernels/kv_quant.py) inside Triton kernels.

A kernel is specialized on KV_CODES, the cache's format:

    0  a float cache in q's dtype
    1  int8 codes and an fp16 scale a row
    2  fp8 e4m3 codes and an fp16 scale a row, passed as uint8 (`code_view`)

fp8 codes are widened and encoded with integer operations, not Triton's fp8 types,
so the same kernel runs on every GPU (e4m3 conversions need sm_89+) and in the
interpreter, and no value passes through a denormal.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.triton.jit import device_function

FLOAT, INT8, FP8 = 0, 1, 2


def kv_codes(cache: torch.Tensor) -> int:
    """The KV_CODES constant of a cache tensor."""
    return {torch.int8: INT8, torch.float8_e4m3fn: FP8}.get(cache.dtype, FLOAT)


def code_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: fp8 codes as uint8, the rest as they are."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@device_function
def widen_codes(codes: tl.tensor, KV_CODES: tl.constexpr) -> tl.tensor:
    """int8 or e4m3 (uint8) codes as fp32 values (exact)."""
    if KV_CODES == 2:
        u = codes.to(tl.int32) & 0xFF
        mag = u & 0x7F
        sign = (u & 0x80) << 24
        # a normal code's exponent and mantissa move into fp32's fields, rebiased by
        # 127 - 7; a subnormal one (exponent 0) is its mantissa times 2^-9
        normal = ((mag << 20) + (120 << 23)) | sign
        sub = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
        return tl.where(mag < 8, sub, normal).to(tl.float32, bitcast=True)
    else:
        return codes.to(tl.float32)


@device_function
def round_half_even(c: tl.tensor) -> tl.tensor:
    """fp32 c rounded to an integer, ties to even (as torch.round)."""
    r = tl.floor(c + 0.5)
    return tl.where((r - c == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)


@device_function
def encode_e4m3(c: tl.tensor) -> tl.tensor:
    """fp32 c, |c| <= 448, as e4m3 codes (uint8), rounded to nearest even as torch's
    .to(torch.float8_e4m3fn) does."""
    bits = c.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    a = tl.abs(c)
    mag = a.to(tl.int32, bitcast=True)
    # normal range (|c| >= 2^-6): round fp32's mantissa to 3 bits, then rebias
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # subnormal range: multiples of 2^-9 (8 of them reach the smallest normal, code 8)
    sub = round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal) | sign
    return code.to(tl.uint8)

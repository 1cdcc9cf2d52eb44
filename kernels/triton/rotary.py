"""Rotary position embedding, in place, on [T, heads, head_dim] (strided views of the
qkv output are fine: only the last dim needs a unit stride).

Pair i of a head is rotated by angle (cos[t, i], sin[t, i]):

    half-split (HF / NeoX):   (x[i], x[i + D/2])
    interleaved (llama.cpp):  (x[2i], x[2i + 1])

cos/sin are fp32 [T, D/2]; like the reference (and HF) they are rounded to x's dtype
first; the rotation itself runs in fp32 and rounds once. One program per token and
group of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.contract import float_tensor, next_pow2
from kernels.triton.jit import kernel


@kernel
def rotary_kernel(
    x_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    stride_xt: tl.tensor,
    stride_xh: tl.tensor,
    stride_ct: tl.tensor,
    stride_st: tl.tensor,
    num_heads: tl.tensor,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < HALF)
    c = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i, mask=i < HALF, other=0.0)
    base = x_ptr + t * stride_xt + h.to(tl.int64) * stride_xh
    if INTERLEAVED:
        first = base + 2 * i
        second = first + 1
    else:
        first = base + i
        second = first + HALF
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(second, mask=mask, other=0.0)
    c = c.to(x1.dtype).to(tl.float32)
    s = s.to(x1.dtype).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(first, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(second, (b * c + a * s).to(x1.dtype), mask=mask)


def rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> None:
    float_tensor("x", x)
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"rotary takes x [T, heads, even head_dim], got {tuple(x.shape)}")
    t, heads, d = x.shape
    half = d // 2
    for name, c in (("cos", cos), ("sin", sin)):
        float_tensor(name, c, torch.float32)
        if c.dim() != 2 or c.shape[0] != t or c.shape[1] != half:
            raise ValueError(f"{name} must be [{t}, {half}], got {tuple(c.shape)}")
        if c.device != x.device:
            raise ValueError(f"{name} on {c.device}, x on {x.device}")
    if t == 0 or heads == 0:
        return
    per_program = min(next_pow2(heads), max(1, 4096 // next_pow2(half)))
    rotary_kernel[(t, triton.cdiv(heads, per_program))](
        x,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        heads,
        HALF=half,
        HALF_PAD=next_pow2(half),
        HEADS_PER_PROGRAM=per_program,
        INTERLEAVED=interleaved,
    )

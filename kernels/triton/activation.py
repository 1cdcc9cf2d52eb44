"""silu(gate) * up for the fused gate/up projection output x = [gate | up], [T, 2I].

silu is rounded to x's dtype before the multiply, as `F.silu(gate) * up` rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.contract import float_tensor
from kernels.triton.jit import kernel

BLOCK = 1024


@kernel
def silu_and_mul_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    inter: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    float_tensor("x", x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul takes [T, 2 * I], got {tuple(x.shape)}")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t and inter:
        silu_and_mul_kernel[(t, triton.cdiv(inter, BLOCK))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=BLOCK
        )
    return out

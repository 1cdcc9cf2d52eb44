"""RMSNorm over the rows of x, with the residual add fused in.

    h = x + residual              (rounded to x's dtype, as torch's add; also returned)
    y = weight * to_dtype(h * rsqrt(mean(h**2) + eps))   (statistics in fp32)

This rounds where `kernels.reference.rms_norm` (and HF transformers) round, so the
two differ only by the last bit of rsqrt. One program per row.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.triton.contract import float_tensor, next_pow2
from kernels.triton.jit import kernel


@kernel
def rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    y_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    stride_x: tl.tensor,
    stride_res: tl.tensor,
    stride_y: tl.tensor,
    stride_res_out: tl.tensor,
    n_cols: tl.tensor,
    eps: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Shapes this kernel takes; anything else goes to the reference."""
    ok = x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous()
    if residual is not None:
        ok = ok and residual.shape == x.shape and residual.stride(1) == 1
        ok = ok and residual.dtype == x.dtype
    return ok


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, H]; weight [H]. Returns (y, x + residual) (or (y, x) without one)."""
    float_tensor("x", x)
    if not supports(x, residual, weight):
        raise ValueError("rms_norm takes 2-D x with unit column stride and a weight of x's dtype")
    n, hidden = x.shape
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else x
    if n:
        block = next_pow2(hidden)
        rms_norm_kernel[(n,)](
            x,
            residual if residual is not None else x,
            weight,
            y,
            res_out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            y.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return y, res_out

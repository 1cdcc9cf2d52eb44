"""y = x @ W^T (+ bias) in sums that do not depend on the batch: the dense linear of
`--deterministic` on the Triton path (`engine/determinism.py`).

cuBLAS (torch's linear on CUDA) picks its algorithm, tile shape and split-K from the
problem's shape, so a row's K-reduction changes with how many rows share the call. This
kernel has one launch configuration for every M: tiles of BLOCK_M x BLOCK_N outputs,
each summing K in order, BLOCK_K values a step, into fp32 through `tl.dot` (never split
across programs). Every row of a tile runs the same instructions, so a row's sums are
the same whichever tile and tile row it lands in, alone or beside 63 others. K's tail
reads as zeros, which add nothing. A decode step pays for the fixed tile (BLOCK_M rows
however few are real), which is the mode's cost; the numbers are in docs/benchmarks.md
once a GPU has run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.contract import float_tensor
from kernels.triton.jit import kernel

# The one configuration (changing it changes every deterministic result; keep it fixed)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@kernel
def batch_invariant_matmul_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xm: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
) -> None:
    ms = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    ns = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + ks
        x = tl.load(
            x_ptr + ms[:, None] * stride_xm + k[None, :],
            mask=(ms < M)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + ns[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=(ns < N)[None, :] & (k < K)[:, None],
            other=0.0,
        )
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + ms[:, None] * stride_om + ns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(ms < M)[:, None] & (ns < N)[None, :],
    )


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]): [..., N] in x's dtype, or the fp32 sums
    with `fp32_out`; each output row's sums depend on that row of x alone."""
    float_tensor("x", x)
    float_tensor("weight", weight, x.dtype)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}], got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}]")
    flat = x.reshape(-1, k)
    if flat.numel() and flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty((m, n), dtype=torch.float32 if fp32_out else x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
        batch_invariant_matmul_kernel[grid](
            flat, weight, bias if bias is not None else flat, out, m, n, k,
            flat.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)

"""LoRA deltas of a mixed batch on GPUs (`kernels.lora` has the definition): two
BGMV-style launches per linear, whatever the mix of adapters in the step.

shrink: a program owns one row and BLOCK_R of its slot's J*R rank rows; it reads the
    row of x once per K tile and its slot's [BLOCK_R, BLOCK_K] tile of A, summing in
    fp32 into v [T, J*R].
expand: a program owns one row and BLOCK_N output columns; each column knows its
    slice j (from the slice bounds), reads the row's R rank values of that slice and
    its column of the slot's rank-major B, and adds the fp32 sum to the output, rounded
    once.

A base-model row (slot -1) loads and stores nothing. The slice bounds are two scalars:
a fused linear has at most three slices (q/k/v).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.lora import check
from kernels.triton.contract import float_tensor, index_tensor
from kernels.triton.jit import kernel

BLOCK_R = 16
BLOCK_K = 128
BLOCK_N = 128


@kernel
def lora_shrink_kernel(
    x_ptr: tl.tensor,
    a_ptr: tl.tensor,
    v_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    K: tl.tensor,
    JR: tl.tensor,
    stride_x: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # a base row's limits are 0: every load and store masked off
    k_lim = tl.where(slot >= 0, K, 0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < tl.where(slot >= 0, JR, 0)
    a_base = a_ptr + tl.maximum(slot, 0) * JR * K
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_lim
        xv = tl.load(x_ptr + t * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(
            a_base + rows[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(v_ptr + t * JR + rows, acc, mask=r_ok)


@kernel
def lora_expand_kernel(
    v_ptr: tl.tensor,
    b_ptr: tl.tensor,
    out_ptr: tl.tensor,
    slots_ptr: tl.tensor,
    N: tl.tensor,
    R: tl.tensor,
    JR: tl.tensor,
    stride_out: tl.tensor,
    bound1: tl.tensor,
    bound2: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < tl.where(slot >= 0, N, 0)
    # the slice each column belongs to: 0, 1 past bound1, 2 past bound2
    j = (cols >= bound1).to(tl.int64) + (cols >= bound2).to(tl.int64)
    b_base = b_ptr + tl.maximum(slot, 0) * R * N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        m = (rs < R)[:, None] & c_ok[None, :]
        vv = tl.load(v_ptr + t * JR + j[None, :] * R + rs[:, None], mask=m, other=0.0)
        bv = tl.load(b_base + rs[:, None] * N + cols[None, :], mask=m, other=0.0)
        acc += tl.sum(vv * bv.to(tl.float32), axis=0)
    o = tl.load(out_ptr + t * stride_out + cols, mask=c_ok, other=0.0)
    tl.store(out_ptr + t * stride_out + cols, (o.to(tl.float32) + acc).to(o.dtype), mask=c_ok)


def lora_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    bounds: Sequence[int],
) -> None:
    """`kernels.lora.lora_add_reference`'s result, in place, in two launches."""
    rank = check(out, x, a, b, slots, bounds)
    float_tensor("x", x)
    if len(bounds) > 4:
        raise ValueError(f"lora: at most three output slices, got {len(bounds) - 1}")
    if x.stride(1) != 1 or out.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora: rows of x and out must be contiguous, a and b contiguous")
    idx = index_tensor("slots", slots, x.device, 1)
    t, k = x.shape
    n, jr = out.shape[1], a.shape[1]
    if not t or not n:
        return
    v = torch.empty((t, jr), dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(t, triton.cdiv(jr, BLOCK_R))](
        x, a, v, idx, k, jr, x.stride(0), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K
    )
    ends = [*bounds[1:-1], n, n][:2]
    lora_expand_kernel[(t, triton.cdiv(n, BLOCK_N))](
        v, b, out, idx, n, rank, jr, out.stride(0), ends[0], ends[1],
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
    )  # fmt: skip

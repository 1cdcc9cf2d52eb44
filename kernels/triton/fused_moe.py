"""A mixture of experts' two GEMMs on GPUs: every expert's rows against its own weights
in one launch (a grouped GEMM), for `kernels.moe.grouped_experts`.

The (token, expert) pairs come sorted by expert. Each expert's run of pairs is padded
to whole tiles of BLOCK_M rows, and a table says which expert each tile belongs to
(`tile_expert`), which source row of the input each padded row reads (`src`: a token
for the gate/up GEMM, a pair for the down GEMM; -1 for padding) and which output row it
writes (`dst`: the pair's place in the sorted order). A program owns one tile of rows
and BLOCK_N output columns: it gathers its rows of the input (no copy of the routed
tokens is made), reads its expert's [BLOCK_N, K] slice of the stacked weights
[E, N, K], and accumulates `tl.dot`s over K in fp32. So the launch covers every active
expert, whatever their number, and no expert's weight is read by a program of another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import combine, sorted_pairs
from kernels.triton.activation import silu_and_mul
from kernels.triton.contract import float_tensor, next_pow2
from kernels.triton.jit import kernel

BLOCK_M = 16  # rows of a tile: a decode step routes a few rows to each expert


@kernel
def grouped_gemm_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    tile_expert_ptr: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_x: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_out: tl.tensor,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    src = tl.load(src_ptr + slots).to(tl.int64)
    dst = tl.load(dst_ptr + slots).to(tl.int64)
    used = src >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + src[:, None] * stride_x + ks[None, :],
            mask=used[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        b = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None], other=0.0,
        )  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(
        out_ptr + dst[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=used[:, None] & col_ok[None, :],
    )


def tile_plan(
    counts: torch.Tensor, src: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, tile_expert) of the padded layout: the pairs' source rows `src`
    (sorted by expert, `counts` of each) padded to whole tiles per expert, -1 in the
    padding; each padded row's output row; each tile's expert."""
    dev = counts.device
    tiles = (counts + block_m - 1) // block_m  # per expert
    tile_expert = torch.repeat_interleave(torch.arange(len(counts), device=dev), tiles)
    padded = int(tiles.sum()) * block_m
    starts = torch.cumsum(tiles * block_m, 0) - tiles * block_m  # each expert's first slot
    first_pair = torch.cumsum(counts, 0) - counts
    pair = torch.arange(len(src), device=dev)
    expert_of = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
    slot = starts[expert_of] + (pair - first_pair[expert_of])
    src_rows = torch.full((padded,), -1, dtype=torch.int64, device=dev)
    dst_rows = torch.full((padded,), -1, dtype=torch.int64, device=dev)
    src_rows[slot] = src
    dst_rows[slot] = pair
    return src_rows, dst_rows, tile_expert.to(torch.int32)


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    tile_expert: torch.Tensor,
    rows: int,
    block_m: int,
) -> torch.Tensor:
    """out [rows, N]: out[dst[i]] = x[src[i]] @ w[tile_expert[i // block_m]]^T for every
    padded row i that is used (src >= 0); w [E, N, K] stacked expert weights."""
    float_tensor("x", x)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"x [M, K] and w [E, N, K] must share K: {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("x and w need contiguous rows")
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or len(tile_expert) == 0:
        return out
    block_n = 64 if n >= 64 else max(16, next_pow2(n))
    block_k = 32 if k >= 32 else max(16, next_pow2(k))
    grid = (len(tile_expert), triton.cdiv(n, block_n))
    grouped_gemm_kernel[grid](
        x, w, out, src, dst, tile_expert, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """`kernels.moe.grouped_experts` with the two GEMMs as grouped Triton launches:
    gate/up reads the routed tokens' rows of x in place, the down GEMM the activated
    pairs' rows; the sum of each token's experts as there."""
    pairs = sorted_pairs(ids, w13.shape[0], first)
    if pairs is None:
        return x.new_zeros(x.shape)
    order, token, counts = pairs
    src, dst, tiles = tile_plan(counts, token, BLOCK_M)
    rows = len(order)
    gate_up = grouped_gemm(x, w13, src, dst, tiles, rows, BLOCK_M)
    act = silu_and_mul(gate_up)
    # the down GEMM reads the activated pairs where the first wrote them (same tiles)
    down = grouped_gemm(act, w2, dst, dst, tiles, rows, BLOCK_M)
    return combine(x, down, weights, order, token)

"""Split-KV decode: one query token per sequence, its context cut into NUM_SPLITS
ranges attended in parallel, then merged.

A decode batch gives the plain kernel only num_seqs * kv_heads programs; at batch 1-8
that leaves most of a GPU's SMs idle while each program walks a long context. Here
the grid is (num_seqs, kv_heads, NUM_SPLITS): each program attends over its share of
KV tiles and writes its unnormalized output with its running max and sum (fp32); the
reduce kernel rescales the splits to a common max and normalizes:

    out = sum_s exp2(m_s - M) * acc_s / sum_s exp2(m_s - M) * l_s,   M = max_s m_s
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.triton.attention_tile import attend_tiles
from kernels.triton.contract import next_pow2
from kernels.triton.jit import kernel
from kernels.triton.kv_codes import code_view, kv_codes

# Each split should stream at least this many positions, or the merge costs more
# than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


@kernel
def split_decode_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    table_ptr: tl.tensor,
    lens_ptr: tl.tensor,
    part_acc_ptr: tl.tensor,  # [S, heads, NUM_SPLITS, HEAD_PAD] fp32
    part_ml_ptr: tl.tensor,  # [S, heads, NUM_SPLITS, 2] fp32: running max, running sum
    num_heads: tl.tensor,
    qk_scale: tl.tensor,
    window: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_table: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_CODES: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    valid = rows < GROUP
    head = (kv_head * GROUP + rows).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1

    first = seq_len * 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0) // TILE_N
    end = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(end - first, NUM_SPLITS)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, end)

    kv_off = kv_head.to(tl.int64) * stride_kh
    acc, m_i, l_i = attend_tiles(
        q, q_pos, k_ptr + kv_off, v_ptr + kv_off, table_ptr + seq.to(tl.int64) * stride_table,
        stride_kb, stride_ks, seq_len, lo, hi, window, qk_scale,
        BLOCK_M, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, PRECISION, KV_CODES,
    )  # fmt: skip
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
    tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=valid[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=valid)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=valid)


@kernel
def split_reduce_kernel(
    part_acc_ptr: tl.tensor,
    part_ml_ptr: tl.tensor,
    out_ptr: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    num_heads: tl.tensor,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    part = (seq * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l_s = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(w * l_s, axis=0)
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :])
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits (a power of two) that fill the GPU at small batch; 1 off CUDA or when
    the batch alone fills it. Each split keeps >= MIN_TOKENS_PER_SPLIT positions."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return splits_for(num_seqs, num_kv_heads, max_seq_len, sms)


def splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """`choose_num_splits` on a GPU of `sms` multiprocessors."""
    programs = num_seqs * num_kv_heads
    if programs >= sms:
        return 1
    want = min(-(-2 * sms // programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    if want < 2:
        return 1
    return 1 << (want.bit_length() - 1)  # round down: fewer compiled variants


def split_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    *,
    qk_scale: float,
    window: int,
    num_splits: int,
    tile_n: int,
    num_stages: int,
    precision: str,
) -> None:
    """Called by `unified_attention` (which checks the arguments) for decode batches."""
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    splits = next_pow2(num_splits)
    group = heads // kv_heads
    head_pad = next_pow2(head_dim)
    part_acc = torch.empty(
        (num_seqs, heads, splits, head_pad), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty((num_seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
    split_decode_kernel[(num_seqs, kv_heads, splits)](
        q, code_view(k_cache), code_view(v_cache), block_table, seq_lens, part_acc, part_ml,
        heads, qk_scale, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        BLOCK_M=max(16, next_pow2(group)),
        NUM_SPLITS=splits,
        USE_WINDOW=window > 0,
        PRECISION=precision,
        KV_CODES=kv_codes(k_cache),
        num_warps=4,
        num_stages=num_stages,
    )  # fmt: skip
    split_reduce_kernel[(num_seqs, heads)](
        part_acc, part_ml, out, out.stride(0), out.stride(1), heads,
        NUM_SPLITS=splits,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
    )  # fmt: skip

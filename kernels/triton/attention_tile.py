"""The inner loop shared by the attention kernels: one packed query tile against a
range of KV tiles of one sequence's paged cache, with online softmax in fp32.

Query rows are packed GQA-style: row m holds query token m // GROUP of the tile and
query head kv_head * GROUP + m % GROUP, so every K/V tile is loaded once for all the
query heads that share its KV head. A KV tile is TILE_N consecutive positions; each
position finds its page through the block table (`table[pos // BLOCK_SIZE]`), so a
tile may span several pages (small blocks) or part of one (large blocks).

With KV_CODES (kv_codes.py) the caches are int8 or fp8 rows of HEAD_DIM codes and an
fp16 scale (kernels/kv_quant.py): the codes widen to q's dtype (exact: |int8| <= 127,
and e4m3 fits fp16 and bf16) and a position's scale multiplies its score, and its
probability before P @ V.

Scores live in the log2 domain (qk_scale = softmax scale * log2(e), exp2), the running
max m_i and sum l_i are fp32, and a row with nothing to attend to yet keeps
m_i = -inf, l_i = 0, acc = 0 without producing NaNs.
"""

from __future__ import annotations

import triton.language as tl

from kernels.triton.jit import device_function
from kernels.triton.kv_codes import widen_codes


@device_function
def attend_tiles(
    q: tl.tensor,  # [BLOCK_M, HEAD_PAD] in the cache dtype
    q_pos: tl.tensor,  # [BLOCK_M] position of each row's query token
    k_ptr: tl.tensor,  # K cache at this KV head: + block * stride_block + slot * stride_slot + d
    v_ptr: tl.tensor,  # V cache, same strides
    table_ptr: tl.tensor,  # this sequence's block table row
    stride_block: tl.tensor,
    stride_slot: tl.tensor,
    seq_len: tl.tensor,
    tile_lo: tl.tensor,
    tile_hi: tl.tensor,
    window: tl.tensor,
    qk_scale: tl.tensor,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_CODES: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Attend the rows of `q` over KV tiles [tile_lo, tile_hi); returns (acc, m_i, l_i):
    the unnormalized fp32 output [BLOCK_M, HEAD_PAD], the running max (log2 domain)
    and the running sum of exp2(score - m_i) [BLOCK_M]."""
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        in_seq = pos < seq_len
        page = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        row = page * stride_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot
        k = tl.load(
            k_ptr + row[None, :] + d[:, None], mask=in_seq[None, :] & d_ok[:, None], other=0.0
        )
        if KV_CODES > 0:
            k_scale = row_scales(k_ptr, row, in_seq, HEAD_DIM)
            kq = widen_codes(k, KV_CODES).to(q.dtype)
            s = tl.dot(q, kq, input_precision=PRECISION) * (k_scale * qk_scale)[None, :]
        else:
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        keep = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows that have seen no key yet: subtract 0 instead of -inf (no inf - inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + row[:, None] + d[None, :], mask=in_seq[:, None] & d_ok[None, :], other=0.0
        )
        if KV_CODES > 0:
            pv = p * row_scales(v_ptr, row, in_seq, HEAD_DIM)[None, :]
            vq = widen_codes(v, KV_CODES).to(q.dtype)
            acc = tl.dot(pv.to(q.dtype), vq, acc * alpha[:, None], input_precision=PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@device_function
def row_scales(
    cache_ptr: tl.tensor, row: tl.tensor, in_seq: tl.tensor, HEAD_DIM: tl.constexpr
) -> tl.tensor:
    """fp32 scales of quantized cache rows (the fp16 after each row's HEAD_DIM codes);
    0 outside the sequence."""
    ptr = (cache_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.float16))
    return tl.load(ptr, mask=in_seq, other=0.0).to(tl.float32)


@device_function
def find_seq(
    qsl_ptr: tl.tensor, tile: tl.tensor, num_seqs: tl.tensor, BLOCK_Q: tl.constexpr
) -> tl.tensor:
    """The sequence that owns query tile `tile`.

    Sequence s owns the tile ids from qsl[s] // BLOCK_Q + s on; that start never
    falls behind the previous sequence's last tile, so the owner is the largest s
    whose start is <= tile (binary search over qsl, which is sorted).
    """
    lo = tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        owns = start <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    return lo

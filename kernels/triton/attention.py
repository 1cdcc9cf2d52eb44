"""Paged attention for a ragged batch: prefill, chunked prefill over a cached prefix,
and decode in one kernel; causal, GQA, optional sliding window.

    q:               [T, heads, head_dim]      tokens of all sequences, flattened
    k/v_cache:       [num_blocks, block_size, kv_heads, head_dim]  (a layer's pool view)
                     int8 / fp8: [..., head_dim + 2], codes then an fp16 scale
                     (kernels/kv_quant.py)
    batch:           query_start_loc, seq_lens, block_table (see `kernels.paged`)

    seq i:   | cached context (seq_len - q_len) | this step's q_len tokens |
    token j of the step sits at position seq_len - q_len + j and attends to
    positions p <= it (and p > it - window with a sliding window).

The new K/V must already be in the cache (`store_kv` first). The grid is
(query tiles, kv_heads): a tile is BLOCK_Q tokens of one sequence times the GROUP
query heads of one KV head (see `attention_tile`). A decode-only batch
(max_query_len == 1) maps tile i to sequence i directly; at small batch with long
contexts it goes to the split-KV kernel (`split_decode`) instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from kernels.kv_quant import SCALE_BYTES
from kernels.paged import PagedBatch, PagedLayer
from kernels.triton import split_decode
from kernels.triton.attention_tile import attend_tiles, find_seq
from kernels.triton.contract import float_tensor, index_tensor, next_pow2
from kernels.triton.jit import kernel
from kernels.triton.kv_codes import FLOAT, code_view, kv_codes

LOG2E = 1.4426950408889634


@kernel
def unified_attention_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    out_ptr: tl.tensor,
    table_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    lens_ptr: tl.tensor,
    num_seqs: tl.tensor,
    qk_scale: tl.tensor,
    window: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_table: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_CODES: tl.constexpr,
) -> None:
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE_ONLY:
        seq = tile
        q_begin = tile
        q_first = tile * 0
        q_len = q_first + 1
    else:
        seq = find_seq(qsl_ptr, tile, num_seqs, BLOCK_Q)
        q_begin = tl.load(qsl_ptr + seq).to(tl.int32)
        q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_begin
        q_first = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
    valid = (qi < BLOCK_Q) & (q_first + qi < q_len)
    q_pos = ctx_len + q_first + qi
    token = (q_begin + q_first + qi).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    io_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )

    # KV tiles this query tile needs: up to its last row's position (causal), from
    # its first row's window start; an empty tile (past the sequence's end) needs none.
    last_pos = ctx_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1
    tile_hi = tl.where(q_first < q_len, last_pos // TILE_N + 1, 0)
    tile_lo = tile_hi * 0
    if USE_WINDOW:
        tile_lo = tl.maximum(ctx_len + q_first - window + 1, 0) // TILE_N

    kv_off = kv_head.to(tl.int64) * stride_kh
    acc, _, l_i = attend_tiles(
        q, q_pos, k_ptr + kv_off, v_ptr + kv_off, table_ptr + seq.to(tl.int64) * stride_table,
        stride_kb, stride_ks, seq_len, tile_lo, tile_hi, window, qk_scale,
        BLOCK_M, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, PRECISION, KV_CODES,
    )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one launch; fixed by the batch shape, so each is compiled once."""

    block_q: int  # query tokens per tile
    block_m: int  # packed rows: block_q * group, padded to a power of two >= 16
    tile_n: int  # KV positions per inner step
    num_warps: int
    num_stages: int


def launch_config(
    group: int, head_dim: int, elem_size: int, max_query_len: int, tile_n: int | None = None
) -> LaunchConfig:
    """Decode tiles hold one token (all its query heads); prefill tiles 32-128 rows.

    Tiles shrink with the bytes of one K row so that fp32 and 256-wide heads stay
    inside the ~99 KiB of shared memory sm_86/89 give a block (sm_80/90 give more);
    tests/kernels/compile_check.py compiles the variants and checks the allocation.
    """
    head_pad = next_pow2(head_dim)
    row_bytes = head_pad * elem_size  # 256 for bf16 at head_dim 128
    if max_query_len == 1:
        block_q, rows = 1, group
    else:
        target = 64 if row_bytes <= 512 else 32
        if row_bytes <= 256 and max_query_len * group >= 128:
            target = 128
        block_q = max(1, min(target // group, next_pow2(max_query_len)))
        rows = block_q * group
    block_m = max(16, next_pow2(rows))
    tile = tile_n or (64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16)
    stages = 3 if row_bytes <= 256 else 2
    num_warps = 8 if block_m >= 128 else 4
    return LaunchConfig(block_q, block_m, tile, num_warps, stages)


def unified_attention(
    q: torch.Tensor,
    layer: PagedLayer,
    batch: PagedBatch,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Attention of q over the layer's paged caches; returns out [T, heads, head_dim].

    The batch's host-side bounds (no device sync) pick the tile shape and, for decode,
    the number of KV splits (`num_splits` forces it; None lets
    `split_decode.choose_num_splits` decide). `batch.query_start_loc` may be None only
    for a decode-only batch (max_query_len 1: token i is sequence i).
    """
    k_cache, v_cache, scale, window = layer.k_cache, layer.v_cache, layer.scale, layer.window
    float_tensor("q", q)
    codes = kv_codes(k_cache)
    if codes != FLOAT:
        if v_cache.dtype != k_cache.dtype or k_cache.stride(-1) != 1:
            raise TypeError(f"a {k_cache.dtype} k_cache needs a v_cache like it, rows contiguous")
    else:
        float_tensor("k_cache", k_cache, q.dtype)
        float_tensor("v_cache", v_cache, q.dtype)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [T, heads, head_dim] and caches [blocks, block_size, kv_heads, "
            f"head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    t, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides (views of one pool)")
    if cache_dim != head_dim + (SCALE_BYTES if codes != FLOAT else 0) or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads of dim {head_dim} do not fit {kv_heads} KV heads of "
            f"dim {cache_dim}"
        )
    dev = q.device
    seq_lens = index_tensor("seq_lens", batch.seq_lens, dev, 1)
    block_table = index_tensor("block_table", batch.block_table, dev, 2)
    num_seqs = seq_lens.shape[0]
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {num_seqs} sequences")
    max_query_len, max_seq_len = batch.max_query_len, batch.seq_len_bound(block_size)
    decode_only = max_query_len == 1
    if decode_only and t != num_seqs:
        raise ValueError(f"max_query_len=1 but {t} tokens for {num_seqs} sequences")
    query_start_loc = batch.query_start_loc
    if query_start_loc is None:
        if not decode_only:
            raise ValueError("query_start_loc is required unless max_query_len == 1")
        qsl = seq_lens  # never read
    else:
        qsl = index_tensor("query_start_loc", query_start_loc, dev, 1)
        if qsl.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc has {qsl.shape[0]} entries for {num_seqs} seqs")
    if out is None:
        out = torch.empty((t, heads, head_dim), dtype=q.dtype, device=dev)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype} with unit last stride")
    if t == 0:
        return out
    group = heads // kv_heads
    win = window if window is not None and 0 < window < max_seq_len else 0
    use_window = win > 0
    qk_scale = scale * LOG2E
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    cfg = launch_config(group, head_dim, q.element_size(), max_query_len, tile_n)
    if decode_only:
        splits = num_splits or split_decode.choose_num_splits(num_seqs, kv_heads, max_seq_len, dev)
        if splits > 1:
            split_decode.split_decode(
                q, k_cache, v_cache, seq_lens, block_table, out,
                qk_scale=qk_scale,
                window=win,
                num_splits=splits,
                tile_n=cfg.tile_n,
                num_stages=cfg.num_stages,
                precision=precision,
            )  # fmt: skip
            return out
    tiles = num_seqs if decode_only else math.ceil(t / cfg.block_q) + num_seqs
    unified_attention_kernel[(tiles, kv_heads)](
        q, code_view(k_cache), code_view(v_cache), out, block_table, qsl, seq_lens,
        num_seqs, qk_scale, win,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=cfg.tile_n,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        DECODE_ONLY=decode_only,
        USE_WINDOW=use_window,
        PRECISION=precision,
        KV_CODES=codes,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def det_attention(
    q: torch.Tensor,
    layer: PagedLayer,
    batch: PagedBatch,
    row_seq: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of `--deterministic` on the Triton path: every token of the step
    (a prompt's, a chunk's, a tail's after a cached prefix, a decode's) attends as one
    decode row over its causal context, `batch.seq_lens[i]` positions of sequence
    `row_seq[i]` (`batch.block_table` has one row per sequence; with `row_seq` None, a
    row per token, as the engine builds it once a step). Every row then runs one
    launch shape, the decode tile (its query heads, KV tiles of a length fixed by the
    head's bytes, walked from position 0 in order) and never the split-KV kernel, whose
    number of splits follows the batch: a token's sums are the same in any step."""
    if row_seq is not None:
        table = index_tensor("block_table", batch.block_table, q.device, 2)
        rows = index_tensor("row_seq", row_seq, q.device, 1)
        batch = PagedBatch(batch.seq_lens, table.index_select(0, rows),
                           max_seq_len=batch.max_seq_len)  # fmt: skip
    return unified_attention(q, layer, batch, out, num_splits=1)

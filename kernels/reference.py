"""Torch reference implementations of every kernel: the CPU fallback, the path on
devices without a faster kernel, and the oracle the kernel tests compare against.

Numerics follow HF transformers: RMSNorm in fp32, rounded to the input dtype, then
scaled by the weight; rotary with cos/sin rounded to the input dtype; silu rounded
before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_quant
from kernels.paged import PagedBatch, PagedLayer


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalize(x + residual), x + residual) over the last dim."""
    if residual is not None:
        x = x + residual
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * y.to(x.dtype), x


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place (half-split layout); cos/sin fp32 [T, D/2]."""
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def rotary_interleaved_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary for the interleaved layout (pairs (0,1), (2,3), ...), as llama.cpp stores Q/K."""
    c = cos.to(x.dtype)[:, None, :]
    s = sin.to(x.dtype)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    x.copy_(out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write k/v [T, KVH, D] into caches [blocks, block, KVH, D] at `slots`; -1 skipped."""
    slots = slots.long()
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    if kv_quant.is_quantized(k_cache):
        k, v = kv_quant.quantize(k, k_cache.dtype), kv_quant.quantize(v, k_cache.dtype)
    bs = k_cache.shape[1]
    blocks, offsets = torch.div(slots, bs, rounding_mode="floor"), slots % bs
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def paged_decode_attention(
    q: torch.Tensor, layer: PagedLayer, batch: PagedBatch, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One query token per sequence over its first seq_len cached tokens.

    q [B, H, D]; caches [blocks, block, KVH, D] (int8 / fp8: D + 2, `kernels.kv_quant`);
    `batch.query_start_loc` is ignored.
    """
    k_cache, v_cache, scale, window = layer.k_cache, layer.v_cache, layer.scale, layer.window
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    nb = batch.block_table.shape[1]
    table = batch.block_table
    k = kv_quant.cache_blocks(k_cache, table, q.dtype).view(b, nb * bs, kvh, d).transpose(1, 2)
    v = kv_quant.cache_blocks(v_cache, table, q.dtype).view(b, nb * bs, kvh, d).transpose(1, 2)
    j = torch.arange(nb * bs, device=q.device)[None, :]
    lens = batch.seq_lens.long()[:, None]
    keep = j < lens
    if window:
        keep &= j > lens - 1 - window
    o = F.scaled_dot_product_attention(
        q.reshape(b, kvh, h // kvh, d), k, v, attn_mask=keep[:, None, None, :], scale=scale
    ).reshape(b, h, d)
    if out is None:
        return o
    out.copy_(o)
    return out


def unified_attention(
    q: torch.Tensor, layer: PagedLayer, batch: PagedBatch, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Paged attention of a ragged batch: prefill, chunked prefill and decode.

    q [T, H, D]; caches [blocks, block, KVH, D] holding every sequence's KV, this
    step's included (`kernels.paged` has the batch's layout). Token j of sequence i
    (q_len tokens) sits at position seq_len - q_len + j and attends to positions
    p <= it, and with a sliding window only to p > it - window.
    """
    k_cache, v_cache, scale, window = layer.k_cache, layer.v_cache, layer.scale, layer.window
    t, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    lens = batch.seq_lens.tolist()
    qsl = batch.query_start_loc
    starts = list(range(t + 1)) if qsl is None else qsl.tolist()
    if out is None:
        out = torch.empty_like(q)
    for i, n in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        blocks = batch.block_table[i, : -(-n // bs)]
        k = kv_quant.cache_blocks(k_cache, blocks, q.dtype).reshape(-1, kvh, d)[:n]
        v = kv_quant.cache_blocks(v_cache, blocks, q.dtype).reshape(-1, kvh, d)[:n]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        pos = torch.arange(n - (b - a), n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        keep = j <= pos
        if window:
            keep &= j > pos - window
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k, v, attn_mask=keep, scale=scale, enable_gqa=kvh != h
        )
        out[a:b] = o[0].transpose(0, 1)
    return out


def gather_blocks(
    pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[i] = pool[block_ids[i]] (all layers of the block); a negative id leaves out[i]."""
    ids = block_ids.long()
    if out is None:
        out = torch.empty((len(ids), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    keep = ids >= 0
    out[keep] = pool[ids[keep]]
    return out


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """pool[block_ids[i]] = src[i]; negative ids are skipped."""
    ids = block_ids.long()
    keep = ids >= 0
    pool[ids[keep]] = src[: len(ids)][keep]


def copy_blocks(pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """pool[dst_ids[i]] = pool[src_ids[i]] (copy-on-write); pairs with a negative id are
    skipped; destinations must not be among the sources."""
    src, dst = src_ids.long(), dst_ids.long()
    keep = (src >= 0) & (dst >= 0)
    pool[dst[keep]] = pool[src[keep]]

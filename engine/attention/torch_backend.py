"""Attention over the paged KV cache with the portable kernels of `kernels.ops`.

Decodes (one query token each) go to `Kernels.unified_attention` as one decode batch,
which reads the cache in place on CPU (C++) and gathers + SDPA elsewhere. A prompt
computed in one piece with no cached prefix attends over its own fresh K/V with causal
SDPA; a chunk that follows cached or earlier-computed tokens gathers its context from
the cache and uses a causal mask shifted by the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, BatchLayout
from kernels.paged import PagedBatch
from kernels.reference import cache_blocks

# Chunks of up to this many tokens over a cached context attend as decode rows.
MAX_DECODE_ROWS = 17


@dataclass
class _PrefillSeq:
    start: int
    end: int
    ctx_len: int
    block_ids: torch.Tensor | None  # blocks holding the context; None: use fresh K/V
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor  # int64 [T]
    num_decodes: int  # tokens attended as decode rows: the batch's first num_decodes
    decodes: PagedBatch | None  # int32 lengths and table of those rows
    prefills: list[_PrefillSeq]


class TorchAttention(AttentionBackend):
    name = "torch"

    def prepare(self, batch: BatchLayout) -> TorchAttentionMetadata:
        dev = batch.device
        bs = batch.block_size
        qsl = batch.query_start_loc
        # Decodes, then short chunks over a cached context (a speculative draft's
        # verification: its last token and drafts) as one decode row per token, so a
        # verified token's attention is computed exactly as its decode would be.
        lens = [int(n) for n in batch.seq_lens[: batch.num_decodes]]
        rows = list(range(batch.num_decodes))
        seq = batch.num_decodes
        while seq < batch.num_seqs:
            q_len = int(qsl[seq + 1] - qsl[seq])
            ctx = int(batch.seq_lens[seq])
            if not 1 < q_len <= MAX_DECODE_ROWS or ctx == q_len:
                break
            lens += range(ctx - q_len + 1, ctx + 1)
            rows += [seq] * q_len
            seq += 1
        nd = len(rows)
        decodes = None
        if nd:
            nb = -(-max(lens) // bs)
            table = np.ascontiguousarray(batch.block_table[rows, :nb])
            decodes = PagedBatch(
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                block_table=torch.from_numpy(table).to(dev),
                max_seq_len=max(lens),
            )
        prefills = []
        window = self.sliding_window
        for i in range(seq, batch.num_seqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            ctx = int(batch.seq_lens[i])
            q_len = end - start
            if q_len == ctx and window is None:
                prefills.append(_PrefillSeq(start, end, ctx, None, None))
                continue
            pos = np.arange(ctx - q_len, ctx)[:, None]
            j = np.arange(ctx)[None, :]
            keep = j <= pos
            if window is not None:
                keep &= j > pos - window
            ids = None
            if q_len != ctx:
                nb = -(-ctx // bs)
                ids = torch.from_numpy(batch.block_table[i, :nb].astype(np.int64)).to(dev)
            prefills.append(_PrefillSeq(start, end, ctx, ids, torch.from_numpy(keep).to(dev)))
        return TorchAttentionMetadata(
            slots=torch.from_numpy(batch.slot_mapping).to(dev),
            num_decodes=nd,
            decodes=decodes,
            prefills=prefills,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        t, h, d = q.shape
        kvh = self.num_kv_heads
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if meta.decodes is not None:
            self.kernels.unified_attention(
                q[:nd], k_cache, v_cache, meta.decodes, self.scale, self.sliding_window, out[:nd]
            )
        for p in meta.prefills:
            # 4-D [1, heads, len, d]: torch's CPU flash kernel needs the batch dim
            # (3-D inputs fall back to the O(n^2)-memory math path, ~6x slower).
            qs = q[p.start : p.end].transpose(0, 1)[None]
            if p.block_ids is None:
                ks = k[p.start : p.end].transpose(0, 1)[None]
                vs = v[p.start : p.end].transpose(0, 1)[None]
            else:
                ks = cache_blocks(k_cache, p.block_ids, q.dtype).view(-1, kvh, d)
                vs = cache_blocks(v_cache, p.block_ids, q.dtype).view(-1, kvh, d)
                ks = ks[: p.ctx_len].transpose(0, 1)[None]
                vs = vs[: p.ctx_len].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=kvh != h,
            )
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out

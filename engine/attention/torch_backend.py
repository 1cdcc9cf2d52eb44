"""Attention over the paged KV cache with plain torch ops (CPU, and the reference).

Decodes (one query token each) are batched: their blocks are gathered into
[num_decodes, kv_heads, S, d] and the query heads sharing a KV head are packed as
rows, so each K/V row is read once and no KV head is repeated. A prompt computed in
one piece with no cached prefix attends over its own fresh K/V with a causal mask;
a chunk that follows cached or earlier-computed tokens gathers its context from the
cache and uses a causal mask shifted by the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.batch import BatchLayout
from kernels import cpu_ops


@dataclass
class _PrefillSeq:
    start: int
    end: int
    ctx_len: int
    block_ids: torch.Tensor | None  # blocks holding the context; None: use fresh K/V
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass
class TorchAttentionMetadata:
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_decodes: int
    decode_table: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_lens: torch.Tensor | None  # set when the CPU kernel reads the cache in place
    prefills: list[_PrefillSeq]


class TorchAttention(AttentionBackend):
    """On CPU, decodes use the C++ paged kernel (kernels/cpu_ops) when it builds."""

    name = "torch"

    def _cpu_kernel(self, device: torch.device) -> bool:
        return device.type == "cpu" and self.head_dim % 16 == 0 and cpu_ops.cpu_ops_available()

    def prepare(self, batch: BatchLayout) -> TorchAttentionMetadata:
        dev = batch.device
        bs = batch.block_size
        slots = torch.from_numpy(batch.slot_mapping).to(dev)
        nd = batch.num_decodes
        decode_table = decode_mask = decode_lens = None
        window = self.sliding_window
        if nd:
            lens = batch.seq_lens[:nd]
            nb = int(-(-lens.max() // bs))
            if self._cpu_kernel(dev):
                decode_table = torch.from_numpy(np.ascontiguousarray(batch.block_table[:nd, :nb]))
                decode_lens = torch.from_numpy(lens.astype(np.int32))
            else:
                table = batch.block_table[:nd, :nb].astype(np.int64)
                decode_table = torch.from_numpy(table).to(dev)
                j = np.arange(nb * bs)[None, :]
                keep = j < lens[:, None]
                if window is not None:
                    keep &= j > lens[:, None] - 1 - window
                decode_mask = torch.from_numpy(keep[:, None, None, :]).to(dev)
        prefills = []
        qsl = batch.query_start_loc
        for i in range(nd, batch.num_seqs):
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
            slot_blocks=torch.div(slots, bs, rounding_mode="floor"),
            slot_offsets=slots % bs,
            num_decodes=nd,
            decode_table=decode_table,
            decode_mask=decode_mask,
            decode_lens=decode_lens,
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        t, h, d = q.shape
        kvh = self.num_kv_heads
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and meta.decode_lens is not None:
            assert meta.decode_table is not None
            cpu_ops.paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_table,
                meta.decode_lens,
                self.scale,
                self.sliding_window,
                out=out[:nd],
            )
        elif nd:
            assert meta.decode_table is not None
            s = meta.decode_table.shape[1] * k_cache.shape[1]
            kk = k_cache[meta.decode_table].view(nd, s, kvh, d).transpose(1, 2)
            vv = v_cache[meta.decode_table].view(nd, s, kvh, d).transpose(1, 2)
            qd = q[:nd].view(nd, kvh, h // kvh, d)
            o = F.scaled_dot_product_attention(
                qd, kk, vv, attn_mask=meta.decode_mask, scale=self.scale
            )
            out[:nd] = o.reshape(nd, h, d)
        for p in meta.prefills:
            qs = q[p.start : p.end].transpose(0, 1)
            if p.block_ids is None:
                ks = k[p.start : p.end].transpose(0, 1)
                vs = v[p.start : p.end].transpose(0, 1)
            else:
                ks = k_cache[p.block_ids].view(-1, kvh, d)[: p.ctx_len].transpose(0, 1)
                vs = v_cache[p.block_ids].view(-1, kvh, d)[: p.ctx_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=kvh != h,
            )
            out[p.start : p.end] = o.transpose(0, 1)
        return out.view(t, h * d)

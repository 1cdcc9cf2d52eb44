"""The attention interface the model calls: the step's shape (`BatchLayout`), the
backend interface, and the backend registry.

A backend turns a `BatchLayout` into its own metadata once per step
(`prepare`), then for every layer stores the new K/V rows in the paged cache and
attends over it (`forward`). The model never sees block tables.

KV cache layout (one tensor for all layers, block-major so a block's KV for every
layer is one contiguous byte range, which is what the transfer layer moves):

    pool:         [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer view:   pool[:, layer] -> [num_blocks, 2, block_size, num_kv_heads, head_dim]

The shape of one forward step, as every backend sees it (`BatchLayout`): the tokens of
all scheduled sequences flattened into one ragged batch:

    tokens:           | seq 0 (q_len 1) | seq 1 (q_len 1) | seq 2 (q_len 5)      |
    query_start_loc:  0                 1                 2                      7
    seq_lens:         = tokens with KV after this step (cached prefix + new tokens)
    positions:        seq_len - q_len ... seq_len - 1, per sequence
    slot_mapping:     block_table[pos // block_size] * block_size + pos % block_size

Sequences with q_len == 1 (decodes) come first, so backends can batch them.
`block_table` rows are padded with block 0, the null block.

`TorchAttention` attends over the paged KV cache with the portable kernels of `kernels.ops`.

Decodes (one query token each) go to `Kernels.unified_attention` as one decode batch,
which reads the cache in place on CPU (C++) and gathers + SDPA elsewhere. A prompt
computed in one piece with no cached prefix attends over its own fresh K/V with causal
SDPA; a chunk that follows cached or earlier-computed tokens gathers its context from
the cache and uses a causal mask shifted by the context length. Where the runner sets
`prompt_rows` (a bf16 cache on a CPU with bf16 dot products), prompts and chunks
instead attend as rows of the batch-invariant kernel over the cache: faster than SDPA
there, and a tail after a cached prefix then sums exactly as the whole prompt would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.kv_quant import cache_blocks
from kernels.ops import KernelSelection
from kernels.paged import PagedBatch, PagedLayer


@dataclass
class BatchLayout:
    query_start_loc: np.ndarray  # int64 [num_seqs + 1]
    seq_lens: np.ndarray  # int64 [num_seqs]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    block_table: np.ndarray  # int32 [num_seqs, max_blocks]
    num_decodes: int
    block_size: int
    device: torch.device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        num_computed: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> BatchLayout:
        """Lay out a step from per-sequence (new tokens, computed tokens, block ids)."""
        q = np.asarray(query_lens, dtype=np.int64)
        start = np.asarray(num_computed, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        seq_lens = start + q
        # positions: for each token, its sequence's start + index within the chunk
        seq_of_token = np.repeat(np.arange(len(q)), q)
        positions = start[seq_of_token] + (np.arange(qsl[-1]) - qsl[seq_of_token])
        max_blocks = max((len(b) for b in block_ids), default=1) or 1
        table = np.zeros((len(q), max_blocks), dtype=np.int32)
        for i, b in enumerate(block_ids):
            table[i, : len(b)] = b
        slots = (
            table[seq_of_token, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        num_decodes = 0
        while num_decodes < len(q) and q[num_decodes] == 1:
            num_decodes += 1
        return cls(qsl, seq_lens, positions, slots, table, num_decodes, block_size, device)


@dataclass(eq=False)
class AttentionBackend(ABC):
    """`kernels` runs the backend's ops (default: `kernels.ops.DEFAULT`): give it the
    `Kernels` of the selection `get_backend_class` chose the backend with, so that the
    attention and the ops it calls agree."""

    name: ClassVar[str] = "abstract"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    kernels: ops.Kernels = field(default_factory=lambda: ops.DEFAULT)
    # batch-invariant attention (`--deterministic`): `prepare` then returns `RowsMetadata`
    deterministic: bool = False

    @abstractmethod
    def prepare(self, batch: BatchLayout) -> Any:
        """Per-step metadata shared by all layers; it carries the step's `slots`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Store k/v [T, kv_heads, d] into `kv_cache` (this layer's view), attend with
        q [T, heads, d], and return [T, heads * d]."""
        t, h, d = q.shape
        layer = self.paged(kv_cache[:, 0], kv_cache[:, 1])
        self.kernels.store_kv(k, v, layer.k_cache, layer.v_cache, meta.slots)
        return self.attend_step(q, k, v, layer, meta).view(t, h * d)

    def attend_step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, meta: Any
    ) -> torch.Tensor:
        """`attend` with `prepare`'s metadata: under `deterministic` the batch-invariant
        rows (`RowsMetadata`), else the backend's own."""
        if isinstance(meta, RowsMetadata):
            return self.kernels.det_attention(q, layer, meta.rows, meta.row_seq)
        return self.attend(q, k, v, layer, meta)

    def prepare_rows(self, batch: BatchLayout, table_per_token: bool = False) -> RowsMetadata:
        """`deterministic`: every token of the step as one row of the batch-invariant
        attention (`Kernels.det_attention`: one query over its causal context in the
        cache), so a token's attention is the same sums whether it was computed in a
        whole prompt, a chunk, a tail after a cached prefix, a verification or a
        decode, and whatever else the step holds. `table_per_token`: the block table
        gets a row a token here, once a step (the Triton kernel reads it so), instead of
        a row a sequence and each token's sequence."""
        rows, row_seq = _token_rows(batch, 0, table_per_token)
        return RowsMetadata(
            slots=torch.from_numpy(batch.slot_mapping).to(batch.device),
            rows=rows,
            row_seq=None if table_per_token else row_seq,
        )

    def paged(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> PagedLayer:
        """This layer's side of the paged-attention kernels: its caches, scale, window."""
        return PagedLayer(k_cache, v_cache, self.scale, self.sliding_window)

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer, meta: Any
    ) -> torch.Tensor:
        """[T, heads, d]: q over the layer's caches, which already hold this step's k/v
        (also given as they are, for sequences with no context in the cache)."""


def get_backend_class(
    name: str, device: torch.device, selection: KernelSelection | None = None
) -> type[AttentionBackend]:
    """The backend for `EngineConfig.attention_backend` `name` ("auto", "torch" or
    "triton") on `device`, as `selection` (default: `kernels.ops.DEFAULT`'s) decides it
    (`KernelSelection.attention`): "triton" is `TritonAttention`, "torch"
    `TorchAttention`."""
    from engine.attention.triton_backend import TritonAttention

    chosen = (selection or ops.DEFAULT.selection).attention(name, device)
    return TritonAttention if chosen == "triton" else TorchAttention


def _token_rows(
    batch: BatchLayout, first_seq: int, table_per_token: bool = False
) -> tuple[PagedBatch, torch.Tensor]:
    """The tokens of sequences `first_seq`.. as rows of the batch-invariant attention:
    each token's causal length and block-table row, and its sequence (counted from
    `first_seq`). `table_per_token`: a table row a token instead of a sequence."""
    dev = batch.device
    first = int(batch.query_start_loc[first_seq])
    lens = batch.positions[first:].astype(np.int32) + 1  # each token's causal length
    seqs = np.arange(batch.num_seqs - first_seq, dtype=np.int32)
    row_seq = np.repeat(seqs, batch.query_lens[first_seq:])
    longest = int(batch.seq_lens[first_seq:].max(initial=1))
    nb = max(-(-longest // batch.block_size), 1)
    table = batch.block_table[first_seq:, :nb]
    if table_per_token:
        table = table[row_seq]
    rows = PagedBatch(
        seq_lens=torch.from_numpy(lens).to(dev),
        block_table=torch.from_numpy(np.ascontiguousarray(table)).to(dev),
        max_seq_len=longest,
    )
    return rows, torch.from_numpy(row_seq).to(dev)


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
class RowsMetadata:
    """A deterministic step's attention (`AttentionBackend.prepare_rows`)."""

    slots: torch.Tensor  # int64 [T]
    rows: PagedBatch  # each token's causal length; the block table a row a sequence
    row_seq: torch.Tensor | None  # int32 [T]: each token's sequence (None: table a row a token)


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor  # int64 [T]
    num_decodes: int  # tokens attended as decode rows: the batch's first num_decodes
    decodes: PagedBatch | None  # int32 lengths and table of those rows
    prefills: list[_PrefillSeq]  # the other sequences on SDPA, or
    # (`TorchAttention.prompt_rows`) all the tokens after the decode rows as rows of
    # the batch-invariant kernel, with each row's sequence among them
    prompt_rows: tuple[PagedBatch, torch.Tensor] | None = None


class TorchAttention(AttentionBackend):
    """Decode rows on the paged decode kernel, prompts on torch's SDPA or, with
    `prompt_rows`, on the batch-invariant kernel over the cache (the runner sets it
    where that is faster: `engine.model_runner`)."""

    name = "torch"
    prompt_rows: bool = False

    def prepare(self, batch: BatchLayout) -> TorchAttentionMetadata | RowsMetadata:
        if self.deterministic:
            return self.prepare_rows(batch)
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
        prompt_rows = None
        if self.prompt_rows and seq < batch.num_seqs:
            prompt_rows = _token_rows(batch, seq)
            seq = batch.num_seqs
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
            prompt_rows=prompt_rows,
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        t, h, d = q.shape
        kvh = self.num_kv_heads
        k_cache, v_cache = layer.k_cache, layer.v_cache
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if meta.decodes is not None:
            self.kernels.unified_attention(q[:nd], layer, meta.decodes, out[:nd])
        if meta.prompt_rows is not None:
            rows, row_seq = meta.prompt_rows
            self.kernels.det_attention(q[nd:], layer, rows, row_seq, out[nd:])
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

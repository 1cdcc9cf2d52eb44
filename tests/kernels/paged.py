"""A ragged step over a paged KV pool, built the way the engine builds one, for the
attention and KV-store tests.

The pool is filled with NaN, then each sequence's cached context is written into
randomly chosen blocks; the step's new K/V are left for the test to store. Any
kernel that reads a slot it should not (past a sequence's end, a padding entry of
the block table, another layer) turns its output into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference
from kernels.paged import PagedBatch, PagedLayer


@dataclass
class PagedStep:
    q: torch.Tensor  # [T + pad, heads, d], a strided view of a qkv tensor
    k: torch.Tensor  # [T + pad, kv_heads, d]
    v: torch.Tensor
    pool: torch.Tensor  # [blocks, 2 layers, 2, block_size, kv_heads, d]
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S]
    block_table: torch.Tensor  # [S, blocks + 1], padded with block 0
    slots: torch.Tensor  # [T + pad], -1 for the padding tokens
    max_query_len: int
    max_seq_len: int

    @property
    def k_cache(self) -> torch.Tensor:  # layer 1: a view with a non-trivial block stride
        return self.pool[:, 1, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, 1, 1]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def batch(self) -> PagedBatch:
        return PagedBatch(
            self.seq_lens, self.block_table, self.query_start_loc,
            self.max_query_len, self.max_seq_len,
        )  # fmt: skip

    def with_index_dtype(self, dtype: torch.dtype) -> PagedStep:
        s = PagedStep(**self.__dict__)
        for name in ("query_start_loc", "seq_lens", "block_table", "slots"):
            setattr(s, name, getattr(self, name).to(dtype))
        return s


def make_step(
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    head_dim: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype,
    device: torch.device,
    index_dtype: torch.dtype = torch.int32,
    pad_tokens: int = 0,
    seed: int = 0,
) -> PagedStep:
    """seqs: (cached context length, new tokens this step) per sequence."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    lens = [c + n for c, n in seqs]
    nblocks = [-(-n // block_size) for n in lens]
    total_blocks = sum(nblocks) + 3
    pool = torch.full((total_blocks, 2, 2, block_size, kv_heads, head_dim), float("nan"))
    ids = (torch.randperm(total_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seqs), max(nblocks, default=0) + 1, dtype=torch.int64)
    for i, nb in enumerate(nblocks):
        table[i, :nb] = torch.tensor(ids[:nb], dtype=torch.int64)
        ids = ids[nb:]
    # the cached context of every sequence, written as earlier steps would have
    for i, (ctx, _) in enumerate(seqs):
        pos = torch.arange(ctx)
        slots = table[i, pos // block_size] * block_size + pos % block_size
        kc = torch.randn(ctx, kv_heads, head_dim, generator=g)
        vc = torch.randn(ctx, kv_heads, head_dim, generator=g)
        reference.store_kv(kc, vc, pool[:, 1, 0], pool[:, 1, 1], slots)
    t = sum(n for _, n in seqs)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t + pad_tokens, width, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    slots = []
    for i, (ctx, n) in enumerate(seqs):
        pos = torch.arange(ctx, ctx + n)
        slots.append(table[i, pos // block_size] * block_size + pos % block_size)
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.int64))
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor([n for _, n in seqs]).cumsum(0)
    return PagedStep(
        q=q,
        k=k,
        v=v,
        pool=pool.to(dtype).to(device),
        query_start_loc=qsl.to(index_dtype).to(device),
        seq_lens=torch.tensor(lens).to(index_dtype).to(device),
        block_table=table.to(index_dtype).to(device),
        slots=torch.cat(slots).to(index_dtype).to(device),
        max_query_len=max((n for _, n in seqs), default=0),
        max_seq_len=max(lens, default=0),
    )


def reference_attention(step: PagedStep, scale: float, window: int | None) -> torch.Tensor:
    """fp32 oracle: store the step's K/V into an fp32 copy of the pool, then attend."""
    pool = step.pool.float().cpu()
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    reference.store_kv(step.k.float().cpu(), step.v.float().cpu(), kc, vc, step.slots.cpu())
    t = step.num_tokens
    batch = PagedBatch(step.seq_lens.cpu(), step.block_table.cpu(), step.query_start_loc.cpu())
    layer = PagedLayer(kc, vc, scale, window)
    return reference.unified_attention(step.q[:t].float().cpu(), layer, batch)

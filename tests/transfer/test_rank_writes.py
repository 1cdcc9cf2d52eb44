"""A KV handoff between pools split over different TP sizes, through real agents:
each destination rank's pool ends up holding exactly its heads of the written blocks,
and nothing else of it changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protocol.kv_layout import KvLayout
from transfer import Agent, DescList, rank_writes

BASE = KvLayout(num_blocks=6, num_layers=2, block_size=16, num_kv_heads=4, head_dim=8,
                dtype="float32", model="m")  # fmt: skip


def _split(layout: KvLayout, tp: int) -> KvLayout:
    heads = layout.num_kv_heads
    return dataclasses.replace(
        layout, num_kv_heads=max(1, heads // tp), tp_size=tp, model_kv_heads=heads
    )


def _pools(agent: Agent, layout: KvLayout) -> list[torch.Tensor]:
    out = []
    for _ in range(layout.tp_size):
        region = agent.allocate(layout.total_bytes)
        out.append(region.tensor(torch.float32, layout.shape))
    return out


@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("heads", [4, 2])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_each_rank_write_lands_only_in_its_ranks_blocks(
    backend: str, heads: int, src_tp: int, dst_tp: int
) -> None:
    base = dataclasses.replace(BASE, num_kv_heads=heads)
    src, dst = _split(base, src_tp), _split(base, dst_tp)
    with Agent("prefill", backend=backend) as a, Agent("decode", backend=backend) as b:
        src_pools, dst_pools = _pools(a, src), _pools(b, dst)
        # every element of the unsplit pool a distinct value, each source rank its heads
        whole = torch.arange(base.total_bytes // 4, dtype=torch.float32).view(base.shape)
        for r, pool in enumerate(src_pools):
            pool.copy_(whole[..., list(src.rank_heads(r)), :])
        for pool in dst_pools:
            pool.fill_(-1.0)
        dst_regions = [r.id for r in b.regions]
        for region in b.regions:
            b.guard(region)
        src_blocks, dst_blocks = [1, 2, 5], [4, 0, 3]
        grant = b.grant(
            DescList.concat(DescList.blocks(r, dst_blocks, dst.block_bytes) for r in dst_regions),
            30.0,
        )
        b.add_remote(a.metadata())
        a.add_remote(b.metadata())
        writes = rank_writes(src, [r.id for r in a.regions], src_blocks, dst, dst_regions,
                             dst_blocks)  # fmt: skip
        for w in writes:
            a.write(w.src, "decode", w.dst, grant=grant).result(10.0)
        for r, pool in enumerate(dst_pools):
            want = torch.full_like(pool, -1.0)
            want[dst_blocks] = whole[src_blocks][..., list(dst.rank_heads(r)), :]
            assert torch.equal(pool, want), f"destination rank {r}"
        # the bytes each source rank sent each destination rank: a head's rows, for
        # each head the destination holds, from one source rank
        head_rows = len(src_blocks) * base.num_layers * 2 * base.block_size * base.head_bytes
        sent: dict[int, int] = {}
        for w in writes:
            for d, n in w.bytes_to.items():
                sent[d] = sent.get(d, 0) + n
        assert sent == {d: dst.num_kv_heads * head_rows for d in range(dst_tp)}
        if src_tp == dst_tp:  # unsplit: every rank writes its own rank only
            assert {w.src_rank: set(w.bytes_to) for w in writes} == {
                r: {r} for r in range(src_tp)
            }


def test_mismatched_pools_are_refused() -> None:
    other = dataclasses.replace(BASE, head_dim=16)
    with pytest.raises(ValueError, match="head_dim 8 vs 16"):
        rank_writes(BASE, [0], [0], other, [0], [0])

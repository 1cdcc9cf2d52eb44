"""The writes of one KV handoff between two workers' pools, whatever either side's
tensor-parallel split: a prefill worker's into a decode worker's blocks, or a decode
worker's cached prefix into a peer's (decode_worker/peer_kv.py).

Each source rank's pool is one region of the writer's agent and each destination
rank's one region of the receiver's (in rank order). `head_slices` says which run of
heads of which source rank fills which destination rank; each slice becomes byte
ranges, one per (block, layer, K/V, slot) row:

    source      src_block * src.block_bytes + row * src_row + src_head * head_bytes
    destination dst_block * dst.block_bytes + row * dst_row + dst_head * head_bytes

(`src_row`, `dst_row`: one row of each pool, all of its heads), each `count *
head_bytes` long. A source rank's slices make one write (one descriptor list a side);
at equal sizes every slice is whole rows, which the transfer layer's planner merges
back into whole blocks, so an unsplit handoff is one range a run of blocks as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol.kv_layout import KvLayout, head_slices
from transfer import Agent, DescList
from transfer.errors import PeerRejectedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankWrite:
    """What one source rank writes: its ranges, the receiver's, and how many of the
    bytes land in each destination rank's pool."""

    src_rank: int
    src: DescList
    dst: DescList
    bytes_to: dict[int, int]

    @property
    def nbytes(self) -> int:
        return self.src.nbytes


def rank_writes(
    src: KvLayout,
    src_regions: Sequence[int],
    src_blocks: Sequence[int],
    dst: KvLayout,
    dst_regions: Sequence[int],
    dst_blocks: Sequence[int],
) -> list[RankWrite]:
    """The writes that copy blocks `src_blocks` of the source pools into blocks
    `dst_blocks` (pairwise) of the destination pools, one per source rank that holds
    a head some destination rank needs."""
    if len(src_regions) != src.tp_size or len(dst_regions) != dst.tp_size:
        raise ValueError(
            f"{len(src_regions)} source and {len(dst_regions)} destination regions for "
            f"pools split {src.tp_size} and {dst.tp_size} ways"
        )
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    slices = head_slices(src, dst)
    out = []
    for rank in sorted({s.src_rank for s in slices}):
        mine = [s for s in slices if s.src_rank == rank]
        srcs = [_ranges(src, src_regions[s.src_rank], src_blocks, s.src_head, s.count)
                for s in mine]  # fmt: skip
        dsts = [_ranges(dst, dst_regions[s.dst_rank], dst_blocks, s.dst_head, s.count)
                for s in mine]  # fmt: skip
        bytes_to: dict[int, int] = {}
        for s, d in zip(mine, dsts, strict=True):
            bytes_to[s.dst_rank] = bytes_to.get(s.dst_rank, 0) + d.nbytes
        out.append(RankWrite(rank, DescList.concat(srcs), DescList.concat(dsts), bytes_to))
    return out


def _ranges(
    layout: KvLayout, region: int, blocks: Sequence[int], head: int, count: int
) -> DescList:
    """One (block, layer, K/V, slot) row's `count` heads from position `head`, for
    every row of every block in `blocks`, in block then row order."""
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1, 1)
    if head == 0 and count == layout.num_kv_heads:  # whole rows: whole blocks
        return DescList.blocks(region, ids.reshape(-1), layout.block_bytes)
    if ids.size and ids.min() < 0:
        raise ValueError("block ids must be non-negative")
    hb = layout.head_bytes
    row = layout.num_kv_heads * hb
    rows = layout.block_bytes // row
    offsets = ids * layout.block_bytes + np.arange(rows, dtype=np.int64) * row + head * hb
    a = np.empty((offsets.size, 3), dtype=np.int64)
    a[:, 0], a[:, 1], a[:, 2] = region, offsets.reshape(-1), count * hb
    return DescList.from_array(a)


UNKNOWN_PEER_RETRY_S = 0.2


async def send_writes(
    agent: Agent, peer: str, writes: Sequence[RankWrite], note: bytes, *,
    grant: str | None, timeout: float, retry_until: float,
) -> None:  # fmt: skip
    """`writes` into agent `peer`, then the notification `note`: with the one write when
    there is one (the transfer layer delivers it after the data), else on its own once
    every write has landed. Retried while the peer does not know us yet, until the wall
    clock passes `retry_until`: a worker just started (a scale-up) can be handed work
    before the peer has seen it in discovery and added it, a discovery watch's latency."""
    while True:
        try:
            handles = [
                agent.write(w.src, peer, w.dst, grant=grant,
                            notification=note if len(writes) == 1 else None)
                for w in writes
            ]  # fmt: skip
            waits = (h.wait(timeout) for h in handles)
            for result in await asyncio.gather(*waits, return_exceptions=True):
                if isinstance(result, BaseException):
                    raise result
            if len(writes) != 1:
                await agent.notify(peer, note, grant=grant).wait(timeout)
            return
        except PeerRejectedError as e:
            if e.reason != "unknown-peer" or time.time() + UNKNOWN_PEER_RETRY_S > retry_until:
                raise
            log.info("%s has not added us yet; retrying the write", peer)
            await asyncio.sleep(UNKNOWN_PEER_RETRY_S)

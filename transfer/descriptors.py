"""Descriptor lists: ordered (region, offset, length) byte ranges.

A transfer moves the bytes of a local list onto a remote list of the same
total size, in order: the local ranges are read as one byte stream and that
stream is laid down over the remote ranges. The two lists need not have the
same number of entries; `make_plan` cuts both at the union of their boundaries.

The KV pool is block-major, so the ranges of N blocks are::

    block b -> (region, b * block_bytes + offset_in_block, length)

and `DescList.blocks` builds them. Adjacent ranges (same region, one ending
where the next starts) are merged by `coalesce`, so a run of consecutive blocks
moves as one copy, one socket write or one RDMA operation.

Everything is numpy-vectorised: building, checking and planning 4,096 blocks
costs well under a millisecond.

The writes of one KV handoff between pools split over tensor-parallel ranks
(`rank_writes`: a prefill worker's into a decode worker's blocks, a decode worker's
cached prefix into a peer's), whatever either side's split:

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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from protocol.kv_layout import KvLayout, head_slices
from transfer.errors import DescriptorError, OutOfBoundsError, PeerRestartedError

if TYPE_CHECKING:
    from transfer.context import AgentContext, Peer
    from transfer.memory import Region


_EMPTY = np.zeros((0, 3), dtype=np.int64)


class Desc(NamedTuple):
    region: int
    offset: int
    length: int


def _region_id(region: int | Region) -> int:
    return region if isinstance(region, int) else region.id


class DescList(Sequence[Desc]):
    """An immutable list of byte ranges, stored as an (n, 3) int64 array."""

    __slots__ = ("_a",)

    def __init__(self, items: Iterable[tuple[int | Region, int, int]] = ()) -> None:
        rows = [(_region_id(r), int(o), int(n)) for r, o, n in items]
        self._a = _frozen(np.array(rows, dtype=np.int64).reshape(-1, 3))
        _check_shape(self._a)

    @classmethod
    def from_array(cls, array: np.ndarray) -> DescList:
        """Wrap an (n, 3) integer array of (region, offset, length) rows."""
        a = np.asarray(array)
        if a.ndim != 2 or a.shape[1] != 3 or not np.issubdtype(a.dtype, np.integer):
            raise DescriptorError(f"expected an (n, 3) integer array, got {a.shape} {a.dtype}")
        out = cls.__new__(cls)
        out._a = _frozen(np.ascontiguousarray(a, dtype=np.int64))
        _check_shape(out._a)
        return out

    @classmethod
    def blocks(
        cls,
        region: int | Region,
        block_ids: Sequence[int] | np.ndarray,
        block_bytes: int,
        *,
        offset_in_block: int = 0,
        length: int | None = None,
    ) -> DescList:
        """Ranges of whole blocks (or of one sub-range of each) of a block-major pool."""
        if block_bytes <= 0:
            raise DescriptorError(f"block_bytes must be positive, got {block_bytes}")
        length = block_bytes - offset_in_block if length is None else length
        if offset_in_block < 0 or length <= 0 or offset_in_block + length > block_bytes:
            raise DescriptorError(
                f"sub-range [{offset_in_block}, +{length}) does not fit a {block_bytes}-byte block"
            )
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and ids.min() < 0:
            raise DescriptorError("block ids must be non-negative")
        a = np.empty((ids.size, 3), dtype=np.int64)
        a[:, 0] = _region_id(region)
        a[:, 1] = ids * block_bytes + offset_in_block
        a[:, 2] = length
        return cls.from_array(a)

    @classmethod
    def concat(cls, lists: Iterable[DescList]) -> DescList:
        arrays = [d.array for d in lists]
        return cls.from_array(np.concatenate(arrays) if arrays else _EMPTY)

    @property
    def array(self) -> np.ndarray:
        """The read-only (n, 3) int64 array of (region, offset, length)."""
        return self._a

    @property
    def nbytes(self) -> int:
        return int(self._a[:, 2].sum())

    def coalesce(self) -> DescList:
        """Merge each run of adjacent ranges into one range; order is kept."""
        a = self._a
        if len(a) < 2:
            return self
        joins = (a[1:, 0] == a[:-1, 0]) & (a[1:, 1] == a[:-1, 1] + a[:-1, 2])
        if not joins.any():
            return self
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        out = a[starts].copy()
        out[:, 2] = np.add.reduceat(a[:, 2], starts)
        return DescList.from_array(out)

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i: int) -> Desc:  # type: ignore[override]
        r, o, n = self._a[i].tolist()
        return Desc(r, o, n)

    def __iter__(self) -> Iterator[Desc]:
        return (Desc(r, o, n) for r, o, n in self._a.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DescList) and np.array_equal(self._a, other._a)

    def __hash__(self) -> int:
        return hash(self._a.tobytes())

    def __repr__(self) -> str:
        head = ", ".join(f"({r}, {o}, {n})" for r, o, n in self._a[:4].tolist())
        more = f", ... {len(self) - 4} more" if len(self) > 4 else ""
        return f"DescList([{head}{more}], nbytes={self.nbytes})"


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _check_shape(a: np.ndarray) -> None:
    if len(a) and (a[:, 1].min() < 0 or a[:, 2].min() <= 0):
        raise DescriptorError("offsets must be >= 0 and lengths > 0")


def bounds_violation(a: np.ndarray, sizes: np.ndarray) -> str | None:
    """Why the (n, 3) ranges `a` do not all fit their regions, or None if they do.

    `sizes[r]` is the byte size of region r, or -1 when region r does not exist.
    The comparison is written so that no huge offset can overflow int64.
    """
    if len(a) == 0:
        return None
    reg, off, length = a[:, 0], a[:, 1], a[:, 2]
    known = (reg >= 0) & (reg < len(sizes))
    if not known.all():
        return f"unknown region {int(reg[~known][0])}"
    size = sizes[reg]
    if (size < 0).any():
        return f"unknown region {int(reg[size < 0][0])}"
    bad = (off < 0) | (length <= 0) | (off > size) | (length > size - off)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return (
            f"range [{int(off[i])}, +{int(length[i])}) exceeds region {int(reg[i])} "
            f"of {int(size[i])} bytes"
        )
    return None


@dataclass(frozen=True)
class Plan:
    """Segments where both sides are contiguous: segment i moves `length[i]` bytes
    from (local_region[i], local_offset[i]) to (remote_region[i], remote_offset[i])."""

    local: np.ndarray  # (n, 3) int64: region, offset, length on the local side
    remote: np.ndarray  # (n, 3) int64: the same segments on the remote side

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 2].sum())

    def __len__(self) -> int:
        return len(self.local)


def make_plan(local: DescList, remote: DescList) -> Plan:
    """Pair two lists of equal total size into segments contiguous on both sides.

    Segments are maximal: two consecutive segments are never adjacent on both
    sides at once (they would have been merged).
    """
    la, ra = local.array, remote.array
    if len(la) == len(ra) and np.array_equal(la[:, 2], ra[:, 2]):
        return _joint_coalesce(la, ra)  # the common case: both sides cut alike
    la, ra = local.coalesce().array, remote.coalesce().array
    lc, rc = np.cumsum(la[:, 2]), np.cumsum(ra[:, 2])
    ltotal = int(lc[-1]) if len(lc) else 0
    rtotal = int(rc[-1]) if len(rc) else 0
    if ltotal != rtotal:
        raise DescriptorError(f"local side has {ltotal} bytes, remote side {rtotal}")
    if ltotal == 0:
        return Plan(_EMPTY, _EMPTY)
    ends = _union(lc, rc)
    starts = np.concatenate(([0], ends[:-1]))
    return Plan(_cut(la, lc, starts, ends), _cut(ra, rc, starts, ends))


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two strictly increasing arrays: the finer one when it holds every
    cut of the other (a KV head's rows against whole blocks), else one sort
    (np.union1d hashes, 50x slower on the 10^5-range lists of a split KV handoff)."""
    fine, coarse = (a, b) if len(a) >= len(b) else (b, a)
    at = np.searchsorted(fine, coarse)
    if (at < len(fine)).all() and (fine[np.minimum(at, len(fine) - 1)] == coarse).all():
        return fine
    ends = np.concatenate((a, b))
    ends.sort()
    out: np.ndarray = ends[np.concatenate(([True], ends[1:] != ends[:-1]))]
    return out


def _joint_coalesce(la: np.ndarray, ra: np.ndarray) -> Plan:
    """Merge pair i+1 into pair i when it continues pair i on both sides."""
    if len(la) < 2:
        return Plan(la, ra)

    def adjacent(a: np.ndarray) -> np.ndarray:
        joined: np.ndarray = (a[1:, 0] == a[:-1, 0]) & (a[1:, 1] == a[:-1, 1] + a[:-1, 2])
        return joined

    joins = adjacent(la) & adjacent(ra)
    if not joins.any():
        return Plan(la, ra)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(la[:, 2], starts)
    lo, ro = la[starts].copy(), ra[starts].copy()
    lo[:, 2] = ro[:, 2] = lengths
    return Plan(lo, ro)


def _cut(a: np.ndarray, cum: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    if len(cum) == len(ends):  # `ends` holds every cut of `a` and no other: `a` as it is
        return a
    idx = np.searchsorted(cum, starts, side="right")
    first = cum[idx] - a[idx, 2]  # stream position where range idx begins
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, 0] = a[idx, 0]
    out[:, 1] = a[idx, 1] + (starts - first)
    out[:, 2] = ends - starts
    return out


# Checked lists, and the checks every transfer goes through: `Agent.prepare` /
# `Agent.prepare_remote` run the checks once and return a `Prepared` list that transfers
# reuse as is (NIXL's prepared lists, in our words). A remote list is bound to the peer
# incarnation it was checked against: after that peer restarts, using it raises
# `PeerRestartedError` instead of writing into a layout that may have changed.

Descs = DescList | Sequence[tuple[Any, int, int]]


@dataclass(frozen=True)
class Prepared:
    """A checked descriptor list; `peer` is None for a local one."""

    descs: DescList
    peer: str | None
    incarnation: str


def _as_descs(descs: Descs) -> DescList:
    return descs if isinstance(descs, DescList) else DescList(descs)


def _check(ctx: AgentContext, d: DescList, sizes: np.ndarray, whose: str) -> None:
    reason = bounds_violation(d.array, sizes)
    if reason is not None:
        ctx.stats.inc("rejected_out_of_bounds")
        raise OutOfBoundsError(f"{whose} {reason}")


def prepare_local(ctx: AgentContext, descs: Descs) -> Prepared:
    d = _as_descs(descs)
    _check(ctx, d, ctx.regions.sizes, "local")
    return Prepared(d, None, ctx.incarnation)


def prepare_remote(ctx: AgentContext, peer: Peer, descs: Descs) -> Prepared:
    d = _as_descs(descs)
    _check(ctx, d, peer.md.sizes, f"{peer.name!r}'s")
    return Prepared(d, peer.name, peer.incarnation)


def local_side(ctx: AgentContext, descs: Prepared | Descs) -> DescList:
    """The checked local list of a transfer."""
    if not isinstance(descs, Prepared):
        return prepare_local(ctx, descs).descs
    if descs.peer is not None or descs.incarnation != ctx.incarnation:
        raise DescriptorError("this prepared list is not a local list of this agent")
    return descs.descs


def remote_side(ctx: AgentContext, peer: Peer, descs: Prepared | Descs) -> DescList:
    """The checked list of `peer`'s ranges of a transfer."""
    if not isinstance(descs, Prepared):
        return prepare_remote(ctx, peer, descs).descs
    if descs.peer != peer.name:
        raise DescriptorError(f"prepared for {descs.peer!r}, used for {peer.name!r}")
    if descs.incarnation != peer.incarnation:
        raise PeerRestartedError(peer.name, "prepared for an older incarnation; prepare again")
    return descs.descs


# -- the writes of one KV handoff (see the module's docstring) ------------------------


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

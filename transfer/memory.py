"""Registered memory regions and the per-agent region table.

A `Region` is one contiguous byte range the agent may move bytes into or out of.
It comes from `Agent.allocate` (the agent owns the memory: POSIX shared memory
when the agent runs the shm backend, otherwise an anonymous mapping) or from
`Agent.register` (the caller owns it: a torch tensor, numpy array or any
writable buffer; the region keeps it alive while registered).

Memory safety: a region's mapping is unmapped only when no view of it is alive.
Transfers hold views for their duration and `Region.tensor` hands out tensors
that keep the mapping alive, so closing an agent never pulls memory from under
a running copy or an engine that still holds its KV tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import threading
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer import shmseg
from transfer.descriptors import bounds_violation
from transfer.errors import DescriptorError, OutOfBoundsError, TransferError

if TYPE_CHECKING:
    import torch


def address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


@dataclass(eq=False, repr=False)
class Region:
    """A registered byte range: `id`, `nbytes`, `address`, and views of its memory."""

    id: int
    _view: memoryview | None
    address: int
    nbytes: int
    _: KW_ONLY
    device: str = "cpu"
    shm_name: str | None = None
    mapping: mmap.mmap | None = None
    keepalive: object = None
    closed: bool = field(default=False, init=False)

    @property
    def is_host(self) -> bool:
        return self.device == "cpu"

    def view(self) -> memoryview:
        """A writable byte view of the whole region (host memory only)."""
        if self.closed or self._view is None:
            what = "closed" if self.closed else f"in {self.device} memory"
            raise TransferError(f"region {self.id} is {what}; it has no host view")
        return self._view[:]

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.view(), dtype=np.uint8)

    def tensor(
        self, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The region as a torch tensor sharing its memory (uint8 unless `dtype`)."""
        import torch

        if self._view is None and isinstance(self.keepalive, torch.Tensor):
            t = self.keepalive.reshape(-1).view(torch.uint8)
        else:
            t = torch.frombuffer(self.view(), dtype=torch.uint8)
        if dtype is not None:
            t = t.view(dtype)
        return t.reshape(shape) if shape is not None else t

    def close(self, shm_dir: str = shmseg.DEFAULT_DIR) -> None:
        """Unlink the shared name now; unmap once no view of the memory is alive."""
        if self.closed:
            return
        self.closed = True
        if self.shm_name is not None:
            shmseg.unlink(self.shm_name, directory=shm_dir)
        if self._view is not None:
            with contextlib.suppress(BufferError):
                self._view.release()
        if self.mapping is not None:
            with contextlib.suppress(BufferError):  # tensors or transfers still use it
                self.mapping.close()
        self._view = self.mapping = self.keepalive = None

    def __repr__(self) -> str:
        where = f" shm={self.shm_name}" if self.shm_name else ""
        return f"Region(id={self.id}, nbytes={self.nbytes}, device={self.device}{where})"


def map_memory(nbytes: int, *, shm_name: str | None, shm_dir: str, populate: bool) -> mmap.mmap:
    """Fresh zeroed memory: a shared segment when `shm_name` is given, else anonymous."""
    if nbytes <= 0:
        raise ValueError(f"allocation size must be positive, got {nbytes}")
    if shm_name is not None:
        return shmseg.create(shm_name, nbytes, directory=shm_dir, populate=populate)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    flags |= getattr(mmap, "MAP_POPULATE", 0) if populate else 0
    return mmap.mmap(-1, nbytes, flags=flags)


def wrap_buffer(obj: Any) -> tuple[memoryview | None, int, int, str]:
    """(view, address, nbytes, device) of a tensor, array or writable buffer."""
    torch_mod = _torch_if_loaded()
    if torch_mod is not None and isinstance(obj, torch_mod.Tensor):
        if not obj.is_contiguous():
            raise DescriptorError("only contiguous tensors can be registered")
        nbytes = obj.numel() * obj.element_size()
        if obj.device.type != "cpu":
            return None, obj.data_ptr(), nbytes, str(obj.device)
        flat = obj.detach().reshape(-1).view(torch_mod.uint8)
        view = memoryview(flat.numpy())
        return view, obj.data_ptr(), nbytes, "cpu"
    view = memoryview(obj)
    if view.readonly:
        raise DescriptorError("only writable buffers can be registered")
    if not view.contiguous:
        raise DescriptorError("only contiguous buffers can be registered")
    view = view.cast("B")
    return view, address_of(view), view.nbytes, "cpu"


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


class RegionTable:
    """Thread-safe registry of an agent's regions, with vectorised bounds checks.

    Readers (I/O threads) see an immutable snapshot swapped in on every change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._sizes = np.zeros(0, dtype=np.int64)
        self._next = 0

    def next_id(self) -> int:
        with self._lock:
            rid, self._next = self._next, self._next + 1
            return rid

    def add(self, region: Region) -> None:
        with self._lock:
            regions = dict(self._regions)
            regions[region.id] = region
            self._publish(regions)

    def remove(self, rid: int) -> Region:
        with self._lock:
            regions = dict(self._regions)
            region = regions.pop(rid, None)
            if region is None:
                raise KeyError(f"no region {rid}")
            self._publish(regions)
            return region

    def _publish(self, regions: dict[int, Region]) -> None:
        sizes = np.full(max(regions, default=-1) + 1, -1, dtype=np.int64)
        for rid, r in regions.items():
            sizes[rid] = r.nbytes
        self._regions, self._sizes = regions, sizes

    def get(self, rid: int) -> Region:
        try:
            return self._regions[rid]
        except KeyError:
            raise OutOfBoundsError(f"no local region {rid}") from None

    def all(self) -> list[Region]:
        return sorted(self._regions.values(), key=lambda r: r.id)

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    def violation(self, descs: np.ndarray) -> str | None:
        return bounds_violation(descs, self._sizes)

    def views(self, descs: np.ndarray) -> list[memoryview]:
        """Views of each (region, offset, length) row; rows must already be checked."""
        if len(descs) == 0:
            return []
        regions = self._regions
        offsets, ends = descs[:, 1].tolist(), (descs[:, 1] + descs[:, 2]).tolist()
        first = int(descs[0, 0])
        if (descs[:, 0] == first).all():  # one region: the common case, kept lean
            base = regions[first].view()
            return [base[o:e] for o, e in zip(offsets, ends)]
        bases = {rid: regions[rid].view() for rid in np.unique(descs[:, 0]).tolist()}
        return [bases[r][o:e] for r, o, e in zip(descs[:, 0].tolist(), offsets, ends)]

    def pin(self, region_ids: np.ndarray) -> list[memoryview]:
        """Views that keep the mappings of these regions alive during a raw copy."""
        return [self.get(rid).view() for rid in np.unique(region_ids).tolist()]

    def addresses(self, descs: np.ndarray) -> np.ndarray:
        """Absolute address of each row's first byte."""
        bases = np.zeros(len(self._sizes), dtype=np.int64)
        for rid, r in self._regions.items():
            bases[rid] = r.address
        addrs: np.ndarray = bases[descs[:, 0]] + descs[:, 1]
        return addrs


# -- copies of many small ranges, by runs --------------------------------------------
#
# A descriptor list that cuts every row of a block (one KV head's slice of each (layer,
# K/V, slot) row, when the two sides split their pools over different tensor-parallel
# sizes) has hundreds of thousands of ranges of one length at a fixed stride. One
# `memcpy` call each costs a microsecond of Python; a run of equal-length ranges whose
# addresses advance by a constant step on both sides is one strided numpy copy instead.
#
#     copy_ranges(dst, src, lengths)   memcpy(dst[i], src[i], lengths[i]) for every i
#     bounce_worthwhile(lengths)       whether a byte stream over these ranges should be
#                                      gathered into (or scattered from) one contiguous
#                                      buffer first (the tcp backend's socket calls)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
_memcpy = _libc.memcpy
_memcpy.restype = ctypes.c_void_p
_memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

MIN_RUN = 8  # shorter runs go range by range
SMALL = 16 * 1024  # ranges below this size (on average) are worth a bounce buffer
MANY = 64  # ... when there are more than this many


def copy_ranges(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """memcpy(dst[i], src[i], lengths[i]) for every i (absolute addresses, int64); runs
    of equal lengths at constant strides go as one strided copy each."""
    n = len(lengths)
    if n < MIN_RUN:
        for d, s, k in zip(dst.tolist(), src.tolist(), lengths.tolist()):
            _memcpy(d, s, k)
        return
    for start, stop in _runs(dst, src, lengths):
        if stop - start < MIN_RUN:
            for i in range(start, stop):
                _memcpy(int(dst[i]), int(src[i]), int(lengths[i]))
        else:
            _strided(dst, src, int(lengths[start]), start, stop)


def bounce_worthwhile(lengths: np.ndarray) -> bool:
    n = len(lengths)
    return n > MANY and int(lengths.sum()) < SMALL * n


def _runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index runs covering every range in order, greedily from the left:
    within a run the lengths are equal and both address sequences step by a constant."""
    n = len(lengths)
    same = np.ones(n, dtype=bool)
    same[1:] = lengths[1:] == lengths[:-1]
    new_step = np.zeros(n, dtype=bool)  # the pair (i-1, i) steps unlike (i-2, i-1)
    dd, ds = np.diff(dst), np.diff(src)
    new_step[2:] = (dd[1:] != dd[:-1]) | (ds[1:] != ds[:-1])
    out: list[tuple[int, int]] = []
    start = 0
    for i in np.flatnonzero(~same | new_step).tolist():
        if same[i] and i == start + 1:  # a run's first pair may step as it likes
            continue
        out.append((start, i))
        start = i
    out.append((start, n))
    return out


def _strided(dst: np.ndarray, src: np.ndarray, length: int, start: int, stop: int) -> None:
    count = stop - start
    d0, s0 = int(dst[start]), int(src[start])
    dstep = int(dst[start + 1]) - d0 if count > 1 else length
    sstep = int(src[start + 1]) - s0 if count > 1 else length
    unit = 8 if (length | d0 | s0 | dstep | sstep) % 8 == 0 else 1
    dtype = np.uint64 if unit == 8 else np.uint8
    cols = length // unit
    _view(d0, count, cols, dstep, dtype)[...] = _view(s0, count, cols, sstep, dtype)


def _view(address: int, rows: int, cols: int, step: int, dtype: type) -> np.ndarray:
    """rows x cols items of `dtype` at `address`, row r at address + r * step (`step` a
    multiple of the item size, as `_strided` picks it)."""
    item = np.dtype(dtype).itemsize
    lowest = address + (rows - 1) * step if step < 0 else address
    span = (rows - 1) * abs(step) + cols * item
    base: np.ndarray = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(lowest))
    base = base.view(dtype)
    arr = np.lib.stride_tricks.as_strided(base, shape=(rows, cols), strides=(abs(step), item))
    return arr[::-1] if step < 0 else arr  # a descending run: its first row is the highest

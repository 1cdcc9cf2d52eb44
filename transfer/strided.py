"""Copies of many small ranges, by runs: a descriptor list that cuts every row of a
block (one KV head's slice of each (layer, K/V, slot) row, when the two sides split
their pools over different tensor-parallel sizes) has hundreds of thousands of ranges
of one length at a fixed stride. One `memcpy` call each costs a microsecond of Python;
a run of equal-length ranges whose addresses advance by a constant step on both sides
is one strided numpy copy instead.

    copy_ranges(dst, src, lengths)   memcpy(dst[i], src[i], lengths[i]) for every i
    bounce_worthwhile(lengths)       whether a byte stream over these ranges should be
                                     gathered into (or scattered from) one contiguous
                                     buffer first (the tcp backend's socket calls)
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

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
    """rows x cols items of `dtype` at `address`, row r at address + r * step."""
    item = np.dtype(dtype).itemsize
    span = (rows - 1) * step + cols * item if step >= 0 else cols * item
    if step < 0:  # a descending run: address the lowest row
        address += (rows - 1) * step
        span = (rows - 1) * -step + cols * item
    base = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(address))
    arr = np.lib.stride_tricks.as_strided(
        base.view(dtype) if span % item == 0 else base, shape=(rows, cols), strides=(step, item)
    )
    return arr[::-1] if step < 0 else arr

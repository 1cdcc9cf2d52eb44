"""Copies of many small ranges by runs (transfer/memory.py `copy_ranges`) land exactly what one
memcpy a range would, whatever the mix of strided runs, jumps, odd lengths and
descending addresses; and the runs found cover every range once, in order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from transfer.memory import _runs, bounce_worthwhile, copy_ranges

SIZE = 1 << 16


def _layouts(rng: np.random.Generator, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst offsets, src offsets, lengths) of one case; dst ranges never overlap."""
    n, length = int(rng.integers(1, 200)), int(rng.choice([1, 3, 8, 16, 24]))
    if kind == 0:  # one strided run each side
        d = np.arange(n) * (length + int(rng.integers(0, 9)))
        s = np.arange(n) * (length + int(rng.integers(0, 9))) + int(rng.integers(0, 100))
        return d, s, np.full(n, length)
    if kind == 1:  # random lengths and sources (descending steps included)
        lengths = rng.integers(1, 20, n)
        d = np.concatenate(([0], np.cumsum(lengths + rng.integers(0, 5, n))[:-1]))
        return d, rng.integers(0, SIZE - 40, n), lengths
    rows = int(rng.integers(2, 12))  # blocks of strided rows, the blocks shuffled
    blocks = max(1, n // rows)
    pitch = length + 2
    d = ((np.arange(blocks) * rows * pitch)[:, None] + np.arange(rows) * pitch).ravel()
    shuffled = rng.permutation(blocks) * rows * pitch
    s = (shuffled[:, None] + np.arange(rows) * pitch).ravel()
    return d, s, np.full(len(d), length)


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_copy_ranges_equals_a_memcpy_a_range(kind: int) -> None:
    rng = np.random.default_rng(kind)
    for _ in range(100):
        d, s, lengths = _layouts(rng, kind)
        if max(d.max(), s.max()) + lengths.max() >= SIZE:
            continue
        src = rng.integers(0, 255, SIZE, dtype=np.uint8)
        dst, want = np.zeros(SIZE, dtype=np.uint8), np.zeros(SIZE, dtype=np.uint8)
        for a, b, k in zip(d, s, lengths, strict=True):
            want[a : a + k] = src[b : b + k]
        as64 = lambda a: a.astype(np.int64)  # noqa: E731
        copy_ranges(as64(dst.ctypes.data + d), as64(src.ctypes.data + s), as64(lengths))
        assert np.array_equal(dst, want)
        runs = _runs(as64(d), as64(s), as64(lengths))
        assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(runs))


def test_a_head_slice_of_every_row_is_one_run() -> None:
    """1 -> 3 KV heads of 128 bytes over 960 rows a block, consecutive blocks: one run."""
    rows = np.arange(960 * 4, dtype=np.int64)
    runs = _runs(rows * 128, rows * 384 + 128, np.full(len(rows), 128, dtype=np.int64))
    assert runs == [(0, len(rows))]
    assert bounce_worthwhile(np.full(1000, 128)) and not bounce_worthwhile(np.full(8, 1 << 20))


def test_a_descending_run_is_copied_from_its_highest_row_down() -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst, want = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    s = (3000 - np.arange(20) * 100).astype(np.int64)  # each source row below the last
    d = (np.arange(20) * 32).astype(np.int64)
    for a, b in zip(d, s, strict=True):
        want[a : a + 16] = src[b : b + 16]
    copy_ranges(dst.ctypes.data + d, src.ctypes.data + s, np.full(20, 16, dtype=np.int64))
    assert np.array_equal(dst, want)

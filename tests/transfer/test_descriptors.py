from __future__ import annotations

import numpy as np
import pytest

from transfer import DescList, DescriptorError, make_plan
from transfer.descriptors import Desc, bounds_violation


def test_blocks_are_block_major_ranges() -> None:
    d = DescList.blocks(3, [0, 5, 2], 1024)
    assert list(d) == [Desc(3, 0, 1024), Desc(3, 5120, 1024), Desc(3, 2048, 1024)]
    assert d.nbytes == 3072
    sub = DescList.blocks(1, [4], 1024, offset_in_block=256, length=128)
    assert list(sub) == [Desc(1, 4 * 1024 + 256, 128)]


@pytest.mark.parametrize(
    "kwargs",
    [{"offset_in_block": 1000, "length": 100}, {"length": 0}, {"offset_in_block": -1}],
)
def test_blocks_refuse_sub_ranges_outside_a_block(kwargs: dict[str, int]) -> None:
    with pytest.raises(DescriptorError):
        DescList.blocks(0, [1], 1024, **kwargs)


def test_blocks_refuse_negative_ids_and_bad_sizes() -> None:
    with pytest.raises(DescriptorError):
        DescList.blocks(0, [-1], 1024)
    with pytest.raises(DescriptorError):
        DescList.blocks(0, [1], 0)


def test_lists_are_immutable_and_validated() -> None:
    d = DescList([(0, 0, 8)])
    with pytest.raises(ValueError):
        d.array[0, 2] = 9
    with pytest.raises(DescriptorError):
        DescList([(0, -1, 8)])
    with pytest.raises(DescriptorError):
        DescList([(0, 0, 0)])
    with pytest.raises(DescriptorError):
        DescList.from_array(np.zeros((2, 2), dtype=np.int64))
    assert DescList([(0, 0, 8)]) == DescList.from_array(np.array([[0, 0, 8]]))


def test_coalesce_merges_adjacent_runs_only() -> None:
    d = DescList([(0, 0, 4), (0, 4, 4), (0, 8, 4), (1, 12, 4), (1, 20, 4), (1, 24, 4), (0, 12, 4)])
    assert list(d.coalesce()) == [
        Desc(0, 0, 12),
        Desc(1, 12, 4),  # another region: not merged with region 0
        Desc(1, 20, 8),
        Desc(0, 12, 4),  # adjacent to the first run, but not next to it: order is kept
    ]
    assert d.coalesce().nbytes == d.nbytes
    consecutive_blocks = DescList.blocks(0, range(100, 164), 4096)
    assert list(consecutive_blocks.coalesce()) == [Desc(0, 100 * 4096, 64 * 4096)]


def _bytes_of(d: DescList) -> list[tuple[int, int]]:
    """Every byte of the list, as (region, offset), in stream order."""
    return [(r, o + i) for r, o, n in d for i in range(n)]


def test_plan_pairs_the_byte_streams_of_both_sides() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        total = int(rng.integers(1, 300))
        sides = []
        for _side in range(2):
            cuts = np.sort(rng.choice(np.arange(1, total), size=min(total - 1, 6), replace=False))
            lengths = np.diff(np.concatenate(([0], cuts, [total])))
            offsets = rng.integers(0, 1000, size=len(lengths))
            sides.append(
                DescList(
                    [(int(rng.integers(0, 3)), int(o), int(n)) for o, n in zip(offsets, lengths)]
                )
            )
        plan = make_plan(*sides)
        local = DescList.from_array(plan.local)
        remote = DescList.from_array(plan.remote)
        assert np.array_equal(plan.local[:, 2], plan.remote[:, 2])
        assert _bytes_of(local) == _bytes_of(sides[0].coalesce())
        assert _bytes_of(remote) == _bytes_of(sides[1].coalesce())
        assert plan.nbytes == total


def test_plan_of_scattered_blocks_has_one_segment_per_block() -> None:
    src = DescList.blocks(0, [5, 1, 9], 64)
    dst = DescList.blocks(0, [2, 3, 4], 64)  # adjacent on the remote side only
    plan = make_plan(src, dst)
    assert plan.local.tolist() == [[0, 320, 64], [0, 64, 64], [0, 576, 64]]
    assert plan.remote.tolist() == [[0, 128, 64], [0, 192, 64], [0, 256, 64]]


def test_plan_refuses_sides_of_different_sizes() -> None:
    with pytest.raises(DescriptorError, match="local side has 8 bytes, remote side 16"):
        make_plan(DescList([(0, 0, 8)]), DescList([(0, 0, 16)]))


def test_bounds_violation() -> None:
    sizes = np.array([100, -1, 50], dtype=np.int64)
    assert bounds_violation(np.array([[0, 0, 100], [2, 49, 1]]), sizes) is None
    assert "exceeds region 0" in str(bounds_violation(np.array([[0, 1, 100]]), sizes))
    assert "unknown region 1" in str(bounds_violation(np.array([[1, 0, 1]]), sizes))
    assert "unknown region 3" in str(bounds_violation(np.array([[3, 0, 1]]), sizes))
    assert "unknown region -1" in str(bounds_violation(np.array([[-1, 0, 1]]), sizes))
    huge = np.array([[0, 2**62, 2**62]], dtype=np.int64)  # offset + length overflows int64
    assert bounds_violation(huge, sizes) is not None
    assert bounds_violation(np.zeros((0, 3), dtype=np.int64), sizes) is None

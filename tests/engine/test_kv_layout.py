"""The KV layout hash: the one check that two workers may exchange KV blocks.

Workers compare it before any write (the transfer agent's metadata, the discovery
record, the remote-prefill request all carry this value), so it must be stable
across processes and versions, cover everything that changes the bytes of a block,
and leave out what may differ (the pool size).
"""

from __future__ import annotations

import dataclasses

import pytest

from protocol.errors import InvalidInput
from protocol.kv_layout import HeadSlice, KvLayout, head_slices

SMOLLM2 = KvLayout(
    num_blocks=64, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64,
    dtype="bfloat16", model="SmolLM2-135M-Instruct",
)  # fmt: skip


def test_the_hash_is_stable() -> None:
    # A changed value means workers of two versions refuse each other's KV: change it
    # only together with the block format (and say so in the release notes).
    assert SMOLLM2.layout_hash == "20686f7deb49681f"


def test_the_pool_size_is_left_out() -> None:
    assert SMOLLM2.with_blocks(4096).layout_hash == SMOLLM2.layout_hash


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 29},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"dtype": "float32"},
        {"dtype": "int8"},
        {"dtype": "float8_e4m3fn"},
        {"model": "SmolLM2-360M-Instruct"},
        {"num_kv_heads": 1, "tp_size": 3, "model_kv_heads": 3},  # one KV head a rank
        {"kv_planes": 1},  # a latent cache (MLA): one plane, read as K and V
    ],
)
def test_every_field_of_the_block_format_counts(change: dict[str, object]) -> None:
    assert dataclasses.replace(SMOLLM2, **change).layout_hash != SMOLLM2.layout_hash  # type: ignore[arg-type]


def test_the_discovery_record_carries_the_layout_and_its_hash() -> None:
    record = SMOLLM2.to_dict()
    assert record["layout_hash"] == SMOLLM2.layout_hash
    assert KvLayout.from_dict(record) == SMOLLM2
    with pytest.raises(InvalidInput, match="layout_hash"):  # fields and hash disagree
        KvLayout.from_dict({**record, "head_dim": 128})
    with pytest.raises(InvalidInput, match="dtype"):
        KvLayout.from_dict({**record, "dtype": "float64", "layout_hash": None})
    with pytest.raises(InvalidInput, match="no field"):
        KvLayout.from_dict({**record, "pages": 3})


def test_a_latent_block_is_one_plane() -> None:
    """MLA's cache (DeepSeek-V3's 512 + 64 values, one "head"): half the rows of a
    K/V block of the same width, its shape saying so."""
    latent = KvLayout(64, 61, 16, 1, 576, "bfloat16", "DeepSeek-V3", kv_planes=1)
    assert latent.shape == (64, 61, 1, 16, 1, 576)
    assert latent.block_bytes == 61 * 16 * 576 * 2
    assert dataclasses.replace(latent, kv_planes=2).block_bytes == 2 * latent.block_bytes
    assert KvLayout.from_dict(latent.to_dict()) == latent


def test_block_bytes_and_ranges() -> None:
    assert SMOLLM2.block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert SMOLLM2.block_range(2) == (2 * SMOLLM2.block_bytes, SMOLLM2.block_bytes)
    with pytest.raises(IndexError):
        SMOLLM2.block_range(64)


def test_an_int8_block_is_codes_and_a_scale_per_row() -> None:
    int8 = dataclasses.replace(SMOLLM2, dtype="int8")
    assert int8.shape == (64, 30, 2, 16, 3, 66)  # 64 codes + an fp16 scale per row
    assert int8.block_bytes == 30 * 2 * 16 * 3 * 66
    assert int8.block_bytes / SMOLLM2.block_bytes == 66 / 128


def test_an_fp8_block_is_as_large_as_an_int8_one_but_not_interchangeable() -> None:
    int8 = dataclasses.replace(SMOLLM2, dtype="int8")
    fp8 = dataclasses.replace(SMOLLM2, dtype="float8_e4m3fn")
    assert fp8.shape == int8.shape and fp8.block_bytes == int8.block_bytes
    assert fp8.layout_hash != int8.layout_hash


def test_a_split_pool_says_which_heads_each_rank_holds() -> None:
    """Tensor parallelism: 3 KV heads over 3 ranks, one each; 2 over 4, each replicated
    on two ranks; 8 over 2, four each. A pool that is not split hashes as before."""
    tp3 = dataclasses.replace(SMOLLM2, num_kv_heads=1, tp_size=3, model_kv_heads=3)
    assert [tp3.rank_heads(r) for r in range(3)] == [(0,), (1,), (2,)]
    tp4 = KvLayout(1, 2, 16, 1, 8, "float32", "m", tp_size=4, model_kv_heads=2)
    assert [tp4.rank_heads(r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    tp2 = KvLayout(1, 2, 16, 4, 8, "float32", "m", tp_size=2, model_kv_heads=8)
    assert tp2.rank_heads(1) == (4, 5, 6, 7)
    assert SMOLLM2.rank_heads(0) == (0, 1, 2) and KvLayout.from_dict(tp3.to_dict()) == tp3
    with pytest.raises(InvalidInput, match="do not give 2 a rank"):
        KvLayout(1, 2, 16, 2, 8, "float32", "m", tp_size=3, model_kv_heads=3)
    with pytest.raises(InvalidInput, match="do not split evenly"):
        KvLayout(1, 2, 16, 1, 8, "float32", "m", tp_size=2, model_kv_heads=3)


def test_peers_that_cannot_exchange_kv_are_told_why() -> None:
    """Pools of one model at different TP sizes exchange KV (same format hash);
    a different model geometry or dtype is named."""
    tp3 = dataclasses.replace(SMOLLM2, num_kv_heads=1, tp_size=3, model_kv_heads=3)
    assert SMOLLM2.differences(SMOLLM2.with_blocks(9)) == []
    assert SMOLLM2.differences(tp3) == [] and tp3.format_hash == SMOLLM2.layout_hash
    assert tp3.layout_hash != SMOLLM2.layout_hash
    fp16 = dataclasses.replace(tp3, dtype="float16", head_dim=32)
    assert SMOLLM2.differences(fp16) == ["head_dim 64 vs 32", "dtype 'bfloat16' vs 'float16'"]
    with pytest.raises(InvalidInput, match="head_dim 64 vs 32"):
        head_slices(SMOLLM2, fp16)


def _split(layout: KvLayout, tp: int) -> KvLayout:
    heads = layout.num_kv_heads
    share = max(1, heads // tp)
    return dataclasses.replace(layout, num_kv_heads=share, tp_size=tp, model_kv_heads=heads)


def _coverage(src: KvLayout, dst: KvLayout) -> dict[tuple[int, int], int]:
    """(destination rank, position) -> the model head written there."""
    out: dict[tuple[int, int], int] = {}
    for s in head_slices(src, dst):
        for k in range(s.count):
            head = src.rank_heads(s.src_rank)[s.src_head + k]
            assert (s.dst_rank, s.dst_head + k) not in out  # written once
            out[s.dst_rank, s.dst_head + k] = head
    return out


@pytest.mark.parametrize("heads", [4, 2])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4), (1, 1)])
def test_head_slices_fill_every_destination_head_from_a_source_that_holds_it(
    heads: int, src_tp: int, dst_tp: int
) -> None:
    """Split (TP 1 -> 2), gathered (2 -> 1), and with GQA's replicated heads (2 KV
    heads over 4 ranks): each destination rank's every position gets the model head
    its layout says it holds, once."""
    base = KvLayout(8, 2, 16, heads, 8, "float32", "m")
    src, dst = _split(base, src_tp), _split(base, dst_tp)
    want = {(r, p): h for r in range(dst_tp) for p, h in enumerate(dst.rank_heads(r))}
    assert _coverage(src, dst) == want


def test_head_slices_are_runs() -> None:
    """Whole pools at equal sizes move as one slice a rank; 1 -> 2 is two slices of
    two heads from the one source rank."""
    base = KvLayout(8, 2, 16, 4, 8, "float32", "m")
    assert head_slices(_split(base, 2), _split(base, 2)) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 0, 1, 0, 2)
    ]
    assert head_slices(base, _split(base, 2)) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(0, 2, 1, 0, 2)
    ]
    assert head_slices(_split(base, 2), base) == [
        HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 0, 0, 2, 2)
    ]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 4), (4, 2)])
def test_a_latent_cache_is_whole_on_every_rank_and_moves_from_one(
    src_tp: int, dst_tp: int
) -> None:
    """MLA's latent is one KV head that every rank caches whole: a handoff between TP
    sizes reads each destination rank's latent from source rank 0, whole rows."""
    base = KvLayout(8, 2, 16, 1, 48, "float32", "m", kv_planes=1)
    src, dst = (_split(base, tp) for tp in (src_tp, dst_tp))
    got = [(s.src_rank, s.dst_rank, s.count) for s in head_slices(src, dst)]
    assert got == [(0, r, 1) for r in range(dst_tp)]

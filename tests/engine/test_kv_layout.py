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
from protocol.kv_layout import KvLayout

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
    tp3 = dataclasses.replace(SMOLLM2, num_kv_heads=1, tp_size=3, model_kv_heads=3)
    assert SMOLLM2.differences(SMOLLM2.with_blocks(9)) == []
    assert SMOLLM2.differences(tp3) == [
        "num_kv_heads 3 vs 1", "tp_size 1 vs 3", "model_kv_heads 0 vs 3"
    ]

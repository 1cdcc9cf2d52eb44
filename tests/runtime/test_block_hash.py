"""The routers' block hashes are the engine's prefix-cache keys, bit for bit."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache.hashing import hash_blocks
from runtime.block_hash import block_hashes


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode"])
def test_same_chain_as_the_engine(block_size: int, salt: str | None) -> None:
    rng = random.Random(block_size)
    for n in (0, 1, block_size - 1, block_size, 5 * block_size + 3, 1000):
        ids = [rng.randrange(2**32) for _ in range(n)]
        assert block_hashes(ids, block_size, salt) == hash_blocks(ids, block_size, salt=salt)


def test_salt_changes_every_block_and_empty_salt_is_none() -> None:
    ids = list(range(64))
    plain = block_hashes(ids, 16)
    salted = block_hashes(ids, 16, "x")
    assert len(plain) == 4 and all(a != b for a, b in zip(plain, salted))
    assert block_hashes(ids, 16, "") == plain


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)

"""The block-hash chain: one declaration (protocol/kv_layout.py) for the engine's prefix
cache keys and the routers' lookups, checked against its documented formula."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.kv_layout import hash_block, hash_blocks


def formula(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """The chain as the module's docstring writes it, one block at a time."""
    out: list[int] = []
    parent = b"\x00" * 8
    for i in range(len(token_ids) // block_size):
        data = b"".join(
            t.to_bytes(4, "little") for t in token_ids[i * block_size : (i + 1) * block_size]
        )
        if i == 0 and salt:
            data += b"\xff" + salt.encode()
        parent = hashlib.blake2b(parent + data, digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode"])
def test_the_chain_is_its_formula_whole_incremental_and_link_by_link(
    block_size: int, salt: str | None
) -> None:
    rng = random.Random(block_size)
    for n in (0, 1, block_size - 1, block_size, 5 * block_size + 3, 300):
        ids = [rng.randrange(2**32) for _ in range(n)]
        want = formula(ids, block_size, salt)
        assert hash_blocks(ids, block_size, salt=salt) == want
        for start in range(1, len(want)):  # extended from a known prefix, as the engine does
            tail = hash_blocks(ids, block_size, start=start, parent=want[start - 1])
            assert tail == want[start:]  # the salt enters block 0 only
        parent = None
        for i, h in enumerate(want):
            chunk = ids[i * block_size : (i + 1) * block_size]
            parent = hash_block(parent, chunk, salt if i == 0 else None)
            assert parent == h


def test_salt_changes_every_block_and_an_empty_salt_is_none() -> None:
    ids = list(range(64))
    plain = hash_blocks(ids, 16)
    salted = hash_blocks(ids, 16, salt="x")
    assert len(plain) == 4 and all(a != b for a, b in zip(plain, salted))
    assert hash_blocks(ids, 16, salt="") == plain
    assert hash_block(None, ids[:16], "") == plain[0]


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0)


def test_hash_depends_on_parent_tokens_and_order() -> None:
    toks = [1, 2, 3, 4]
    base = hash_block(None, toks)
    assert hash_block(None, toks) == base
    assert hash_block(base, toks) != base
    assert hash_block(1, toks) != hash_block(2, toks)
    assert hash_block(None, [4, 3, 2, 1]) != base
    assert hash_block(None, [1, 2, 3, 5]) != base
    assert hash_block(None, toks, "") == base  # an empty salt is no salt (the routers' rule)


def test_hash_blocks_only_full_blocks_and_chains() -> None:
    toks = list(range(100, 111))  # 11 tokens, block size 4 -> 2 full blocks
    hs = hash_blocks(toks, 4)
    assert len(hs) == 2
    assert hs[0] == hash_block(None, toks[0:4])
    assert hs[1] == hash_block(hs[0], toks[4:8])
    assert hash_blocks(toks[:3], 4) == []
    assert hash_blocks(toks[:8], 4) == hs


def test_same_block_under_different_parents_differs() -> None:
    a = [1, 1, 1, 1, 9, 9, 9, 9]
    b = [2, 2, 2, 2, 9, 9, 9, 9]
    ha, hb = hash_blocks(a, 4), hash_blocks(b, 4)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]  # identical tokens, different prefix


def test_shared_prefix_shares_hashes_until_the_first_difference() -> None:
    a = list(range(16))
    b = [*range(8), 99, *range(9, 16)]
    ha, hb = hash_blocks(a, 4), hash_blocks(b, 4)
    assert ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))


def test_incremental_hashing_equals_hashing_at_once() -> None:
    toks = list(range(40))
    full = hash_blocks(toks, 4)
    part = hash_blocks(toks[:13], 4)
    rest = hash_blocks(toks, 4, start=len(part), parent=part[-1])
    assert part + rest == full


def test_salt_changes_every_block_through_the_first() -> None:
    toks = list(range(20))
    plain = hash_blocks(toks, 4)
    salted = hash_blocks(toks, 4, salt="tenant-a")
    other = hash_blocks(toks, 4, salt="tenant-b")
    assert len(plain) == len(salted) == 5
    assert all(p != s for p, s in zip(plain, salted))
    assert all(s != o for s, o in zip(salted, other))
    assert hash_blocks(toks, 4, salt="tenant-a") == salted
    # the salt enters only the first block: the rest carry it through the chain
    assert salted[0] == hash_block(None, toks[:4], "tenant-a")
    assert salted[1] == hash_block(salted[0], toks[4:8])
    assert hash_blocks(toks, 4, start=1, parent=salted[0], salt="ignored") == salted[1:]


# protocol/ imports neither torch nor the engine: a child process starts in milliseconds
_CHILD = """
import json
from protocol.kv_layout import hash_blocks
print(json.dumps([hash_blocks(list(range(1000, 1037)), 16),
                  hash_blocks([3] * 33, 8, salt="s\u00e9l")]))
"""


def test_hashes_are_stable_across_processes() -> None:
    here = [hash_blocks(list(range(1000, 1037)), 16), hash_blocks([3] * 33, 8, salt="s\u00e9l")]
    for seed in ("0", "12345"):  # Python's str hash randomization must not matter
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(out.stdout) == here

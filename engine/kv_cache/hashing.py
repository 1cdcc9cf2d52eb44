"""Chained hashes of full KV blocks, the keys of the prefix cache.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys)

Only full blocks are hashed. The chain makes a block's hash name its whole prefix,
so equal hashes mean equal KV. Extra keys (a cache salt, for tenants that must not
share cache) enter the first block and so every block after it. The digest is
64-bit blake2b, stable across processes and hosts, so routers can compute the
same keys from token ids alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = int

_NO_PARENT = b"\x00" * 8


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None
) -> BlockHash:
    h = hashlib.blake2b(digest_size=8)
    h.update(_NO_PARENT if parent is None else parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    if extra is not None:
        h.update(b"\xff" + extra.encode())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
    salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` on.

    `parent` must be the hash of block `start - 1` (None when start is 0).
    """
    out: list[BlockHash] = []
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, chunk, salt if i == 0 else None)
        out.append(parent)
    return out

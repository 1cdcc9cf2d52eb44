"""Paged KV cache bookkeeping: block pool, prefix hashing, per-request manager."""

from engine.kv_cache.manager import (
    BlockPool,
    FreeBlockQueue,
    KVBlock,
    KVCacheManager,
    PrefixHit,
    cdiv,
)
from protocol.kv_layout import BlockHash, hash_block, hash_blocks

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "PrefixHit",
    "cdiv",
    "hash_block",
    "hash_blocks",
]

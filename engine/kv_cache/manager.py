"""Per-request KV block bookkeeping on top of the block pool.

A request's blocks, in order, cover its tokens:

    tokens:  | prefix-cache hits | computed by us | to compute now | (room) |
    blocks:  [ shared, ref > 1  ][ own           ][ own, new       ]
             <- num_computed_tokens ------------>
             <- num_computed_tokens + num_new_tokens ------------->

`allocate_slots` grows the list so the tokens to compute now have slots;
`cache_blocks` registers the blocks that became full *and computed* under their
chained hash (never earlier: a block whose KV is still being written, locally or by
a remote prefill worker, must not be found by another request); `free` drops the
request's references, tail first, leaving cached blocks findable until evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.request import Request
from protocol.block_hash import BlockHash, hash_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a request, and the tokens they hold."""

    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._req_num_cached: dict[str, int] = {}

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended incrementally.

        They live on the request (its token ids never change), so nothing keyed by
        request id can outlive it or leak into a later request with the same id.
        """
        hashes = request.block_hashes
        n_full = request.num_tokens // self.block_size
        if len(hashes) < n_full:
            hashes.extend(
                hash_blocks(
                    request.all_token_ids[: n_full * self.block_size],
                    self.block_size,
                    start=len(hashes),
                    parent=hashes[-1] if hashes else None,
                    salt=request.cache_salt,
                )
            )
        return hashes

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request, in whole blocks.

        The last token is never counted as cached: it must be computed to produce
        logits for the next token.
        """
        if not self.enable_caching:
            return PrefixHit([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for h in self.block_hashes(request)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    # -- mutations -------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Make room for `num_new_tokens` after the computed (and hit) tokens.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        hit_blocks = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        need = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(hit_blocks)
        # Hit blocks that are currently free leave the free queue when touched.
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free - num_evictable_hits:
            return False
        if rid not in self.req_blocks:
            self.req_blocks[rid] = blocks
            self._req_num_cached[rid] = 0
        if hit_blocks:
            self.pool.touch(hit_blocks)
            blocks.extend(hit_blocks)
            self._req_num_cached[rid] = len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            return
        n_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._req_num_cached[rid]
        if n_full <= start:
            return
        hashes = self.block_hashes(request)
        for i in range(start, min(n_full, len(hashes))):
            self.pool.cache(blocks[i], hashes[i])
        self._req_num_cached[rid] = max(start, min(n_full, len(hashes)))

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self._req_num_cached.pop(rid, None)
        if blocks:
            self.pool.free(reversed(blocks))

    # -- checks ----------------------------------------------------------------

    def is_idle(self) -> bool:
        """True when no request holds blocks: the idle baseline."""
        return not self.req_blocks and self.pool.num_free == self.pool.num_usable_blocks

    def check_invariants(self) -> list[str]:
        """Every way the bookkeeping can be inconsistent; an empty list means sound."""
        problems: list[str] = []
        pool = self.pool
        refs = [0] * pool.num_blocks
        for rid, blocks in self.req_blocks.items():
            if len({b.block_id for b in blocks}) != len(blocks):
                problems.append(f"request {rid} holds a block twice")
            for b in blocks:
                refs[b.block_id] += 1
                if b is pool.null_block:
                    problems.append(f"request {rid} holds the null block")
        free_ids = set()
        for b in pool.free_queue:
            if b.block_id in free_ids:
                problems.append(f"block {b.block_id} is in the free queue twice")
            free_ids.add(b.block_id)
        if len(free_ids) != pool.num_free:
            problems.append(f"free queue length {pool.num_free} != {len(free_ids)} linked blocks")
        for b in pool.blocks[1:]:
            if b.ref_cnt != refs[b.block_id]:
                problems.append(
                    f"block {b.block_id} ref_cnt={b.ref_cnt} but {refs[b.block_id]} holders"
                )
            if (b.ref_cnt == 0) != (b.block_id in free_ids):
                problems.append(f"block {b.block_id} ref_cnt={b.ref_cnt} vs free-queue membership")
            if refs[b.block_id] > 1 and b.block_hash is None:
                problems.append(f"block {b.block_id} shared by {refs[b.block_id]} but not cached")
        if pool.null_block.ref_cnt != 1 or 0 in free_ids:
            problems.append("null block was handed out")
        for h, b in pool.cached.items():
            if b.block_hash != h:
                problems.append(
                    f"cache maps {h} to block {b.block_id} whose hash is {b.block_hash}"
                )
        n_hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
        if n_hashed != len(pool.cached):
            problems.append(f"{n_hashed} blocks carry a hash but the cache maps {len(pool.cached)}")
        return problems

"""The KV cache's blocks: the pool, and per-request bookkeeping on top of it.

The pool of KV blocks: reference counts, the prefix-cache map and LRU eviction.

Free blocks sit in an intrusive doubly linked list (`FreeBlockQueue`). A freed block
keeps its hash and stays findable in the cache map until it is handed out again, so
eviction is lazy: `allocate` takes from the head (least recently freed), and a cache
hit on a free block simply unlinks it. Requests free their blocks tail-first, so the
tail of a prefix chain is evicted before its head.

Block 0 is the null block: never allocated, it pads block tables.

Blocks never handed out stand at the head of the free queue as a range of ids, and
a block's object is made the first time it is handed out: a simulated H200 pool holds
~170k blocks and a simulated fleet hundreds of pools, which made up front cost 0.3 s
and ~40 MB each before the first request (a 256-worker fleet: a minute and ~10 GB).

Per request (`KVCacheManager`):

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

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

import torch

from engine.request import Request
from protocol.kv_layout import BlockHash, hash_blocks

if TYPE_CHECKING:
    from engine.kv_cache.tiers import KvTiers


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list with O(1) popleft, append and remove-from-middle; ahead of it,
    `fresh` ids of blocks never handed out, made by `make` when they leave the queue."""

    def __init__(
        self,
        blocks: Iterable[KVBlock] = (),
        fresh: range = range(0),
        make: Callable[[int], KVBlock] = KVBlock,
    ) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        chain = [self._head, *blocks, self._tail]
        for a, b in itertools.pairwise(chain):  # linked in one pass
            a.next_free = b
            b.prev_free = a
        self._len = len(chain) - 2
        self._fresh, self._fresh_end = fresh.start, fresh.stop  # ids never handed out
        self._make = make

    def __len__(self) -> int:
        return self._len + self._fresh_end - self._fresh

    def take_fresh(self, n: int, make_run: Callable[[int, int], list[KVBlock]]) -> list[KVBlock]:
        """Up to `n` blocks from the never-used range, in order (what `popleft` would
        give first), made as one run by `make_run(start, stop)`."""
        start = self._fresh
        stop = min(start + n, self._fresh_end)
        if stop <= start:
            return []
        self._fresh = stop
        return make_run(start, stop)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        if self._fresh < self._fresh_end:
            self._fresh += 1
            return self._make(self._fresh - 1)
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        for i in range(self._fresh, self._fresh_end):  # makes them: for checks and tests
            yield self._make(i)
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class Blocks(Sequence[KVBlock]):
    """Every block of a pool by id, each made on first use. Blocks leave the free
    queue's never-used range in id order, so the made ones are ids 0..k-1: a list."""

    __slots__ = ("_made", "_n")

    def __init__(self, n: int) -> None:
        self._n = n
        self._made: list[KVBlock] = []

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> KVBlock: ...
    @overload
    def __getitem__(self, i: slice) -> list[KVBlock]: ...
    def __getitem__(self, i: int | slice) -> KVBlock | list[KVBlock]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        made = self._made
        if i < len(made):
            return made[i]
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} of a pool of {self._n}")
        made.extend(map(KVBlock, range(len(made), i + 1)))
        return made[i]

    def run(self, start: int, stop: int) -> list[KVBlock]:
        """Blocks `start` to `stop` - 1, made now if they are not yet."""
        made = self._made
        if len(made) < stop:
            if not 0 <= stop <= self._n:
                raise IndexError(f"blocks up to {stop} of a pool of {self._n}")
            made.extend(map(KVBlock, range(len(made), stop)))
        return made[start:stop]

    def __iter__(self) -> Iterator[KVBlock]:
        return (self[i] for i in range(self._n))

    @property
    def num_made(self) -> int:
        return len(self._made)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = Blocks(num_blocks)
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(fresh=range(1, num_blocks), make=self.blocks.__getitem__)
        self.cached: dict[BlockHash, KVBlock] = {}
        # (kind, hashes) events for routers: kind is "stored" or "removed".
        self.events: list[tuple[str, list[BlockHash]]] = []
        self.record_events = False
        # told (block id, hash) of cached blocks about to be handed out again, before
        # anything can write over them: the KV tiers keep their bytes (tiers.py)
        self.on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        out = self.free_queue.take_fresh(n, self.blocks.run)
        for b in out:
            b.ref_cnt = 1
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(n - len(out)):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                evicted.append((b.block_id, b.block_hash))
                del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        if evicted and self.on_evict is not None:  # kept by a tier: not gone
            self.on_evict(evicted)
        elif evicted and self.record_events:
            self.events.append(("removed", [h for _, h in evicted]))
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (cached) blocks, unlinking free ones from the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in eviction order (tail of a chain first)."""
        for b in blocks:
            assert b.ref_cnt > 0 and b is not self.null_block, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make `block` findable under `block_hash`; False if another block holds it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.record_events:
            self.events.append(("stored", [block_hash]))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free != self.num_usable_blocks:
            return False
        removed = list(self.cached)
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        if removed and self.record_events:
            self.events.append(("removed", removed))
        return True

    def drain_events(
        self,
        gone: list[BlockHash] | None = None,
        moves: list[tuple[str, BlockHash]] | None = None,
    ) -> list[tuple[str, list[BlockHash]]]:
        """The events since the last call, then where blocks the pool does not hold went
        (`moves`: "host" or "disk", in order; with tiers, a block the pool evicts moves
        to a tier), then those of `gone` (removed: no tier keeps them any more)."""
        ev, self.events = self.events, []
        if not self.record_events:
            return ev
        for kind, h in moves or ():
            if h in self.cached:
                continue  # nearest in the pool (restored since)
            if ev and ev[-1][0] == kind:
                ev[-1][1].append(h)
            else:
                ev.append((kind, [h]))
        gone = [h for h in gone or () if h not in self.cached]
        if gone:
            ev.append(("removed", gone))
        return ev


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a request, and the tokens they hold: device
    blocks, then blocks a KV tier holds (`restore`: their hashes and bytes), written
    into fresh device blocks when the request's blocks are allocated."""

    blocks: list[KVBlock]
    num_tokens: int
    restore: list[tuple[BlockHash, torch.Tensor]] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        tiers: KvTiers | None = None,
    ) -> None:
        """`tiers`: host and disk tiers under the pool (engine/kv_cache/tiers.py): what
        it evicts goes there, and a prefix that misses it is looked up there."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.tiers = tiers if enable_caching else None
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.offload
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
                    adapter=request.lora,
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
        hashes = self.block_hashes(request)[:max_blocks]
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        restore: list[tuple[BlockHash, torch.Tensor]] = []
        if self.tiers is not None:
            for h in hashes[len(blocks) :]:
                row = self.tiers.lookup(h)
                if row is None:
                    break
                restore.append((h, row))
        return PrefixHit(blocks, (len(blocks) + len(restore)) * self.block_size, restore)

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
            fresh = self.pool.allocate(need)
            blocks.extend(fresh)
            if hit is not None and hit.restore and self.tiers is not None:
                self._restore(rid, fresh[: len(hit.restore)], hit.restore)
        return True

    def _restore(self, rid: str, fresh: list[KVBlock],
                 restore: list[tuple[BlockHash, torch.Tensor]]) -> None:  # fmt: skip
        """Tier bytes into the request's first fresh blocks, now cached under their
        hashes as if computed here."""
        assert self.tiers is not None and len(fresh) == len(restore)
        self.tiers.restore([b.block_id for b in fresh], [row for _, row in restore])
        for b, (h, _) in zip(fresh, restore, strict=True):
            self.pool.cache(b, h)
        self._req_num_cached[rid] += len(fresh)

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

    def offload(self, request: Request) -> int:
        """Copy `request`'s cached blocks into the host tier now (an idle session about
        to let them go: the copy is made while the engine is idle, not when an
        allocation evicts them); how many it offered. Nothing without tiers."""
        if self.tiers is None:
            return 0
        blocks = [(b.block_id, b.block_hash) for b in self.req_blocks.get(request.request_id, ())
                  if b.block_hash is not None]  # fmt: skip
        self.tiers.offload(blocks)
        return len(blocks)

    # -- blocks another worker reads or writes (a prefix pulled by a peer) ---------

    def held_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the pool or a tier holds (no tier is
        read: a disk file's check waits for its restore)."""
        n = 0
        for h in hashes:
            if self.pool.lookup(h) is None and (self.tiers is None or not self.tiers.holds(h)):
                break
            n += 1
        return n

    def reserve(self, owner: str, hashes: Sequence[BlockHash]) -> tuple[int, list[int]]:
        """For a prompt's leading blocks `hashes`, of which a peer is to write those this
        cache lacks: how many leading ones it holds (`held_prefix`), and fresh blocks,
        as many as are free, for the rest. Held by `owner` until `commit` or `release`,
        with the pool's own blocks of the held prefix, so that the reservation cannot
        evict the head of the chain the written blocks continue."""
        self._check_owner(owner)
        have = self.held_prefix(hashes)
        pinned = [b for b in map(self.pool.lookup, hashes[:have]) if b is not None]
        self.pool.touch(pinned)
        fresh = self.pool.allocate(min(len(hashes) - have, self.pool.num_free))
        self.req_blocks[owner] = pinned + fresh
        self._req_num_cached[owner] = len(pinned)  # (where the fresh blocks start)
        return have, [b.block_id for b in fresh]

    def commit(self, owner: str, hashes: Sequence[BlockHash]) -> int:
        """The first `len(hashes)` of `owner`'s fresh blocks now hold those blocks' KV (a
        peer wrote it): cache them under their hashes, then let every block of the
        reservation go (the cached ones stay findable); how many were cached."""
        blocks = self.req_blocks.get(owner, [])
        fresh = blocks[self._req_num_cached.get(owner, 0) :]
        n = 0
        for b, h in zip(fresh, hashes, strict=False):
            n += self.pool.cache(b, h)  # False: a block already holds it (computed meanwhile)
        self.release(owner)
        return n

    def pin_cached(self, owner: str, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the leading `hashes` this cache holds, held by `owner` until
        `release` (for a peer to read): device blocks as they are, a tier's restored into
        fresh ones and cached; it stops at the first block held nowhere, or when no
        block is free for a restore."""
        self._check_owner(owner)
        blocks: list[KVBlock] = []
        self.req_blocks[owner] = blocks
        self._req_num_cached[owner] = 0
        for h in hashes:
            b = self.pool.lookup(h)
            if b is not None:
                self.pool.touch([b])
                blocks.append(b)
                continue
            row = self.tiers.lookup(h) if self.tiers is not None else None
            if row is None or self.pool.num_free == 0:
                break
            (b,) = self.pool.allocate(1)
            assert self.tiers is not None
            self.tiers.restore([b.block_id], [row])
            self.pool.cache(b, h)
            blocks.append(b)
        return [b.block_id for b in blocks]

    def release(self, owner: str) -> None:
        """Let go of the blocks `reserve` or `pin_cached` gave `owner`."""
        blocks = self.req_blocks.pop(owner, None)
        self._req_num_cached.pop(owner, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def _check_owner(self, owner: str) -> None:
        if owner in self.req_blocks:
            raise ValueError(f"{owner!r} holds blocks already")

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

"""The pool of KV blocks: reference counts, the prefix-cache map and LRU eviction.

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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

from protocol.block_hash import BlockHash


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
        self._fresh = fresh
        self._make = make

    def __len__(self) -> int:
        return self._len + len(self._fresh)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        if self._fresh:
            first = self._fresh.start
            self._fresh = self._fresh[1:]
            return self._make(first)
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
        for i in self._fresh:  # makes them: for checks and tests, not the hot path
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
        made.extend(KVBlock(j) for j in range(len(made), i + 1))
        return made[i]

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
        out = []
        evicted = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                evicted.append(b.block_hash)
                del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        if evicted and self.record_events:
            self.events.append(("removed", evicted))
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

    def drain_events(self) -> list[tuple[str, list[BlockHash]]]:
        ev, self.events = self.events, []
        return ev

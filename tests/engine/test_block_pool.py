"""FreeBlockQueue, BlockPool and the chained block hashes: the bottom of the KV bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.kv_cache import BlockPool, FreeBlockQueue, KVBlock

REPO = Path(__file__).resolve().parents[2]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# -- FreeBlockQueue ---------------------------------------------------------------------------


def test_queue_keeps_insertion_order() -> None:
    q = FreeBlockQueue([KVBlock(i) for i in range(1, 6)])
    assert len(q) == 5
    assert ids(q) == [1, 2, 3, 4, 5]


def test_queue_popleft_is_fifo_with_append() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks[:2])
    q.append(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.append(blocks[3])
    assert ids(q) == [1, 2, 0, 3]
    assert [q.popleft().block_id for _ in range(4)] == [1, 2, 0, 3]
    assert len(q) == 0
    with pytest.raises(IndexError, match="no free KV blocks"):
        q.popleft()


@pytest.mark.parametrize("victim", [0, 2, 4], ids=["head", "middle", "tail"])
def test_queue_remove_anywhere_keeps_the_rest_in_order(victim: int) -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[victim])
    rest = [i for i in range(5) if i != victim]
    assert ids(q) == rest
    assert len(q) == 4
    # unlinked: it can be appended again, and lands at the tail
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    q.append(blocks[victim])
    assert ids(q) == [*rest, victim]
    # walking backwards from the tail sentinel agrees with walking forwards
    back, b = [], q._tail.prev_free
    while b is not None and b is not q._head:
        back.append(b.block_id)
        b = b.prev_free
    assert back == list(reversed(ids(q)))


def test_queue_remove_all_then_popleft_raises() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    for b in (blocks[1], blocks[2], blocks[0]):
        q.remove(b)
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_queue_rejects_removing_a_block_it_does_not_hold() -> None:
    q = FreeBlockQueue([KVBlock(1)])
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(KVBlock(2))
    assert len(q) == 1


def test_queue_rejects_appending_a_linked_block() -> None:
    b = KVBlock(1)
    q = FreeBlockQueue([b])
    with pytest.raises(AssertionError):
        q.append(b)
    assert len(q) == 1


# -- BlockPool --------------------------------------------------------------------------------


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)
    assert BlockPool(2).num_free == 1


def test_fresh_pool_state() -> None:
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.num_free == 5
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    assert 0 not in ids(pool.free_queue)
    assert ids(pool.free_queue) == [1, 2, 3, 4, 5]
    assert pool.cached == {} and pool.events == []


def test_allocate_hands_out_referenced_blocks_never_the_null_block() -> None:
    pool = BlockPool(5)
    for _ in range(3):  # repeated full cycles never produce block 0
        got = pool.allocate(4)
        assert sorted(ids(got)) == [1, 2, 3, 4]
        assert all(b.ref_cnt == 1 for b in got)
        assert pool.num_free == 0
        pool.free(got)
    assert pool.allocate(0) == []


def test_allocate_too_many_fails_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(1)
    pool.cache(held[0], 111)
    pool.free(held)
    before = (ids(pool.free_queue), dict(pool.cached), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(RuntimeError, match="asked for 4 KV blocks, 3 free"):
        pool.allocate(4)
    assert (ids(pool.free_queue), dict(pool.cached), [b.ref_cnt for b in pool.blocks]) == before


def test_free_order_is_lru() -> None:
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    pool.free([c])
    pool.free([a])
    pool.free([d, b])  # a request frees tail first: d before b
    assert ids(pool.free_queue) == [3, 1, 4, 2]
    assert ids(pool.allocate(4)) == [3, 1, 4, 2]


def test_never_used_blocks_go_before_freed_ones() -> None:
    pool = BlockPool(5)
    (a,) = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    # the three never-used blocks are older in the queue than the freed cached one
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.lookup(7) is a


def test_shared_block_returns_to_the_queue_only_with_its_last_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, 5)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and b not in list(pool.free_queue)
    pool.free([b])
    assert b.ref_cnt == 0 and list(pool.free_queue)[-1] is b


def test_double_free_and_null_free_are_caught() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([pool.null_block])
    assert pool.null_block.ref_cnt == 1


def test_cache_makes_a_block_findable_and_it_stays_findable_when_free() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    assert pool.lookup(42) is None
    assert pool.cache(b, 42) is True
    assert pool.lookup(42) is b and b.block_hash == 42
    pool.free([b])
    assert pool.lookup(42) is b and b.block_hash == 42  # lazy: no eviction on free


def test_allocate_evicts_only_the_blocks_it_pops() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for h, b in zip((10, 11, 12), blocks):
        pool.cache(b, h)
    pool.free(reversed(blocks))  # queue: 3, 2, 1
    (got,) = pool.allocate(1)
    assert got is blocks[2] and got.block_hash is None and got.ref_cnt == 1
    assert pool.lookup(12) is None
    assert pool.lookup(10) is blocks[0] and pool.lookup(11) is blocks[1]
    assert set(pool.cached) == {10, 11}


def test_touch_unlinks_a_free_cached_block_so_allocate_cannot_evict_it() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], 100)
    pool.free(blocks)  # queue: 1, 2, 3 ; block 1 cached
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free == 2
    assert blocks[0] not in list(pool.free_queue)
    got = pool.allocate(2)
    assert blocks[0] not in got
    assert pool.lookup(100) is blocks[0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_touch_on_a_held_block_only_adds_a_reference() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    free_before = ids(pool.free_queue)
    pool.touch([b, b])
    assert b.ref_cnt == 3 and ids(pool.free_queue) == free_before


def test_cache_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, 9) is True
    assert pool.cache(b, 9) is False
    assert b.block_hash is None and pool.lookup(9) is a
    assert pool.cached == {9: a}


def test_cache_refuses_to_rename_a_cached_block() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    assert pool.cache(a, 1)
    assert pool.cache(a, 2) is False
    assert pool.cache(a, 1) is False
    assert a.block_hash == 1 and pool.cached == {1: a}


def test_cache_is_a_no_op_when_caching_is_off() -> None:
    pool = BlockPool(4, enable_caching=False)
    pool.record_events = True
    (a,) = pool.allocate(1)
    assert pool.cache(a, 1) is False
    assert a.block_hash is None and pool.cached == {} and pool.events == []


def test_reset_prefix_cache_refused_while_a_block_is_held() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, 1)
    pool.cache(b, 2)
    pool.free([a])
    assert pool.reset_prefix_cache() is False
    assert pool.cached == {1: a, 2: b} and a.block_hash == 1
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(x.block_hash is None for x in pool.blocks)
    assert pool.num_free == pool.num_usable_blocks
    assert pool.reset_prefix_cache() is True  # nothing left: still fine


def test_events_only_when_recording() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache(a, 1)
    pool.free([a])
    pool.allocate(3)
    assert pool.events == [] and pool.drain_events() == []


def test_events_stored_removed_and_drained() -> None:
    pool = BlockPool(4)
    pool.record_events = True
    blocks = pool.allocate(3)
    for h, b in zip((10, 11, 12), blocks):
        assert pool.cache(b, h)
    assert not pool.cache(blocks[0], 99)  # refused: no event
    pool.free(reversed(blocks))
    assert pool.drain_events() == [("stored", [10]), ("stored", [11]), ("stored", [12])]
    assert pool.events == []
    pool.allocate(2)  # evicts the tail of the chain first
    assert pool.drain_events() == [("removed", [12, 11])]
    pool.free([b for b in pool.blocks[1:] if b.ref_cnt])
    assert pool.reset_prefix_cache()
    assert pool.drain_events() == [("removed", [10])]
    assert pool.reset_prefix_cache()
    assert pool.drain_events() == []  # nothing removed, nothing reported

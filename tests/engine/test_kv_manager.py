"""KVCacheManager: prefix lookup, slot allocation, caching, freeing, and the invariant checker."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.kv_cache import KVCacheManager, hash_blocks
from engine.request import Request
from protocol.sampling import SamplingParams

BS = 4  # block size used throughout


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        rid, tokens, SamplingParams(max_tokens=None), max_model_len=10_000, cache_salt=salt
    )


def assert_sound(kv: KVCacheManager) -> None:
    problems = kv.check_invariants()
    assert problems == [], problems


def assert_idle(kv: KVCacheManager) -> None:
    assert_sound(kv)
    assert kv.is_idle(), (kv.num_free_blocks, kv.pool.num_usable_blocks, list(kv.req_blocks))
    assert kv.usage == 0.0


def compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Pretend a forward pass computed `n` more tokens of `req` (slots must exist)."""
    req.num_computed_tokens += n
    assert len(kv.req_blocks[req.request_id]) * BS >= req.num_computed_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


def admit(kv: KVCacheManager, req: Request) -> bool:
    """Prefix lookup + allocation for the whole uncomputed prompt, as the scheduler does."""
    hit = kv.find_prefix(req)
    if not kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit):
        return False
    req.num_computed_tokens = hit.num_tokens
    return True


def run_prompt(kv: KVCacheManager, req: Request) -> None:
    assert admit(kv, req)
    compute(kv, req, req.num_tokens - req.num_computed_tokens)


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        [b.block_id for b in pool.free_queue],
        {rid: [b.block_id for b in bl] for rid, bl in kv.req_blocks.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached.items()},
        dict(kv._req_num_cached),
    )


# -- find_prefix ------------------------------------------------------------------------------


def test_find_prefix_on_an_empty_cache() -> None:
    kv = KVCacheManager(16, BS)
    hit = kv.find_prefix(make_req("a", list(range(20))))
    assert hit.blocks == [] and hit.num_tokens == 0


@pytest.mark.parametrize(
    ("n_tokens", "expect_blocks"),
    [(12, 2), (13, 3), (9, 2), (8, 1), (5, 1), (4, 0), (1, 0)],
)
def test_find_prefix_never_counts_the_last_token(n_tokens: int, expect_blocks: int) -> None:
    kv = KVCacheManager(16, BS)
    base = list(range(50, 66))  # 16 tokens: 4 full blocks get cached
    a = make_req("a", base)
    run_prompt(kv, a)
    kv.free(a)
    hit = kv.find_prefix(make_req("b", base[:n_tokens]))
    assert len(hit.blocks) == expect_blocks
    assert hit.num_tokens == expect_blocks * BS
    assert hit.num_tokens < n_tokens
    assert hit.blocks == [kv.pool.lookup(h) for h in hash_blocks(base, BS)[:expect_blocks]]


def test_find_prefix_uses_full_blocks_only() -> None:
    kv = KVCacheManager(16, BS)
    a = make_req("a", list(range(10)))  # blocks: 2 full + 2 tokens
    run_prompt(kv, a)
    assert len(kv.pool.cached) == 2
    kv.free(a)
    # b shares all 10 tokens with a, plus more: only the 2 full blocks can hit
    hit = kv.find_prefix(make_req("b", [*range(10), 77, 78, 79, 80, 81]))
    assert hit.num_tokens == 8


def test_find_prefix_stops_at_the_first_miss() -> None:
    kv = KVCacheManager(6, BS)  # 5 usable blocks
    a = make_req("a", list(range(13)))  # 3 full blocks + 1 token
    run_prompt(kv, a)
    b0, b1, b2 = kv.req_blocks["a"][:3]
    kv.free(a)
    # Move b2 to the tail of the LRU queue so that b1 is evicted while b2 stays cached.
    kv.pool.touch([b2])
    kv.pool.free([b2])
    order = [b.block_id for b in kv.pool.free_queue]
    n_before_b1 = order.index(b1.block_id) + 1
    kv.pool.free(kv.pool.allocate(n_before_b1))
    assert b1.block_hash is None and b0.block_hash is not None and b2.block_hash is not None
    hit = kv.find_prefix(make_req("c", list(range(13))))
    assert hit.blocks == [b0] and hit.num_tokens == BS
    assert_idle(kv)


def test_find_prefix_with_caching_off() -> None:
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = make_req("a", list(range(12)))
    run_prompt(kv, a)
    assert kv.pool.cached == {}
    kv.free(a)
    assert kv.find_prefix(make_req("b", list(range(13)))).num_tokens == 0
    assert_idle(kv)


def test_cache_salt_separates_tenants() -> None:
    kv = KVCacheManager(16, BS)
    toks = list(range(13))
    a = make_req("a", toks, salt="t1")
    run_prompt(kv, a)
    kv.free(a)
    assert kv.find_prefix(make_req("b", toks)).num_tokens == 0
    assert kv.find_prefix(make_req("c", toks, salt="t2")).num_tokens == 0
    assert kv.find_prefix(make_req("d", toks, salt="t1")).num_tokens == 12


# -- allocate_slots ---------------------------------------------------------------------------


def test_allocate_slots_grows_a_block_at_a_time() -> None:
    kv = KVCacheManager(16, BS)
    r = make_req("r", list(range(6)))
    assert kv.allocate_slots(r, 6)
    assert len(kv.block_ids("r")) == 2 and kv.num_free_blocks == 13
    compute(kv, r, 6)
    for tok, expect_blocks in [(100, 2), (101, 2), (102, 3)]:
        r.append_token(tok)
        assert kv.allocate_slots(r, 1)
        assert len(kv.block_ids("r")) == expect_blocks
        compute(kv, r, 1)
    assert 0 not in kv.block_ids("r")
    assert len(set(kv.block_ids("r"))) == 3
    assert kv.usage == pytest.approx(3 / 15)
    assert_sound(kv)
    kv.free(r)
    assert_idle(kv)


def test_allocate_slots_fails_without_changing_anything() -> None:
    kv = KVCacheManager(5, BS)  # 4 usable
    a = make_req("a", list(range(8)))
    run_prompt(kv, a)  # 2 blocks, both cached
    before = snapshot(kv)
    big = make_req("big", list(range(100, 113)))  # needs 4 blocks, 2 free
    assert kv.allocate_slots(big, 13) is False
    assert snapshot(kv) == before
    # growing a request that already holds blocks: same all-or-nothing rule
    assert kv.allocate_slots(a, 8 + 3 * BS) is False
    assert snapshot(kv) == before
    assert_sound(kv)
    kv.free(a)
    assert_idle(kv)


def _cached_prefix_then_free(kv: KVCacheManager, prefix: list[int]) -> None:
    a = make_req("a", prefix)
    run_prompt(kv, a)
    kv.free(a)


def test_free_cached_hit_blocks_are_not_counted_twice() -> None:
    """A free-but-cached hit block leaves the free queue when touched: it is no longer
    available for the new blocks of the same request."""
    prefix = list(range(8))  # 2 full blocks, cached and free after `a` ends
    for extra_blocks, fits in [(7, True), (8, False)]:
        kv = KVCacheManager(10, BS)  # 9 usable: 2 free cached + 7 free fresh
        _cached_prefix_then_free(kv, prefix)
        assert kv.num_free_blocks == 9
        b = make_req("b", prefix + list(range(500, 500 + extra_blocks * BS)))
        hit = kv.find_prefix(b)
        assert hit.num_tokens == 8
        before = snapshot(kv)
        # 7 new blocks fit beside the 2 touched hits; 8 do not, though 9 blocks are "free"
        ok = kv.allocate_slots(b, b.num_tokens - 8, hit)
        assert ok is fits
        if fits:
            assert kv.num_free_blocks == 9 - 2 - extra_blocks
            assert kv.req_blocks["b"][:2] == hit.blocks
            assert all(blk.ref_cnt == 1 for blk in kv.req_blocks["b"])
        else:
            assert snapshot(kv) == before
        assert_sound(kv)
        kv.free(b)
        assert_idle(kv)


def test_held_hit_blocks_cost_no_free_blocks() -> None:
    prefix = list(range(8))
    kv = KVCacheManager(10, BS)
    holder = make_req("holder", [*prefix, 1])
    run_prompt(kv, holder)  # holds 3 blocks, the first 2 cached
    assert kv.num_free_blocks == 6
    b = make_req("b", prefix + list(range(500, 500 + 6 * BS)))
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8 and all(blk.ref_cnt == 1 for blk in hit.blocks)
    assert kv.allocate_slots(b, b.num_tokens - 8, hit)  # 6 new blocks, exactly what is free
    assert kv.num_free_blocks == 0
    assert [blk.ref_cnt for blk in hit.blocks] == [2, 2]
    assert_sound(kv)
    kv.free(holder)
    kv.free(b)
    assert_idle(kv)


# -- cache_blocks -----------------------------------------------------------------------------


def test_cache_blocks_registers_only_full_computed_blocks() -> None:
    kv = KVCacheManager(16, BS)
    toks = list(range(30, 41))  # 11 tokens: 2 full blocks
    r = make_req("r", toks)
    assert kv.allocate_slots(r, 11)
    hs = hash_blocks(toks, BS)
    kv.cache_blocks(r, 3)
    assert kv.pool.cached == {}
    kv.cache_blocks(r, 4)
    assert kv.pool.lookup(hs[0]) is kv.req_blocks["r"][0] and len(kv.pool.cached) == 1
    kv.cache_blocks(r, 7)
    assert len(kv.pool.cached) == 1
    kv.cache_blocks(r, 11)
    assert len(kv.pool.cached) == 2 and kv.pool.lookup(hs[1]) is kv.req_blocks["r"][1]
    assert kv.req_blocks["r"][2].block_hash is None  # partial block never cached
    # the partial block becomes full only once the generated token is computed
    r.num_computed_tokens = 11
    r.append_token(99)
    assert kv.allocate_slots(r, 1)
    kv.cache_blocks(r, 11)
    assert len(kv.pool.cached) == 2
    kv.cache_blocks(r, 12)
    assert kv.pool.lookup(hash_blocks([*toks, 99], BS)[2]) is kv.req_blocks["r"][2]
    assert_sound(kv)
    kv.free(r)
    assert_idle(kv)
    assert len(kv.pool.cached) == 3  # still findable after free


def test_cache_blocks_ignores_unknown_requests_and_caching_off() -> None:
    kv = KVCacheManager(8, BS)
    kv.cache_blocks(make_req("ghost", list(range(8))), 8)
    assert kv.pool.cached == {}
    kv2 = KVCacheManager(8, BS, enable_caching=False)
    r = make_req("r", list(range(8)))
    assert kv2.allocate_slots(r, 8)
    kv2.cache_blocks(r, 8)
    assert kv2.pool.cached == {}
    kv2.free(r)
    assert_idle(kv2)


def test_concurrent_duplicate_prefills_cache_once() -> None:
    kv = KVCacheManager(16, BS)
    toks = list(range(9))
    a, b = make_req("a", toks), make_req("b", toks)
    assert admit(kv, a) and admit(kv, b)  # neither finds the other: nothing computed yet
    compute(kv, a, 9)
    compute(kv, b, 9)
    hs = hash_blocks(toks, BS)
    assert [kv.pool.lookup(h) for h in hs] == kv.req_blocks["a"][:2]
    assert all(blk.block_hash is None for blk in kv.req_blocks["b"])
    assert_sound(kv)
    kv.free(a)
    kv.free(b)
    c = make_req("c", toks)
    hit = kv.find_prefix(c)
    assert hit.blocks == [kv.pool.lookup(h) for h in hs]
    assert_idle(kv)


def test_hit_blocks_are_not_recached() -> None:
    kv = KVCacheManager(16, BS)
    toks = list(range(12))
    _cached_prefix_then_free(kv, toks)
    kv.pool.record_events = True
    b = make_req("b", [*toks, 5, 6, 7, 8, 9])
    run_prompt(kv, b)
    ev = kv.pool.drain_events()
    # b hit 3 blocks and computed one more full block: only that one is "stored"
    assert ev == [("stored", [hash_blocks(b.all_token_ids, BS)[3]])]
    kv.free(b)
    assert_idle(kv)


# -- free -------------------------------------------------------------------------------------


def test_free_returns_to_baseline_and_frees_tail_first() -> None:
    kv = KVCacheManager(8, BS)
    r = make_req("r", list(range(12)))
    run_prompt(kv, r)
    held = kv.req_blocks["r"]
    kv.free(r)
    assert_idle(kv)
    tail_part = [b.block_id for b in kv.pool.free_queue][-3:]
    assert tail_part == [held[2].block_id, held[1].block_id, held[0].block_id]
    kv.free(r)  # a second free is harmless
    kv.free(make_req("never", [1]))
    assert_idle(kv)


def test_eviction_takes_the_tail_of_a_chain_first() -> None:
    kv = KVCacheManager(4, BS)  # 3 usable, all used by the chain
    toks = list(range(12))
    _cached_prefix_then_free(kv, toks)
    hs = hash_blocks(toks, BS)
    other = make_req("o", [7] * 3)
    assert kv.allocate_slots(other, 3)  # takes one block: the chain's tail
    assert kv.pool.lookup(hs[2]) is None
    assert kv.pool.lookup(hs[0]) is not None and kv.pool.lookup(hs[1]) is not None
    assert kv.find_prefix(make_req("again", [*toks, 0])).num_tokens == 8
    kv.free(other)
    assert_idle(kv)


# -- check_invariants -------------------------------------------------------------------------


def busy_manager() -> KVCacheManager:
    """Two requests sharing a cached prefix, plus free cached blocks: a realistic state."""
    kv = KVCacheManager(12, BS)
    _cached_prefix_then_free(kv, list(range(100, 112)))
    a = make_req("a", [*range(8), 1, 2, 3])
    run_prompt(kv, a)
    b = make_req("b", [*range(8), 9, 9, 9, 9, 9])
    run_prompt(kv, b)
    assert kv.req_blocks["a"][:2] == kv.req_blocks["b"][:2]
    assert_sound(kv)
    return kv


def _ref_too_high(kv: KVCacheManager) -> None:
    kv.req_blocks["a"][-1].ref_cnt += 1


def _ref_too_low(kv: KVCacheManager) -> None:
    kv.req_blocks["a"][0].ref_cnt -= 1


def _held_and_free(kv: KVCacheManager) -> None:
    kv.pool.free_queue.append(kv.req_blocks["a"][-1])


def _leaked_request(kv: KVCacheManager) -> None:
    del kv.req_blocks["b"]  # blocks still referenced, nobody holds them


def _held_twice(kv: KVCacheManager) -> None:
    blk = kv.req_blocks["a"][-1]
    kv.req_blocks["a"].append(blk)
    blk.ref_cnt += 1


def _holds_null(kv: KVCacheManager) -> None:
    kv.req_blocks["a"].append(kv.pool.null_block)
    kv.pool.null_block.ref_cnt += 1


def _null_in_free_queue(kv: KVCacheManager) -> None:
    kv.pool.null_block.ref_cnt = 0
    kv.pool.free_queue.append(kv.pool.null_block)


def _shared_uncached(kv: KVCacheManager) -> None:
    blk = kv.req_blocks["a"][-1]  # a's partial, uncached block
    kv.req_blocks["b"].append(blk)
    blk.ref_cnt += 1


def _cache_points_elsewhere(kv: KVCacheManager) -> None:
    h = kv.req_blocks["a"][0].block_hash
    kv.pool.cached[h] = kv.req_blocks["a"][-1]


def _hash_without_entry(kv: KVCacheManager) -> None:
    kv.req_blocks["a"][-1].block_hash = 12345


def _entry_without_hash(kv: KVCacheManager) -> None:
    blk = kv.req_blocks["a"][0]
    blk.block_hash = None


def _stale_cache_entry(kv: KVCacheManager) -> None:
    kv.pool.cached[999] = kv.req_blocks["a"][-1]


def _queue_length_lies(kv: KVCacheManager) -> None:
    kv.pool.free_queue._len += 1


def _free_block_unlinked(kv: KVCacheManager) -> None:
    # a ref-0 block silently dropped from the free queue: it can never be allocated again
    kv.pool.free_queue.popleft()


CORRUPTIONS: dict[str, tuple[Callable[[KVCacheManager], None], str]] = {
    "ref count too high": (_ref_too_high, "ref_cnt"),
    "ref count too low": (_ref_too_low, "ref_cnt"),
    "block both free and held": (_held_and_free, "free-queue membership"),
    "request dropped without free": (_leaked_request, "holders"),
    "request holds a block twice": (_held_twice, "twice"),
    "request holds the null block": (_holds_null, "null block"),
    "null block in the free queue": (_null_in_free_queue, "null block"),
    "uncached block shared": (_shared_uncached, "not cached"),
    "cache map points at the wrong block": (_cache_points_elsewhere, "cache maps"),
    "block hash missing from the map": (_hash_without_entry, "carry a hash"),
    "map entry whose block lost its hash": (_entry_without_hash, "cache maps"),
    "stale map entry": (_stale_cache_entry, "cache maps"),
    "free queue length wrong": (_queue_length_lies, "free queue length"),
    "free block lost from the queue": (_free_block_unlinked, "free-queue membership"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_invariants_detects_corruption(name: str) -> None:
    corrupt, expect = CORRUPTIONS[name]
    kv = busy_manager()
    corrupt(kv)
    problems = kv.check_invariants()
    assert problems, f"{name}: not detected"
    assert any(expect in p for p in problems), problems


def test_is_idle_is_false_while_anything_is_held() -> None:
    kv = KVCacheManager(8, BS)
    r = make_req("r", [1, 2, 3])
    assert kv.allocate_slots(r, 3)
    assert not kv.is_idle()
    kv.free(r)
    assert kv.is_idle()
    kv.pool.allocate(1)  # a block taken behind the manager's back
    assert not kv.is_idle()


# -- randomized stress ------------------------------------------------------------------------


class SlotModel:
    """What each KV slot holds, to check that prefix hits return the right tokens."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, req: Request, start: int, end: int) -> None:
        blocks = self.kv.req_blocks[req.request_id]
        for p in range(start, end):
            blk = blocks[p // BS]
            assert blk.ref_cnt == 1, f"writing into block {blk.block_id} shared with others"
            self.slots[(blk.block_id, p % BS)] = req.all_token_ids[p]

    def check(self, req: Request, end: int) -> None:
        blocks = self.kv.req_blocks[req.request_id]
        for p in range(end):
            got = self.slots.get((blocks[p // BS].block_id, p % BS))
            assert got == req.all_token_ids[p], f"{req.request_id} position {p}"


def test_randomized_stress_keeps_every_invariant() -> None:
    rng = random.Random(20240611)
    kv = KVCacheManager(40, BS)
    kv.pool.record_events = True
    slots = SlotModel(kv)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(0, 20))] for _ in range(5)]
    salts = [None, None, None, "tenant"]
    live: list[Request] = []
    n_hits = n_refused = n_ops = 0
    next_id = 0

    def check() -> None:
        nonlocal n_ops
        n_ops += 1
        problems = kv.check_invariants()
        assert problems == [], (n_ops, problems)

    for _ in range(1500):
        op = rng.random()
        if op < 0.35 or not live:
            tail = [rng.randrange(1000) for _ in range(rng.randrange(0, 14))]
            tokens = rng.choice(prefixes) + tail
            if not tokens:
                tokens = [rng.randrange(1000)]
            req = make_req(f"r{next_id}", tokens, salt=rng.choice(salts))
            next_id += 1
            hit = kv.find_prefix(req)
            n_hits += hit.num_tokens > 0
            chunk = rng.randint(1, req.num_tokens - hit.num_tokens)
            before = snapshot(kv)
            if kv.allocate_slots(req, chunk, hit):
                req.num_computed_tokens = hit.num_tokens
                slots.check(req, hit.num_tokens)
                live.append(req)
            else:
                n_refused += 1
                assert snapshot(kv) == before
                kv.free(req)  # drops its hash list: the request is gone
        elif op < 0.75:
            req = rng.choice(live)
            end = min(
                len(kv.req_blocks[req.request_id]) * BS, req.num_tokens
            )  # compute what has slots
            if end > req.num_computed_tokens:
                slots.write(req, req.num_computed_tokens, end)
                req.num_computed_tokens = end
                kv.cache_blocks(req, end)
            elif end == req.num_tokens:  # prompt done: decode one more token
                req.append_token(rng.randrange(1000))
            grow = min(rng.randint(0, 6), req.num_tokens - req.num_computed_tokens)
            before = snapshot(kv)
            if not kv.allocate_slots(req, grow):
                n_refused += 1
                assert snapshot(kv) == before
        else:
            req = live.pop(rng.randrange(len(live)))
            kv.free(req)
        check()
    for req in live:
        kv.free(req)
    assert_idle(kv)
    assert n_hits > 50 and n_refused > 20, (n_hits, n_refused)  # the test exercised both
    events = kv.pool.drain_events()
    stored = sum(len(h) for k, h in events if k == "stored")
    removed = sum(len(h) for k, h in events if k == "removed")
    assert stored - removed == len(kv.pool.cached)
    assert kv.pool.reset_prefix_cache()
    assert_idle(kv)
    assert kv.pool.cached == {}

"""The routers' prefix index: longest held prefix per worker, dumps, purges, predictions."""

from __future__ import annotations

import random

from runtime.kv_index import KvIndex, PredictedIndex


def chain(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_match_counts_leading_blocks_per_worker() -> None:
    idx = KvIndex()
    idx.stored("a", chain(10))
    idx.stored("b", chain(4))
    idx.stored("c", chain(3, base=100))
    assert idx.match(chain(8)) == {"a": 8, "b": 4}
    assert idx.match(chain(12)) == {"a": 10, "b": 4}
    assert idx.match(chain(3, base=100)) == {"c": 3}
    assert idx.match([999, 0, 1]) == {}
    assert idx.match([]) == {}


def test_a_hole_ends_the_match() -> None:
    idx = KvIndex()
    idx.stored("a", [0, 1, 3, 4])  # block 2 was evicted
    assert idx.match(chain(5)) == {"a": 2}


def test_removed_snapshot_and_purge() -> None:
    idx = KvIndex()
    idx.stored("a", chain(6))
    idx.stored("b", chain(6))
    idx.removed("a", [4, 5])
    assert idx.match(chain(6)) == {"a": 4, "b": 6}
    idx.replace("b", {0, 1, 7})
    assert idx.match(chain(6)) == {"a": 4, "b": 2}
    assert idx.hashes("b") == {0, 1, 7}
    idx.remove_worker("a")
    assert idx.match(chain(6)) == {"b": 2}
    assert idx.num_blocks() == 3
    idx.add_worker("d")  # takes a's slot: nothing of a's may show as d's
    assert idx.match(chain(6)) == {"b": 2}
    idx.clear("b")
    assert idx.num_blocks() == 0 and idx.match(chain(2)) == {}
    assert idx._holders == {}


def test_matches_a_brute_force_model() -> None:
    rng = random.Random(7)
    idx = KvIndex()
    truth: dict[str, set[int]] = {}
    workers = [f"w{i}" for i in range(70)]  # more than 64: bitmasks grow past a word
    for _ in range(3000):
        w = rng.choice(workers)
        op = rng.random()
        hashes = chain(rng.randrange(1, 12), base=rng.randrange(3) * 1000)
        if op < 0.5:
            idx.stored(w, hashes)
            truth.setdefault(w, set()).update(hashes)
        elif op < 0.8:
            idx.removed(w, hashes)
            truth.get(w, set()).difference_update(hashes)
        elif op < 0.9:
            snap = set(rng.sample(range(20), 10))
            idx.replace(w, snap)
            truth[w] = set(snap)
        else:
            idx.remove_worker(w)
            truth.pop(w, None)
        query = chain(rng.randrange(1, 15), base=rng.randrange(3) * 1000)
        expect = {}
        for wid, held in truth.items():
            k = 0
            while k < len(query) and query[k] in held:
                k += 1
            if k:
                expect[wid] = k
        assert idx.match(query) == expect
        assert idx.num_blocks(w) == len(truth.get(w, ())) and idx.hashes(w) == truth.get(w, set())
        assert idx.holds(w, hashes[0]) == (hashes[0] in truth.get(w, ()))
    assert idx.num_blocks() == sum(len(held) for held in truth.values())


def test_a_block_with_one_holder_shares_that_holder_s_int() -> None:
    """A fleet-sized index holds millions of blocks, most on one worker: they share one
    int per worker slot instead of one each (an int past 2**60 is 36-60 bytes)."""
    idx = KvIndex()
    for i in range(100):
        idx.add_worker(f"w{i}")
    idx.stored("w99", chain(50))
    idx.stored("w98", chain(10))
    idx.removed("w98", chain(10))  # back to one holder
    masks = list(idx._holders.values())
    assert len(masks) == 50 and all(m is masks[0] for m in masks) and masks[0] == 1 << 99


def test_predictions_expire_and_respect_capacity() -> None:
    p = PredictedIndex(ttl_s=10.0)
    p.add_worker("a", capacity=5)
    p.predict("a", chain(4), now=0.0)
    assert p.match(chain(4), now=5.0) == {"a": 4}
    p.predict("a", chain(2), now=8.0)  # used again: blocks 0-1 live on until 18
    assert p.match(chain(4), now=12.0) == {"a": 2}
    assert p.match(chain(4), now=19.0) == {}
    p.predict("a", chain(4, base=50), now=20.0)
    p.predict("a", chain(3, base=90), now=21.0)  # 7 > capacity 5: the oldest go
    assert p.match(chain(4, base=50), now=21.0) == {}
    assert p.match(chain(3, base=90), now=21.0) == {"a": 3}
    assert p.index.num_blocks("a") == 5
    p.remove_worker("a")
    assert p.match(chain(3, base=90), now=21.0) == {}

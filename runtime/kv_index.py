"""Which workers hold which KV blocks, for routers: block hash -> the workers holding it.

Workers report their prefix caches as chained block hashes (``protocol/kv_layout.py``):
a block's hash names its whole prefix, so "worker w holds the first k blocks of this
prompt" is "w holds hash k-1 and every hash before it". The index keeps one dict from
hash to a bitmask of worker slots::

    holders   {h0: 0b0110, h1: 0b0010, ...}     bit s = the worker in slot s holds h

and nothing per worker but a count: applying a dump or purging a worker that left
walks the index (rare), so a cached block costs one dict entry, and a block with one
holder (most) shares that holder's int.

:meth:`match` walks a prompt's hashes once, narrowing the mask of workers that still
match, so a decision costs one dict lookup per prompt block whatever the fleet size.

:class:`PredictedIndex` is the same index for a router without KV events: it records
what the router's own routing predicts each worker caches, forgets it after a
time-to-live, and never predicts more than a worker's pool can hold.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._count: dict[str, int] = {}  # worker -> how many hashes it holds
        self._slot: dict[str, int] = {}
        self._worker_of: list[str | None] = []
        # one int object per slot: a block with one holder (most of them) maps to it,
        # instead of to an int of its own (up to 60 bytes in a fleet of 256)
        self._bits: list[int] = []

    # -- workers ------------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._slot:
            return
        try:
            slot = self._worker_of.index(None)
        except ValueError:
            slot = len(self._worker_of)
            self._worker_of.append(None)
            self._bits.append(1 << slot)
        self._worker_of[slot] = worker_id
        self._slot[worker_id] = slot
        self._count[worker_id] = 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it was said to hold."""
        if worker_id not in self._slot:
            return
        self.clear(worker_id)
        slot = self._slot.pop(worker_id)
        del self._count[worker_id]
        self._worker_of[slot] = None

    @property
    def workers(self) -> list[str]:
        return list(self._slot)

    # -- changes ------------------------------------------------------------------------
    def stored(self, worker_id: str, hashes: Iterable[int]) -> None:
        self.add_worker(worker_id)
        bit = self._bits[self._slot[worker_id]]
        holders = self._holders
        added = 0
        for h in hashes:
            old = holders.get(h)
            if old is None:
                holders[h] = bit
            elif not old & bit:
                holders[h] = old | bit
            else:
                continue
            added += 1
        self._count[worker_id] += added

    def removed(self, worker_id: str, hashes: Iterable[int]) -> None:
        slot = self._slot.get(worker_id)
        if slot is None:
            return
        bit, bits = self._bits[slot], self._bits
        holders = self._holders
        gone = 0
        for h in hashes:
            old = holders.get(h, 0)
            if not old & bit:
                continue
            gone += 1
            left = old ^ bit
            if not left:
                del holders[h]
            elif left & (left - 1):
                holders[h] = left
            else:  # one holder left: its shared bit
                holders[h] = bits[left.bit_length() - 1]
        self._count[worker_id] -= gone

    def clear(self, worker_id: str) -> None:
        if self._count.get(worker_id):
            self.removed(worker_id, self.hashes(worker_id))

    def replace(self, worker_id: str, hashes: Collection[int]) -> None:
        """A full dump of the worker's cache: afterwards it holds exactly ``hashes``."""
        self.add_worker(worker_id)
        wanted = hashes if isinstance(hashes, (set, frozenset)) else set(hashes)
        self.removed(worker_id, [h for h in self.hashes(worker_id) if h not in wanted])
        self.stored(worker_id, wanted)

    # -- questions ----------------------------------------------------------------------
    def holds(self, worker_id: str, block_hash: int) -> bool:
        slot = self._slot.get(worker_id)
        return slot is not None and bool(self._holders.get(block_hash, 0) >> slot & 1)

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Blocks held by one worker, or (None) entries in the whole index."""
        if worker_id is None:
            return sum(self._count.values())
        return self._count.get(worker_id, 0)

    def hashes(self, worker_id: str) -> frozenset[int]:
        """What the worker holds: a walk over the whole index (for a dump or a purge,
        not per request)."""
        slot = self._slot.get(worker_id)
        if slot is None or not self._count[worker_id]:
            return frozenset()
        bit = self._bits[slot]
        return frozenset(h for h, mask in self._holders.items() if mask & bit)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding at least the first block: how many leading blocks of
        ``hashes`` it holds (a chained hash holds its prefix, so the first miss ends it)."""
        if not hashes:
            return {}
        holders = self._holders
        mask = holders.get(hashes[0], 0)
        matched: dict[str, int] = {}
        if not mask:
            return matched
        for i in range(1, len(hashes)):
            still = holders.get(hashes[i], 0) & mask
            if still != mask:
                self._credit(matched, mask & ~still, i)
                mask = still
                if not mask:
                    return matched
        self._credit(matched, mask, len(hashes))
        return matched

    def _credit(self, matched: dict[str, int], mask: int, n: int) -> None:
        worker_of = self._worker_of
        while mask:
            low = mask & -mask
            worker = worker_of[low.bit_length() - 1]
            if worker is not None:
                matched[worker] = n
            mask ^= low


class PredictedIndex:
    """A :class:`KvIndex` of predictions: :meth:`predict` says a worker will hold these
    blocks (it was just sent a request over them); a prediction lasts ``ttl_s`` after
    its last use and a worker never holds more than its ``capacity`` (the oldest go
    first, as its pool would evict them). Times come from the caller's clock."""

    def __init__(self, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.index = KvIndex()
        self._expiry: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        # every prediction in the order made, so that expiring costs what expires, not a
        # look at each worker per decision (the clock never goes back: expiry times grow)
        self._made: deque[tuple[float, str, int]] = deque()

    def add_worker(self, worker_id: str, capacity: int | None = None) -> None:
        self.index.add_worker(worker_id)
        self._expiry.setdefault(worker_id, OrderedDict())
        if capacity:
            self._capacity[worker_id] = capacity

    def remove_worker(self, worker_id: str) -> None:
        self.index.remove_worker(worker_id)
        self._expiry.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def predict(self, worker_id: str, hashes: Sequence[int], now: float) -> None:
        self.add_worker(worker_id)
        order = self._expiry[worker_id]
        until = now + self.ttl_s
        made = self._made
        for h in hashes:
            order[h] = until
            order.move_to_end(h)
            made.append((until, worker_id, h))
        self.index.stored(worker_id, hashes)
        self._trim(worker_id, now)

    def forget(self, worker_id: str, hashes: Iterable[int] | None = None) -> None:
        """Drop predictions (all of a worker's with None): the worker said otherwise."""
        order = self._expiry.get(worker_id)
        if order is None:
            return
        if hashes is None:
            self.index.clear(worker_id)
            order.clear()
            return
        gone = [h for h in hashes if order.pop(h, None) is not None]
        self.index.removed(worker_id, gone)

    def expire(self, now: float) -> None:
        made, gone = self._made, dict[str, list[int]]()
        while made and made[0][0] <= now:
            until, worker_id, h = made.popleft()
            order = self._expiry.get(worker_id)
            # skip one renewed since (a later prediction of h), or trimmed, or forgotten
            if order is not None and order.get(h) == until:
                del order[h]
                gone.setdefault(worker_id, []).append(h)
        for worker_id, hashes in gone.items():
            self.index.removed(worker_id, hashes)

    def _trim(self, worker_id: str, now: float) -> None:
        order = self._expiry[worker_id]
        cap = self._capacity.get(worker_id)
        gone: list[int] = []
        while order:
            h, until = next(iter(order.items()))
            if until > now and (cap is None or len(order) <= cap):
                break
            order.popitem(last=False)
            gone.append(h)
        if gone:
            self.index.removed(worker_id, gone)

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        self.expire(now)
        return self.index.match(hashes)

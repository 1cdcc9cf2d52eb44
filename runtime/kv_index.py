"""Which workers hold which KV blocks, for routers: block hash -> the workers holding it.

Workers report their prefix caches as chained block hashes (``protocol/kv_layout.py``):
a block's hash names its whole prefix, so "worker w holds the first k blocks of this
prompt" is "w holds hash k-1 and every hash before it". The index keeps one dict from
hash to a bitmask of worker slots, and per worker the set of its hashes (to apply a
dump as a difference and to purge a worker that left)::

    holders   {h0: 0b0110, h1: 0b0010, ...}     bit s = the worker in slot s holds h
    blocks    {"decode-1": {h0, h1}, "decode-2": {h0}}

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
        self._blocks: dict[str, set[int]] = {}
        self._slot: dict[str, int] = {}
        self._worker_of: list[str | None] = []

    # -- workers ------------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._slot:
            return
        try:
            slot = self._worker_of.index(None)
        except ValueError:
            slot = len(self._worker_of)
            self._worker_of.append(None)
        self._worker_of[slot] = worker_id
        self._slot[worker_id] = slot
        self._blocks[worker_id] = set()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it was said to hold."""
        if worker_id not in self._slot:
            return
        self.clear(worker_id)
        slot = self._slot.pop(worker_id)
        del self._blocks[worker_id]
        self._worker_of[slot] = None

    @property
    def workers(self) -> list[str]:
        return list(self._slot)

    # -- changes ------------------------------------------------------------------------
    def stored(self, worker_id: str, hashes: Iterable[int]) -> None:
        self.add_worker(worker_id)
        bit = 1 << self._slot[worker_id]
        own = self._blocks[worker_id]
        holders = self._holders
        for h in hashes:
            if h not in own:
                own.add(h)
                holders[h] = holders.get(h, 0) | bit

    def removed(self, worker_id: str, hashes: Iterable[int]) -> None:
        own = self._blocks.get(worker_id)
        if own is None:
            return
        keep = ~(1 << self._slot[worker_id])
        holders = self._holders
        for h in hashes:
            if h in own:
                own.discard(h)
                left = holders[h] & keep
                if left:
                    holders[h] = left
                else:
                    del holders[h]

    def clear(self, worker_id: str) -> None:
        own = self._blocks.get(worker_id)
        if own:
            self.removed(worker_id, list(own))

    def replace(self, worker_id: str, hashes: Collection[int]) -> None:
        """A full dump of the worker's cache: afterwards it holds exactly ``hashes``."""
        self.add_worker(worker_id)
        own = self._blocks[worker_id]
        wanted = hashes if isinstance(hashes, (set, frozenset)) else set(hashes)
        self.removed(worker_id, [h for h in own if h not in wanted])
        self.stored(worker_id, (h for h in wanted if h not in own))

    # -- questions ----------------------------------------------------------------------
    def holds(self, worker_id: str, block_hash: int) -> bool:
        own = self._blocks.get(worker_id)
        return own is not None and block_hash in own

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Blocks held by one worker, or (None) entries in the whole index."""
        if worker_id is None:
            return sum(len(b) for b in self._blocks.values())
        return len(self._blocks.get(worker_id, ()))

    def hashes(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._blocks.get(worker_id, ()))

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

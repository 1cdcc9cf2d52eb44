"""Session holds: a conversation's blocks stay on the device between its turns.

An agent's turn ends, then a tool runs for seconds before the next turn arrives with
the whole history as its prompt. Freed at the end of the turn, the history's blocks
join the prefix cache's LRU and, under pressure from other sessions, are evicted (to
the host tier when there is one, else to nothing) just before they are needed again.
A session hold keeps the last finished turn of each session allocated, so the next
turn's prefix match finds it on the device:

* a turn of session S that finishes (stop or length; not an abort or an error) is
  held, and S's previous hold is let go (after: the blocks the two share never drop
  to no owner);
* a hold idle for `ttl_s` seconds is moved to the host tier when there is one (its
  blocks copied there now, while the engine waits for the tool, not when an allocation
  evicts them; `engine/kv_cache/tiers.py`) and let go: its blocks join the LRU, still
  a device hit until they are handed out again;
* holds yield to requests: when the pool cannot give a running or waiting request
  its blocks, the oldest hold is let go before anything is preempted or made to wait.

Pure bookkeeping over `KVCacheManager`: the caller passes the time (the scheduler's
clock), so the same code runs live and in a simulation.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv_cache.manager import KVCacheManager
from engine.request import Request


class SessionHolds:
    def __init__(self, kv: KVCacheManager, ttl_s: float) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        # session id -> (its last finished turn, when it finished); oldest first
        self._held: OrderedDict[str, tuple[Request, float]] = OrderedDict()
        self.num_released_for_room = 0  # holds let go because a request needed blocks
        self.num_expired = 0  # holds let go after ttl_s idle

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._held

    @property
    def num_blocks(self) -> int:
        """Blocks the held turns own (a block two turns share counts once per turn)."""
        blocks = self.kv.req_blocks  # (read after every step: no id lists built)
        return sum(len(blocks.get(r.request_id, ())) for r, _ in self._held.values())

    def keep(self, req: Request, now: float) -> bool:
        """Hold finished `req`'s blocks for its session; False when it is not held (holds
        off, or no session), and the caller frees them."""
        sid = req.session_id
        if self.ttl_s <= 0 or sid is None:
            return False
        old = self._held.pop(sid, None)
        self._held[sid] = (req, now)
        if old is not None:
            self.kv.free(old[0])
        return True

    def expire(self, now: float) -> int:
        """Let go of the holds idle for `ttl_s` or longer; how many."""
        n = 0
        while self._held:
            sid, (req, since) = next(iter(self._held.items()))
            if now - since < self.ttl_s:
                break
            del self._held[sid]
            self.kv.offload(req)
            self.kv.free(req)
            n += 1
        self.num_expired += n
        return n

    def release_oldest(self) -> bool:
        """Let go of the oldest hold to make room; False when none is left."""
        if not self._held:
            return False
        _, (req, _) = self._held.popitem(last=False)
        self.kv.free(req)
        self.num_released_for_room += 1
        return True

    def release_request(self, request_id: str) -> bool:
        """Let go of the hold of the finished turn `request_id`, if one is held (a new
        request reuses its id); whether one was."""
        for sid, (req, _) in self._held.items():
            if req.request_id == request_id:
                del self._held[sid]
                self.kv.free(req)
                return True
        return False

    def release_all(self) -> None:
        while self.release_oldest():
            pass

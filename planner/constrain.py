"""CONSTRAIN: turn a policy's proposals into the replicas each pool is asked for.

A pool's first target is what runs: the sizes the caller adopts (`initial`, or
`adopt` with what the connector says it runs), else the replicas ready at the first
tick, within the pool's limits; the first decision says so ("started from N running").
Then, applied in this order to each pool, every rule naming itself in the decision's
reason:

  1. traffic stopped: no request for `idle_s` means the pool's minimum, whatever the
     policy says (scale-down at zero traffic, which Dynamo's planner does not do; with
     a minimum of 0, to zero). Requests the frontends hold because the decode pool has
     no worker are demand no policy sees yet (nothing arrives at a worker, nothing
     finishes): they raise an empty decode pool to one at once, cooldown or not;
  2. the pool's min and max replicas;
  3. one pending change per pool: while the replicas ready differ from the last
     target, hold it (a level-triggered controller re-asks for it every tick), except
     that a pending change may be raised: a backlog that keeps growing while workers
     start is sized for at once, not one pending step at a time (no cooldown for it);
  4. cooldowns: no growth within `up_cooldown_s` of the pool's last change, no
     shrinking within `down_cooldown_s` of it, nor within the longer of
     `down_cooldown_s` and `idle_s` of the first decision (the size adopted is the
     operator's: kept until the planner has watched the fleet as long as it would
     before calling it idle, not cut on the first ticks because no traffic is
     measured yet);
  5. a shrink goes only as far as the most any tick asked for within the last
     `down_cooldown_s` (a stabilization window, as Kubernetes' HPA has: a noisy
     forecast does not take a worker away one tick and ask for it back the next);
  6. the accelerator budget both pools share (a replica costs `cost` accelerators,
     its tensor-parallel size): growth beyond it is cut, shared between the
     growing pools in proportion to what each asked for.

A decision is made every tick, changed or not, so the log shows why a pool held.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from planner.observation import POOLS
from planner.policy import Proposal


@dataclass(frozen=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 8
    cost: int = 1  # accelerators per replica

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"replica limits need 0 <= min <= max, got {self.min_replicas}, {self.max_replicas}"
            )
        if self.cost < 1:
            raise ValueError(f"a replica costs at least one accelerator, got {self.cost}")


@dataclass(frozen=True)
class Limits:
    prefill: PoolLimits = PoolLimits()
    decode: PoolLimits = PoolLimits()
    budget: int | None = None  # accelerators for both pools together
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    idle_s: float = 60.0

    def __post_init__(self) -> None:
        floor = self.prefill.min_replicas * self.prefill.cost
        floor += self.decode.min_replicas * self.decode.cost
        if self.budget is not None and self.budget < floor:
            raise ValueError(
                f"the budget of {self.budget} accelerators is below the minimums' {floor}"
            )

    def of(self, pool: str) -> PoolLimits:
        return self.prefill if pool == "prefill" else self.decode


@dataclass(frozen=True)
class Decision:
    time: float
    pool: str
    previous: int  # the target before this tick
    target: int
    ready: int
    reason: str
    first: bool = False  # the pool's first decision, from the size adopted

    @property
    def changed(self) -> bool:
        return self.target != self.previous


@dataclass
class _PoolState:
    target: int
    last_change: float = -math.inf
    first: bool = True  # no decision made yet
    started: float = -math.inf  # when the first decision kept the size adopted
    adopted: str = ""  # where the first target came from
    wanted: deque[tuple[float, int]] = field(default_factory=deque)  # (time, n) asked


@dataclass
class Constrainer:
    limits: Limits
    initial: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pools: dict[str, _PoolState] = {}
        self.adopt(self.initial, "given")

    def adopt(self, sizes: dict[str, int], source: str) -> None:
        """Start from `sizes` (what runs, as `source` says), for pools not decided yet."""
        for pool, n in sizes.items():
            state = self._pools.get(pool)
            if pool in POOLS and (state is None or state.first):
                self._pools[pool] = _PoolState(self._clamped(pool, n), adopted=f"{n} {source}")

    def _clamped(self, pool: str, n: int) -> int:
        lim = self.limits.of(pool)
        return min(max(n, lim.min_replicas), lim.max_replicas)

    def target(self, pool: str) -> int:
        state = self._pools.get(pool)
        return state.target if state is not None else self.limits.of(pool).min_replicas

    def apply(
        self,
        now: float,
        proposals: list[Proposal],
        ready: dict[str, int],
        idle_for_s: float,
        held: int = 0,
    ) -> list[Decision]:
        """``held``: requests the frontends hold for a decode worker (the pool has none)."""
        self.adopt({p: ready.get(p, 0) for p in POOLS if p not in self._pools}, "ready")
        wanted: dict[str, tuple[int, str]] = {}
        by_pool = {p.pool: p for p in proposals}
        for pool in POOLS:
            state, lim = self._pools[pool], self.limits.of(pool)
            proposal = by_pool.get(pool)
            n, reason = (
                (proposal.replicas, proposal.reason) if proposal else (state.target, "no proposal")
            )
            if state.first:
                state.started = now
            if idle_for_s >= self.limits.idle_s:
                n, reason = lim.min_replicas, f"no traffic for {idle_for_s:.0f} s: the minimum"
            woken = pool == "decode" and held > 0 and state.target < 1
            if woken and n < 1:
                n, reason = 1, f"requests held with no decode worker ({held}): one, now"
            if n < lim.min_replicas or n > lim.max_replicas:
                clamped = min(max(n, lim.min_replicas), lim.max_replicas)
                reason += f"; {n} clamped to [{lim.min_replicas}, {lim.max_replicas}]"
                n = clamped
            window = self._remember(state, now, n)
            pending = ready.get(pool, 0) != state.target
            if n > state.target and pending:
                reason = (
                    f"raising a pending change ({ready.get(pool, 0)} of {state.target} "
                    f"ready): {reason}"
                )
            elif n != state.target and pending:
                reason = (
                    f"holding {state.target}: {ready.get(pool, 0)} ready, a change is pending "
                    f"(wanted {n}: {reason})"
                )
                n = state.target
            elif woken:
                pass  # from zero: no cooldown
            elif n > state.target and now - state.last_change < self.limits.up_cooldown_s:
                reason = f"holding {state.target}: up-cooldown (wanted {n}: {reason})"
                n = state.target
            elif n < state.target and (
                now - state.last_change < self.limits.down_cooldown_s
                or (
                    now - state.started < max(self.limits.down_cooldown_s, self.limits.idle_s)
                    and idle_for_s < self.limits.idle_s  # else: measured idle, not unknown
                )
            ):
                reason = f"holding {state.target}: down-cooldown (wanted {n}: {reason})"
                n = state.target
            elif n < state.target and window > n:
                kept = min(window, state.target)
                reason = (
                    f"{'holding' if kept == state.target else 'down to'} {kept}: the most "
                    f"asked in the last {self.limits.down_cooldown_s:g} s (wanted {n}: {reason})"
                )
                n = kept
            wanted[pool] = (n, reason)
        wanted = self._within_budget(wanted)
        decisions = []
        for pool in POOLS:
            state = self._pools[pool]
            n, reason = wanted[pool]
            if state.first:
                reason = f"started from {state.target} ({state.adopted}); {reason}"
            decisions.append(
                Decision(now, pool, state.target, n, ready.get(pool, 0), reason, state.first)
            )
            state.first = False
            if n != state.target:
                state.target, state.last_change = n, now
        return decisions

    def _remember(self, state: _PoolState, now: float, n: int) -> int:
        """Record what this tick asks for; the most asked within the down-cooldown."""
        state.wanted.append((now, n))
        while state.wanted[0][0] < now - self.limits.down_cooldown_s:
            state.wanted.popleft()
        return max(m for _, m in state.wanted)

    def _within_budget(self, wanted: dict[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
        budget = self.limits.budget
        if budget is None:
            return wanted
        cost = {p: self.limits.of(p).cost for p in POOLS}
        kept = {p: min(wanted[p][0], self._pools[p].target) for p in POOLS}
        growth = {p: wanted[p][0] - kept[p] for p in POOLS}
        room = budget - sum(kept[p] * cost[p] for p in POOLS)
        asked = sum(growth[p] * cost[p] for p in POOLS)
        if asked <= room:
            return wanted
        out = dict(wanted)
        for p in POOLS:
            if growth[p]:
                share = room * growth[p] * cost[p] / asked if asked else 0
                granted = min(growth[p], max(int(share // cost[p]), 0))
                n = kept[p] + granted
                out[p] = (n, f"{wanted[p][1]}; cut to {n} by the budget of {budget} accelerators")
        return out

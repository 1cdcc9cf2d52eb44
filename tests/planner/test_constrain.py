"""CONSTRAIN: limits, one pending change, cooldowns, the shared budget, zero traffic."""

from __future__ import annotations

import pytest

from planner.constrain import Constrainer, Limits, PoolLimits
from planner.policy import Proposal


def _props(prefill: int, decode: int) -> list[Proposal]:
    return [Proposal("prefill", prefill, "p"), Proposal("decode", decode, "d")]


def _targets(decisions: list) -> dict[str, int]:  # type: ignore[type-arg]
    return {d.pool: d.target for d in decisions}


LIMITS = Limits(PoolLimits(1, 6), PoolLimits(1, 6), budget=None, up_cooldown_s=10,
                down_cooldown_s=60, idle_s=30)  # fmt: skip


def test_limits_clamp_and_say_so() -> None:
    c = Constrainer(LIMITS)
    ds = c.apply(0.0, _props(0, 9), {"prefill": 1, "decode": 1}, 0.0)
    assert _targets(ds) == {"prefill": 1, "decode": 6}
    assert "clamped to [1, 6]" in ds[1].reason and ds[1].changed and not ds[0].changed


def test_one_pending_change_per_pool_then_cooldowns() -> None:
    c = Constrainer(LIMITS)
    c.apply(0.0, _props(3, 1), {"prefill": 1, "decode": 1}, 0.0)
    # not ready yet: a smaller count is held (the change is pending)...
    ds = c.apply(20.0, _props(2, 1), {"prefill": 2, "decode": 1}, 0.0)
    assert ds[0].target == 3 and "pending" in ds[0].reason
    # ...a larger one raises the pending change at once, cooldown or not
    ds = c.apply(21.0, _props(5, 1), {"prefill": 2, "decode": 1}, 0.0)
    assert ds[0].target == 5 and "raising a pending change (2 of 3 ready)" in ds[0].reason
    ds = c.apply(25.0, _props(6, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 5 and "up-cooldown" in ds[0].reason
    ds = c.apply(40.0, _props(2, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 5 and "down-cooldown" in ds[0].reason
    ds = c.apply(90.0, _props(2, 1), {"prefill": 5, "decode": 1}, 0.0)
    assert ds[0].target == 2


def test_the_first_tick_starts_from_what_runs_and_says_so() -> None:
    # 2P2D running, the minimum 1: the first tick keeps 2 where the policy asks 2
    c = Constrainer(LIMITS)
    ds = c.apply(0.0, _props(2, 2), {"prefill": 2, "decode": 2}, 0.0)
    assert _targets(ds) == {"prefill": 2, "decode": 2}
    assert all(d.first and "started from 2 (2 ready)" in d.reason for d in ds)
    assert not any(d.first for d in c.apply(30.0, _props(2, 2), {"prefill": 2, "decode": 2}, 0))
    # sizes the connector runs (workers still starting) win over the replicas ready,
    # and a smaller proposal waits for them rather than shrinking the pool under them
    c = Constrainer(LIMITS)
    c.adopt({"prefill": 3, "decode": 2}, "running on local")
    ds = c.apply(0.0, _props(1, 2), {"prefill": 1, "decode": 0}, 0.0)
    assert _targets(ds) == {"prefill": 3, "decode": 2}
    assert "started from 3 (3 running on local)" in ds[0].reason and "pending" in ds[0].reason
    # beyond the limits, the limits
    c = Constrainer(LIMITS)
    ds = c.apply(0.0, _props(7, 1), {"prefill": 9, "decode": 0}, 0.0)
    assert _targets(ds) == {"prefill": 6, "decode": 1}


def test_the_budget_cuts_growth_in_proportion() -> None:
    lim = Limits(PoolLimits(1, 16), PoolLimits(1, 16, cost=2), budget=12, up_cooldown_s=0)
    c = Constrainer(lim, {"prefill": 2, "decode": 2})  # 2 + 4 = 6 accelerators in use
    ds = c.apply(0.0, _props(8, 5), {"prefill": 2, "decode": 2}, 0.0)
    t = _targets(ds)
    assert t["prefill"] * 1 + t["decode"] * 2 <= 12
    assert t["prefill"] > 2 and t["decode"] > 2  # both grew
    assert all("budget" in d.reason for d in ds)


def test_no_traffic_goes_to_the_minimum_whatever_the_policy_says() -> None:
    c = Constrainer(LIMITS, {"prefill": 4, "decode": 4})
    ready = {"prefill": 4, "decode": 4}
    assert _targets(c.apply(100.0, _props(4, 4), ready, 10.0)) == ready
    ds = c.apply(200.0, _props(4, 4), ready, 31.0)
    assert _targets(ds) == {"prefill": 1, "decode": 1}
    assert "no traffic" in ds[0].reason


def test_bad_limits_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        PoolLimits(3, 2)
    with pytest.raises(ValueError, match="below the minimums"):
        Limits(PoolLimits(2, 4), PoolLimits(2, 4), budget=3)


def test_held_requests_wake_an_empty_decode_pool_at_once() -> None:
    """Scaled to zero on idle, a request arrives: the frontend holds it, no policy sees it
    (nothing reaches a worker or finishes), and the up-cooldown of the scale-down would
    hold the pool at zero. Held requests raise it to one, now."""
    lim = Limits(PoolLimits(0, 4), PoolLimits(0, 4), up_cooldown_s=600, down_cooldown_s=0,
                 idle_s=30)  # fmt: skip
    c = Constrainer(lim, {"prefill": 0, "decode": 1})
    ds = c.apply(100.0, _props(0, 1), {"prefill": 0, "decode": 1}, 40.0)
    assert _targets(ds) == {"prefill": 0, "decode": 0} and "no traffic" in ds[1].reason
    ds = c.apply(110.0, _props(0, 0), {"prefill": 0, "decode": 0}, 0.0)
    assert _targets(ds)["decode"] == 0  # nothing held: stays at zero
    ds = c.apply(120.0, _props(0, 0), {"prefill": 0, "decode": 0}, 0.0, held=3)
    assert _targets(ds) == {"prefill": 0, "decode": 1}
    assert "requests held with no decode worker (3)" in ds[1].reason


def test_the_size_adopted_is_kept_for_a_down_cooldown() -> None:
    """2P2D started by the operator, no traffic measured yet: the first ticks keep 2
    (the old planner cut it to its minimum on the first tick) for the longer of the
    down-cooldown and the idle timeout; growth is not held."""
    c = Constrainer(LIMITS)  # down-cooldown 60 s, idle 30 s
    ds = c.apply(0.0, _props(0, 0), {"prefill": 2, "decode": 2}, 0.0)
    assert _targets(ds) == {"prefill": 2, "decode": 2}
    assert all("started from 2" in d.reason and "down-cooldown" in d.reason for d in ds)
    ds = c.apply(59.0, _props(0, 4), {"prefill": 2, "decode": 2}, 0.0)
    assert _targets(ds) == {"prefill": 2, "decode": 4}  # up at once, down held
    ds = c.apply(61.0, _props(0, 4), {"prefill": 2, "decode": 2}, 0.0)
    assert _targets(ds) == {"prefill": 1, "decode": 4}
    c = Constrainer(Limits(PoolLimits(1, 6), PoolLimits(1, 6), down_cooldown_s=10, idle_s=30))
    c.apply(0.0, _props(0, 0), {"prefill": 2, "decode": 2}, 0.0)
    assert _targets(c.apply(29.0, _props(0, 0), {"prefill": 2, "decode": 2}, 29.0))["prefill"] == 2
    assert _targets(c.apply(31.0, _props(0, 0), {"prefill": 2, "decode": 2}, 31.0))["prefill"] == 1


def test_a_noisy_forecast_does_not_flap_a_pool() -> None:
    """Asked 4, 3, 4, 3 on alternate ticks (a noisy forecast): the pool stays at 4; it
    shrinks once a whole down-cooldown asked for less, and only to the most asked."""
    lim = Limits(PoolLimits(1, 6), PoolLimits(1, 6), up_cooldown_s=0, down_cooldown_s=12,
                 idle_s=10)  # fmt: skip
    c = Constrainer(lim, {"prefill": 1, "decode": 4})
    ready = {"prefill": 1, "decode": 4}
    c.apply(0.0, _props(1, 4), ready, 0.0)
    targets = [_targets(c.apply(t, _props(1, 3 + t // 3 % 2), ready, 0.0))["decode"]
               for t in range(15, 45, 3)]  # fmt: skip
    assert targets == [4] * len(targets)
    for t in range(45, 54, 3):
        ds = c.apply(float(t), _props(1, 3 if t < 51 else 2), ready, 0.0)
        assert ds[1].target == 4 and "the most asked in the last 12 s" in ds[1].reason
    ds = c.apply(54.0, _props(1, 2), ready, 0.0)  # 3 still asked within 12 s
    assert ds[1].target == 3 and "down to 3" in ds[1].reason

"""The planner's tick: PREDICT -> PROPOSE -> CONSTRAIN over a load that steps up and
back down, driven by observation times alone (no clock)."""

from __future__ import annotations

import pytest

from planner import Limits, LoadPolicy, Observation, Planner, PoolLimits, SlaPolicy, StepCapacity


def _sla_planner(**kw: object) -> Planner:
    cap = StepCapacity(prefill_s=lambda n: 0.02 + 0.001 * n,
                       decode_step_s=lambda b, ctx: 0.01 + 0.001 * b)  # fmt: skip
    limits = Limits(PoolLimits(1, 10), PoolLimits(1, 10), budget=16, up_cooldown_s=0,
                    down_cooldown_s=0, idle_s=30)  # fmt: skip
    return Planner(SlaPolicy(cap, 2.0, 0.05), limits, **kw)  # type: ignore[arg-type]


def _run(planner: Planner, phases: list[tuple[int, float, float, float]]) -> list[dict[str, int]]:
    """Each phase: ticks, rate, input and output tokens; replicas become ready at once."""
    t, ready, seen = 0.0, {"prefill": 1, "decode": 1}, []
    for ticks, rate, inp, out in phases:
        for _ in range(ticks):
            t += 10.0
            r = planner.tick(Observation(t, rate, inp, out, ready=dict(ready)))
            ready = {d.pool: d.target for d in r.decisions}
            seen.append(ready)
    return seen


def test_pools_follow_their_own_signals_and_return_to_the_minimum() -> None:
    seen = _run(_sla_planner(), [(3, 2.0, 300, 100), (3, 2.0, 1500, 100), (3, 2.0, 300, 1500),
                                 (5, 0.0, 0, 0)])  # fmt: skip
    base, prompts, outputs, idle = seen[2], seen[5], seen[8], seen[-1]
    assert prompts["prefill"] > base["prefill"] and prompts["decode"] == base["decode"]
    assert outputs["decode"] > base["decode"] and outputs["prefill"] == base["prefill"]
    assert idle == {"prefill": 1, "decode": 1}


def test_dry_run_reports_every_change_without_waiting_for_it() -> None:
    planner = _sla_planner(dry_run=True)
    t = 0.0
    for _ in range(3):
        t += 10
        r = planner.tick(Observation(t, 8.0, 1500, 800, ready={"prefill": 1, "decode": 1}))
    assert planner.target("prefill") > 1 and planner.target("decode") > 1
    assert not any("pending" in d.reason for d in r.decisions)


def test_the_load_policy_through_the_core() -> None:
    limits = Limits(PoolLimits(1, 4), PoolLimits(1, 4), up_cooldown_s=0, down_cooldown_s=0)
    planner = Planner(LoadPolicy(), limits)
    r = planner.tick(Observation(1.0, 1.0, 100, 10, prefill_queue_depth=30,
                                 ready={"prefill": 1, "decode": 1}))  # fmt: skip
    assert planner.target("prefill") == 2 and planner.target("decode") == 1
    assert [d.changed for d in r.decisions] == [True, False]


def test_a_tick_is_exported_as_planner_metrics() -> None:
    from prometheus_client import generate_latest

    from planner.metrics import PlannerMetrics

    metrics = PlannerMetrics()
    planner = _sla_planner()
    metrics.record(planner.tick(Observation(10.0, 4.0, 1500, 200, ready={"prefill": 1,
                                                                       "decode": 1})))  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    assert 'diptych_planner_desired_replicas{pool="prefill"}' in text
    up = 'diptych_planner_decisions_total{direction="up",pool="prefill",rule="limits"} 1.0'
    assert up in text
    assert "diptych_planner_predicted_request_rate 4.0" in text


def test_lookahead_sizes_for_the_load_when_new_workers_are_ready() -> None:
    ahead = _sla_planner(predictor="holt", lookahead_ticks=3)
    now = _sla_planner(predictor="holt")
    for t in range(30):
        obs = Observation(10.0 * (t + 1), 1.0 + t, 500, 100, ready={"prefill": 1, "decode": 1})
        fa, fn = ahead.tick(obs).forecast, now.tick(obs).forecast
    assert fn.request_rate == pytest.approx(31.0, rel=0.02)
    assert fa.request_rate == pytest.approx(33.0, rel=0.02)

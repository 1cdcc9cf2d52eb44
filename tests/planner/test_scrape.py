"""OBSERVE's pure half on the expositions the real metrics objects produce."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from decode_worker.metrics import DecodeMetrics
from frontend.metrics import FrontendMetrics
from planner.scrape import Snapshot, observe, quantile
from prefill_worker.metrics import PrefillMetrics


def _snap(metrics: object) -> Snapshot:
    return Snapshot.parse(generate_latest(metrics.registry).decode())  # type: ignore[attr-defined]


def test_an_interval_from_two_rounds_of_real_expositions() -> None:
    front = FrontendMetrics()
    front.e2e.observe(100.0)  # before the interval: must not count
    front.prompt_tokens.inc(1000)
    old = _snap(front)
    for i in range(20):
        front.e2e.observe(1.0)
        front.ttft.observe(0.2 if i < 19 else 3.0)
        front.itl.observe(0.02)
        front.prompt_tokens.inc(500)
        front.generation_tokens.inc(100)
    new = _snap(front)
    dec = DecodeMetrics()
    dec.kv_used_blocks.set(30)
    dec.kv_total_blocks.set(100)
    dec.queue_depth.set(3)
    dec.oldest_remote.set(0.7)
    dec.running.set(12)
    pre = PrefillMetrics()
    pre.kv_used_blocks.set(5)
    pre.kv_total_blocks.set(50)
    d, p = _snap(dec), _snap(pre)
    obs = observe(50.0, 10.0, (old, new), {"decode": [(d, d), (d, d)], "prefill": [(p, p)]})
    assert obs.request_rate == pytest.approx(2.0)
    assert (obs.mean_input_tokens, obs.mean_output_tokens) == (500.0, 100.0)
    assert obs.ttft_p50_s is not None and 0.1 <= obs.ttft_p50_s <= 0.25
    assert obs.ttft_p99_s is not None and obs.ttft_p99_s > 1.0  # the one slow request
    assert obs.itl_p50_s is not None and obs.itl_p50_s <= 0.025
    assert obs.kv_usage == {"decode": pytest.approx(0.3), "prefill": pytest.approx(0.1)}
    assert (obs.prefill_queue_depth, obs.running_requests) == (3, 24)
    assert obs.prefill_queue_age_s == pytest.approx(0.7)
    assert obs.ready == {"prefill": 1, "decode": 2}


def test_an_idle_interval_and_a_restarted_frontend() -> None:
    front = FrontendMetrics()
    for _ in range(5):
        front.e2e.observe(1.0)
    old = _snap(front)
    idle = observe(10.0, 10.0, (old, old), {})
    assert idle.request_rate == 0 and idle.ttft_p99_s is None and idle.ready["decode"] == 0
    restarted = FrontendMetrics()
    restarted.e2e.observe(1.0)
    assert observe(20.0, 10.0, (old, _snap(restarted)), {}).request_rate == pytest.approx(0.1)


def test_quantile_interpolates_inside_a_bucket_like_promql() -> None:
    new = [(0.1, 0.0), (0.2, 10.0), (float("inf"), 10.0)]
    assert quantile(0.5, new, []) == pytest.approx(0.15)
    assert quantile(0.5, new, new) is None

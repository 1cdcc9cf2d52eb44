"""OBSERVE's pure half on the expositions the real metrics objects produce."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from decode_worker.metrics import DecodeMetrics
from frontend.metrics import FrontendMetrics
from planner.observation import Slo
from planner.scrape import Snapshot, attainment, observe, quantile
from prefill_worker.metrics import PrefillMetrics


def _snap(metrics: object) -> Snapshot:
    return Snapshot.parse(generate_latest(metrics.registry).decode())  # type: ignore[attr-defined]


def test_an_interval_from_two_rounds_of_real_expositions() -> None:
    front = FrontendMetrics()
    front.e2e.observe(100.0)  # before the interval: must not count
    front.prompt_tokens.inc(1000)
    old = _snap(front)
    for i in range(24):  # admitted: 20 finished, 4 still in flight
        front.arrivals.inc()
        front.prompt_length.observe(300 if i % 2 else 700)
    front.in_flight.set(4)
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
    dec.reasoning_tokens.inc(300)  # d1 thought 300 tokens in the interval
    d1 = _snap(dec)
    obs = observe(50.0, 10.0, (old, new),
                  {"decode": {"d0": (d, d), "d1": (d, d1)}, "prefill": {"p0": (p, p)}})  # fmt: skip
    assert obs.reasoning_tokens_per_s == pytest.approx(30.0)
    assert obs.request_rate == pytest.approx(2.4)  # admitted, not finished
    assert (obs.mean_input_tokens, obs.mean_output_tokens) == (500.0, 100.0)
    # E[x^2] = 290,000 from bucket middles (309 and 618): within a half-octave's error
    assert obs.mean_input_tokens_sq == pytest.approx(290_000, rel=0.2)
    assert obs.in_flight == 4
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
    restarted.arrivals.inc()
    restarted.e2e.observe(1.0)
    assert observe(20.0, 10.0, (old, _snap(restarted)), {}).request_rate == pytest.approx(0.1)


def test_a_frontend_without_admission_counts_is_read_by_finished_requests() -> None:
    front = FrontendMetrics()
    old = _snap(front)
    for _ in range(10):
        front.e2e.observe(1.0)
        front.prompt_tokens.inc(200)
    new = _snap(front)
    for snap in (old, new):  # as an older frontend exports it
        for name in list(snap.samples):
            if "generation_requests" in name or "request_prompt_tokens" in name:
                del snap.samples[name]
    obs = observe(10.0, 10.0, (old, new), {})
    assert obs.request_rate == pytest.approx(1.0) and obs.mean_input_tokens == 200.0


PROMETHEUS_TEXT = {
    "frontend": """
# TYPE diptych_frontend_requests_total counter
diptych_frontend_requests_total{endpoint="/v1/completions",status="200"} %(ok)d
diptych_frontend_requests_total{endpoint="/v1/completions",status="429"} %(shed)d
diptych_frontend_requests_total{endpoint="/v1/chat/completions",status="503"} %(unavailable)d
diptych_frontend_requests_total{endpoint="/ready",status="503"} %(probes)d
# TYPE diptych_frontend_requests_held gauge
diptych_frontend_requests_held %(held)d
# TYPE diptych_frontend_time_to_first_token_seconds histogram
diptych_frontend_time_to_first_token_seconds_bucket{le="0.5"} %(fast)d
diptych_frontend_time_to_first_token_seconds_bucket{le="2.0"} %(fast)d
diptych_frontend_time_to_first_token_seconds_bucket{le="40.0"} %(all)d
diptych_frontend_time_to_first_token_seconds_bucket{le="+Inf"} %(all)d
diptych_frontend_time_to_first_token_seconds_count %(all)d
diptych_frontend_time_to_first_token_seconds_sum 0
# TYPE diptych_frontend_inter_token_latency_seconds histogram
diptych_frontend_inter_token_latency_seconds_bucket{le="0.05"} %(gaps_fast)d
diptych_frontend_inter_token_latency_seconds_bucket{le="0.1"} %(gaps_fast)d
diptych_frontend_inter_token_latency_seconds_bucket{le="0.2"} %(gaps)d
diptych_frontend_inter_token_latency_seconds_bucket{le="+Inf"} %(gaps)d
diptych_frontend_inter_token_latency_seconds_count %(gaps)d
diptych_frontend_inter_token_latency_seconds_sum 0
""",
    "decode": """
# TYPE diptych_worker_running_requests gauge
diptych_worker_running_requests 16
# TYPE diptych_worker_waiting_requests gauge
diptych_worker_waiting_requests 40
# TYPE diptych_worker_kv_used_blocks gauge
diptych_worker_kv_used_blocks 75
# TYPE diptych_worker_kv_total_blocks gauge
diptych_worker_kv_total_blocks 100
# TYPE diptych_worker_start_time_seconds gauge
diptych_worker_start_time_seconds 1.7e9
# TYPE diptych_worker_ready_seconds gauge
diptych_worker_ready_seconds 42.5
""",
    "prefill": """
# TYPE diptych_worker_prefills_in_flight gauge
diptych_worker_prefills_in_flight 2
# TYPE diptych_worker_start_time_seconds gauge
diptych_worker_start_time_seconds 1.7e9
# TYPE diptych_worker_ready_seconds gauge
diptych_worker_ready_seconds 0
""",
}


def test_refusals_attainment_and_each_worker_from_scraped_text() -> None:
    """What the dashboard shows beside TTFT, from Prometheus text as scraped: the 429s
    and 503s of the generation endpoints (not the readiness probe's), the held
    requests, the SLA attainment per interval, and a row per worker."""
    before = {"ok": 100, "shed": 5, "unavailable": 1, "probes": 50, "held": 0, "fast": 10,
              "all": 10, "gaps_fast": 1000, "gaps": 1000}  # fmt: skip
    after = {"ok": 180, "shed": 25, "unavailable": 11, "probes": 90, "held": 3, "fast": 40,
             "all": 50, "gaps_fast": 1900, "gaps": 2000}  # fmt: skip
    old = Snapshot.parse(PROMETHEUS_TEXT["frontend"] % before)
    new = Snapshot.parse(PROMETHEUS_TEXT["frontend"] % after)
    dec = Snapshot.parse(PROMETHEUS_TEXT["decode"])
    pre = Snapshot.parse(PROMETHEUS_TEXT["prefill"])
    workers = {"decode": {"decode-1": (dec, dec)}, "prefill": {"prefill-1": (pre, pre)}}
    # the TTFT target 1 s falls inside the (0.5, 2] bucket: counted up to 0.5 s
    obs = observe(10.0, 10.0, (old, new), workers, Slo(ttft_s=1.0, itl_s=0.1))
    assert obs.refused_429_rate == pytest.approx(2.0) and obs.refused_503_rate == 1.0
    assert obs.refused_rate == pytest.approx(3.0) and obs.held == 3
    assert obs.ttft_attainment == pytest.approx(30 / 40)
    assert obs.itl_attainment == pytest.approx(900 / 1000)
    assert (obs.running_requests, obs.waiting_requests) == (16, 40)
    decode, prefill = sorted(obs.workers, key=lambda w: w.pool)
    assert (decode.worker_id, decode.running, decode.waiting) == ("decode-1", 16, 40)
    assert decode.kv_usage == pytest.approx(0.75) and decode.ready_s == 42.5
    assert decode.started == 1.7e9
    assert (prefill.worker_id, prefill.running, prefill.kv_usage) == ("prefill-1", 2, None)
    assert prefill.ready_s is None  # 0: not registered yet
    # no SLO given, or no request in the interval: no attainment to speak of
    assert observe(10.0, 10.0, (old, new), workers).ttft_attainment is None
    assert observe(10.0, 10.0, (new, new), workers, Slo(1.0, 0.1)).ttft_attainment is None


def test_attainment_counts_up_to_the_largest_bound_not_above_the_target() -> None:
    new = [(0.1, 6.0), (0.2, 9.0), (float("inf"), 10.0)]
    assert attainment(0.2, new, []) == pytest.approx(0.9)
    assert attainment(0.15, new, []) == pytest.approx(0.6)  # a lower bound
    assert attainment(0.05, new, []) == 0.0
    assert attainment(0.2, new, new) is None


def test_quantile_interpolates_inside_a_bucket_like_promql() -> None:
    new = [(0.1, 0.0), (0.2, 10.0), (float("inf"), 10.0)]
    assert quantile(0.5, new, []) == pytest.approx(0.15)
    assert quantile(0.5, new, new) is None


async def test_a_dns_url_stands_for_every_address_its_name_has() -> None:
    from planner.source import ScrapeError, frontend_addresses

    urls = await frontend_addresses(["dns+http://localhost:8000", "http://10.0.0.9:8000"])
    assert "http://127.0.0.1:8000" in urls and urls[-1] == "http://10.0.0.9:8000"
    assert all(u.startswith("http://") for u in urls)
    with pytest.raises(ScrapeError, match="cannot resolve"):
        await frontend_addresses(["dns+http://no-such-frontend.invalid:8000"])

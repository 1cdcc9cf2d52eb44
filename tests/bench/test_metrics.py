"""The metric math against hand-computed cases (vLLM's definitions)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.metrics import (
    RequestResult,
    compute_metrics,
    peak_concurrency,
    peak_output_rate,
    queue_metrics,
    summarize,
)
from bench.slo import is_good, parse_goodput


def ok(prompt: int, out: int, ttft: float, itl: list[float], start: float) -> RequestResult:
    latency = ttft + sum(itl)
    return RequestResult(True, prompt, out, ttft, itl, latency, start, tag="t")


def failed(prompt: int, ttft: float, itl: list[float], start: float) -> RequestResult:
    return RequestResult(False, prompt, 0, ttft, itl, ttft + sum(itl), start, error="boom")


# A: 5 tokens, TPOT (0.2 - 0.1) / 4 = 25 ms. B: one token, no TPOT (0 for goodput).
# C: 3 tokens, TPOT (0.4 - 0.2) / 2 = 100 ms. D, E: failed, one slow and one fast,
# so including either would move every figure.
A = ok(10, 5, 0.1, [0.02, 0.02, 0.03, 0.03], start=0.0)
B = ok(20, 1, 0.3, [], start=0.5)
C = ok(30, 3, 0.2, [0.1, 0.1], start=1.0)
D = failed(40, 9.0, [5.0, 5.0], start=0.0)
E = failed(50, 0.001, [0.001], start=0.0)
RUN = [A, B, C, D, E]


def test_counts_and_throughput_exclude_failed_requests() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["request_goodput"] is None and "good_requests" not in m


def test_latency_statistics_by_hand() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    # TTFT over A, B, C: 100, 300, 200 ms.
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std
    assert m["p90_ttft_ms"] == pytest.approx(280)  # rank 0.9 * 2 = 1.8: 200 + 0.8 * 100
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # E2EL: 200, 300, 400 ms.
    assert m["mean_e2el_ms"] == pytest.approx(300)
    assert m["p50_e2el_ms"] == pytest.approx(300)


def test_tpot_skips_one_token_outputs() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    # Only A (25 ms) and C (100 ms); B's single token has no decode phase.
    assert m["mean_tpot_ms"] == pytest.approx(62.5)
    assert m["median_tpot_ms"] == pytest.approx(62.5)
    assert m["p99_tpot_ms"] == pytest.approx(25 + 0.99 * 75)
    assert B.tpot == 0.0 and A.tpot == pytest.approx(0.025) and C.tpot == pytest.approx(0.1)
    only_one_token = compute_metrics([B], duration_s=1.0)
    assert only_one_token["mean_tpot_ms"] == 0.0  # an empty sample reports 0, as vLLM


def test_itl_pooled_over_requests() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    # 20, 20, 30, 30 (A) and 100, 100 (C); D's 5 s gaps are not included.
    assert m["mean_itl_ms"] == pytest.approx(50)
    assert m["median_itl_ms"] == pytest.approx(30)
    assert m["p90_itl_ms"] == pytest.approx(100)


def test_percentile_method_is_linear_interpolation() -> None:
    s = summarize([0.001, 0.002, 0.003, 0.004], [50, 90, 99, 99.9])
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)
    assert s["p99.9"] == pytest.approx(3.997)
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # ddof 0, not the sample's 1.29
    values = np.random.default_rng(0).exponential(size=101)
    assert summarize(values, [95])["p95"] == pytest.approx(1000 * np.percentile(values, 95))
    assert summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250}, 2),  # A, C
        ({"tpot": 50}, 2),  # A, B (one token: TPOT 0)
        ({"e2el": 350}, 2),  # A, B
        ({"ttft": 250, "tpot": 50}, 1),  # A
        ({"ttft": 250, "e2el": 350}, 1),  # A
        ({"tpot": 50, "e2el": 350}, 2),  # A, B
        ({"ttft": 250, "tpot": 50, "e2el": 350}, 1),  # A
        ({"ttft": 200}, 2),  # on the boundary counts as met: A, C (exactly 200 ms)
        ({"tpot": 0}, 1),  # only the one-token output B
        ({"e2el": 5}, 0),  # the failed E (2 ms) would pass; it is not counted
    ],
)
def test_goodput_for_each_slo_combination(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(RUN, duration_s=2.0, goodput=slos)
    assert m["good_requests"] == good
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_is_good_without_slos() -> None:
    assert is_good(C, {}) and is_good(C, None)


def test_peak_concurrency_over_half_open_intervals() -> None:
    assert peak_concurrency([A, B, C]) == 1
    touching = [ok(1, 2, 0.5, [0.5], 0.0), ok(1, 2, 0.5, [0.5], 1.0)]
    assert peak_concurrency(touching) == 1  # one ends exactly when the next starts
    overlapping = [ok(1, 2, 0.5, [0.5], s) for s in (0.0, 0.5, 0.9)]
    assert peak_concurrency(overlapping) == 3
    assert compute_metrics(overlapping, 2.0)["max_concurrent_requests"] == 3


def test_peak_output_rate_by_second_bucket() -> None:
    # Events: A at 0.1, 0.12, 0.14, 0.17, 0.2 and B at 0.8 (second 0); C at 1.2, 1.3, 1.4.
    assert peak_output_rate([A, B, C]) == 6
    assert compute_metrics(RUN, 2.0)["max_output_tokens_per_s"] == 6


def test_selected_metrics_and_percentiles_name_keys_like_vllm() -> None:
    m = compute_metrics(RUN, 2.0, percentiles=[99, 99.9], metrics=["ttft"])
    assert {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms"} <= set(
        m
    )
    assert not any(k.endswith("_tpot_ms") for k in m)
    with pytest.raises(ValueError, match="unknown metric"):
        compute_metrics(RUN, 2.0, metrics=["ttfb"])
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(RUN, 0.0)


def test_queue_metrics() -> None:
    a = ok(1, 2, 0.1, [0.1], 0.0)
    a.queue_time = 0.3
    q = queue_metrics([a, D], [50], include_e2el=True)
    assert q["mean_client_queue_time_ms"] == pytest.approx(300)
    assert q["mean_e2el_including_client_queue_ms"] == pytest.approx(500)
    assert "mean_e2el_including_client_queue_ms" not in queue_metrics([a], [50], False)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500 e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    assert parse_goodput(None) == {}
    for bad, msg in [
        ("itl:5", "must be one of"),
        ("ttft=5", "KEY:MILLISECONDS"),
        ("ttft:-1", ">= 0"),
        ("ttft:fast", "not a number"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_goodput([bad])


def test_cached_tokens_are_summed_where_the_server_reported_them() -> None:
    from bench.metrics import RequestResult, compute_metrics

    def done(prompt: int, cached: int | None) -> RequestResult:
        return RequestResult(success=True, prompt_len=prompt, output_tokens=2, ttft=0.1,
                             latency=0.2, cached_tokens=cached)  # fmt: skip

    rs = [done(100, 64), done(50, 0), done(80, None)]
    m = compute_metrics(rs, 1.0)
    assert (m["total_cached_tokens"], m["total_prefilled_tokens"]) == (64, 86)
    assert "total_cached_tokens" not in compute_metrics(rs[2:], 1.0)


def test_a_reasoning_models_thinking_rate_and_time_to_answer() -> None:
    """The client reads thinking deltas and the usage's count; the run reports the
    thinking rate and TTFA, and leaves both out where no model thought."""
    import asyncio

    import httpx

    from bench.client import Endpoint, OpenAIClient
    from bench.request import Request as BenchRequest

    def chunk(**delta: str) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}) + "\n\n"

    usage = {"prompt_tokens": 5, "completion_tokens": 6,
             "completion_tokens_details": {"reasoning_tokens": 4}}  # fmt: skip
    end = "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"
    body = (chunk(role="assistant", content="") + chunk(reasoning_content="Hmm")
            + chunk(reasoning_content=" so") + chunk(content="4") + chunk(content=".") + end)
    transport = httpx.MockTransport(lambda _: httpx.Response(200, text=body))
    client = OpenAIClient(Endpoint("http://x/v1/chat/completions", "m", chat=True),
                          transport=transport)  # fmt: skip

    async def send() -> RequestResult:
        try:
            return await client.send(BenchRequest("p", 5, 6))
        finally:
            await client.aclose()

    r = asyncio.run(send())
    assert r.success and r.reasoning_tokens == 4 and r.output_tokens == 6
    assert r.ttfa is not None and r.ttfa >= r.ttft
    out = compute_metrics([r], 2.0)
    assert out["total_reasoning_tokens"] == 4 and out["reasoning_throughput"] == 2.0
    assert "median_ttfa_ms" in out
    plain = compute_metrics([RequestResult(success=True, output_tokens=3, latency=1.0)], 1.0)
    assert "total_reasoning_tokens" not in plain and "median_ttfa_ms" not in plain

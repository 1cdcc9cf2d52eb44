"""PROPOSE: the SLA policy sizes each pool from capacity; the load policy steps by one
with hysteresis."""

from __future__ import annotations

import pytest

from planner.capacity import StepCapacity
from planner.observation import Forecast, Observation
from planner.policy import Band, LoadPolicy, SlaPolicy


def _sla() -> SlaPolicy:
    cap = StepCapacity(
        prefill_s=lambda n: 0.02 + 0.001 * n,
        decode_step_s=lambda b, ctx: 0.01 + 0.001 * b,
    )
    return SlaPolicy(cap, ttft_target_s=2.0, itl_target_s=0.05)


def _sizes(policy: SlaPolicy, rate: float, inp: float, out: float) -> dict[str, int]:
    props = policy.propose(Observation(0.0), Forecast(rate, inp, out))
    return {p.pool: p.replicas for p in props}


def test_prompt_heavy_load_grows_prefill_and_long_outputs_grow_decode() -> None:
    sla = _sla()
    base = _sizes(sla, 4.0, 500, 100)
    prompts = _sizes(sla, 4.0, 1500, 100)
    outputs = _sizes(sla, 4.0, 500, 2000)
    assert prompts["prefill"] > base["prefill"] and prompts["decode"] == base["decode"]
    assert outputs["decode"] > base["decode"] and outputs["prefill"] == base["prefill"]
    assert _sizes(sla, 0.0, 0, 0) == {"prefill": 0, "decode": 0}


def test_sla_replicas_cover_the_predicted_load() -> None:
    sla = _sla()
    props = sla.propose(Observation(0.0), Forecast(10.0, 1000, 200))
    prefill, decode = props
    per_worker = sla.capacity.prefill_tokens_per_s(2.0, 1000)
    assert (prefill.replicas - 1) * per_worker < 10 * 1000 <= prefill.replicas * per_worker
    # 40 streams per worker within 50 ms, each step 0.05 s: 800 output tok/s a worker
    assert sla.capacity.decode_tokens_per_s(0.05, 1100) == pytest.approx(800)
    assert decode.replicas == 3  # 2,000 output tok/s
    assert "prompt tok/s" in prefill.reason and "output tok/s" in decode.reason


def test_an_sla_no_replica_count_can_meet_holds_and_says_so() -> None:
    sla = _sla()
    props = sla.propose(Observation(0.0, ready={"prefill": 3}), Forecast(1.0, 5000, 10))
    assert props[0].replicas == 3 and "misses TTFT" in props[0].reason


def test_load_policy_steps_by_one_and_holds_inside_the_band() -> None:
    pol = LoadPolicy()
    ready = {"prefill": 2, "decode": 2}

    def step(**kw: object) -> dict[str, int]:
        obs = Observation(0.0, ready=ready, **kw)  # type: ignore[arg-type]
        return {p.pool: p.replicas for p in pol.propose(obs, Forecast(0, 0, 0))}

    assert step(prefill_queue_depth=20) == {"prefill": 3, "decode": 1}
    assert step(prefill_queue_age_s=3.0, kv_usage={"decode": 0.5}, running_requests=40) == {
        "prefill": 3, "decode": 2,
    }  # fmt: skip
    assert step(kv_usage={"decode": 0.9}, prefill_queue_depth=2)["decode"] == 3
    # between the thresholds: hold (no flapping around one line)
    assert step(prefill_queue_depth=4, prefill_queue_age_s=0.5, kv_usage={"decode": 0.5},
                running_requests=40) == ready  # fmt: skip


def test_a_band_needs_down_below_up() -> None:
    with pytest.raises(ValueError, match="down < up"):
        Band(up=0.3, down=0.8)


def test_a_demand_at_a_whole_number_of_workers_does_not_flap() -> None:
    sla = _sla()
    per_worker = sla.capacity.prefill_tokens_per_s(2.0, 1000)

    def prefill(tokens_s: float, ready: int) -> int:
        obs = Observation(0.0, ready={"prefill": ready, "decode": 1})
        return sla.propose(obs, Forecast(tokens_s / 1000, 1000, 10))[0].replicas

    assert prefill(2.05 * per_worker, ready=2) == 3  # growth needs no headroom
    assert prefill(1.95 * per_worker, ready=3) == 3  # 2 would leave under 10 % spare
    assert prefill(1.75 * per_worker, ready=3) == 2  # now 2 carry it with room
    assert prefill(0.5 * per_worker, ready=3) == 1


def test_streams_in_flight_grow_decode_before_any_long_reply_finishes() -> None:
    sla = _sla()
    streams = sla.capacity.decode_streams(0.05, 600)
    # nothing finished yet: the output length is a short one from before
    obs = Observation(0.0, running_requests=int(streams), waiting_requests=int(2.5 * streams),
                      ready={"prefill": 1, "decode": 1})  # fmt: skip
    decode = sla.propose(obs, Forecast(2.0, 500, 200))[1]
    assert decode.replicas == 4 and "streams decoding or queued" in decode.reason
    # requests waiting for their remote prefill are prefill's load, not decode's
    queued = Observation(0.0, in_flight=int(3.5 * streams), ready={"prefill": 1, "decode": 1})
    assert sla.propose(queued, Forecast(2.0, 500, 200))[1].replicas == 1


def test_the_ttft_observed_corrects_the_prefill_model() -> None:
    from planner.policy import Correction

    cap = _sla().capacity
    per_worker = cap.prefill_tokens_per_s(2.0, 1000)
    u = cap.prefill_utilisation(per_worker, 1000)
    predicted = cap.prefill_ttft_p99_s(u, 1000)
    assert predicted == pytest.approx(2.0, rel=0.05) or u == pytest.approx(0.9)

    def sized(observed_p99: float, ticks: int) -> tuple[int, float]:
        sla = SlaPolicy(cap, ttft_target_s=2.0, itl_target_s=0.05, correction=Correction())
        obs = Observation(0.0, request_rate=2 * 0.5 * per_worker / 1000, mean_input_tokens=1000,
                          ttft_p99_s=observed_p99, ready={"prefill": 2, "decode": 1})  # fmt: skip
        for _ in range(ticks):
            props = sla.propose(obs, Forecast(6 * per_worker / 1000, 1000, 10))
        return props[0].replicas, sla.correction.factor

    at_half = cap.prefill_ttft_p99_s(cap.prefill_utilisation(0.5 * per_worker, 1000), 1000)
    plain, factor = sized(at_half, 8)  # the model was right: no change
    assert factor == pytest.approx(1.0) and plain == 6
    fewer, factor = sized(at_half / 3, 8)  # the fleet does 3x better than modelled
    assert factor < 0.5 and fewer < plain
    more, factor = sized(at_half * 2, 8)
    assert factor > 1.5 and more > plain
    uncorrected = SlaPolicy(cap, 2.0, 0.05, correct=False)
    obs = Observation(0.0, request_rate=1.0, mean_input_tokens=1000, ttft_p99_s=30.0,
                      ready={"prefill": 2, "decode": 1})  # fmt: skip
    assert uncorrected.propose(obs, Forecast(6 * per_worker / 1000, 1000, 10))[0].replicas == 6


def test_the_live_thinking_rate_sizes_decode_before_long_thinking_ends() -> None:
    """Reasoning models: four thinking streams at full speed show in the decode workers'
    thinking rate while the finished requests' outputs are still short ones."""
    sla = _sla()
    per_worker = sla.capacity.decode_tokens_per_s(0.05, 250 + 100)
    obs = Observation(0.0, reasoning_tokens_per_s=3.5 * per_worker,
                      ready={"prefill": 1, "decode": 1})  # fmt: skip
    decode = sla.propose(obs, Forecast(1.0, 250, 200))[1]
    assert decode.replicas == 4 and "thinking tok/s" in decode.reason
    assert sla.propose(Observation(0.0, ready={"prefill": 1, "decode": 1}),
                       Forecast(1.0, 250, 200))[1].replicas == 1  # fmt: skip

"""The capacity of one worker within the SLA, from step times."""

from __future__ import annotations

import pytest

from planner.capacity import StepCapacity


def _cap() -> StepCapacity:
    # prefill 1 ms per token + 20 ms; decode step 10 ms + 1 ms per sequence (+ context)
    return StepCapacity(
        prefill_s=lambda n: 0.02 + 0.001 * n,
        decode_step_s=lambda b, ctx: 0.01 + 0.001 * b + 1e-6 * b * ctx,
    )


def test_prefill_capacity_leaves_queueing_room_under_the_ttft_target() -> None:
    cap = _cap()
    service = 0.02 + 0.001 * 500
    tight, loose = cap.prefill_tokens_per_s(0.6, 500), cap.prefill_tokens_per_s(5.0, 500)
    assert 0 < tight < loose <= 0.9 * 500 / service
    # the utilisation chosen keeps S + 4 x the M/D/1 mean wait at the target
    u = tight * service / 500
    assert service + 4 * u * service / (2 * (1 - u)) == pytest.approx(0.6)
    assert cap.prefill_tokens_per_s(0.5, 500) == 0.0  # one prompt alone takes 0.52 s


def test_decode_capacity_is_the_largest_batch_within_the_itl_target() -> None:
    cap = _cap()
    b = cap.decode_streams(0.05, 1000)  # 0.01 + 0.002 b <= 0.05
    assert b == 20
    assert cap.decode_streams(0.05, 1000) > cap.decode_streams(0.05, 8000)
    assert cap.decode_streams(0.005, 100) == 0.0


def test_a_spread_of_prompt_lengths_leaves_less_room_than_uniform_prompts() -> None:
    cap = _cap()
    uniform = cap.prefill_tokens_per_s(2.0, 1000)
    assert cap.prefill_tokens_per_s(2.0, 1000, 1000.0**2) == uniform  # no spread: M/D/1
    # one prompt in ten of 8,000 tokens, the rest ~220: the same mean, far more queueing
    mixed_sq = 0.1 * 8000**2 + 0.9 * 220**2
    assert cap.prefill_tokens_per_s(2.0, 1000, mixed_sq) < uniform / 2


def test_a_decode_batch_is_also_bounded_by_the_kv_it_holds() -> None:
    cap = StepCapacity(prefill_s=lambda n: 0.001 * n, decode_step_s=lambda b, ctx: 0.01,
                       kv_tokens=10_000)  # fmt: skip
    assert cap.decode_streams(0.05, 1000) == 10
    assert cap.decode_tokens_per_s(0.05, 1000) == pytest.approx(1000)

"""Conditional disaggregation: which prompts a decode worker sends to the prefill pool."""

from __future__ import annotations

from engine.request import RemoteRule


def test_a_worker_holding_most_of_the_prompt_prefills_the_rest_itself() -> None:
    rule = RemoteRule(min_uncached=128, min_share=0.5, max_local=4096)
    assert rule.remote(1000, 0)  # a fresh prompt
    assert not rule.remote(100, 0)  # too short to be worth the round trip
    assert rule.remote(1000, 400)  # 600 of 1000 uncached
    assert not rule.remote(1200, 1000)  # a conversation's next turn: its history held here
    assert rule.remote(20_000, 15_000)  # 5,000 uncached: too long to run beside decodes
    assert not rule.remote(20_000, 16_000)


def test_an_int_threshold_is_the_old_rule() -> None:
    rule = RemoteRule(32)
    assert rule.remote(1200, 1000) and not rule.remote(1200, 1170)

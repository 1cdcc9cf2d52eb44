"""Effort lanes in the scheduler (pure, a fake forward pass): short-lane prompts are
admitted before long thinking streams, start in a step without the long lane's
decodes, and keep a share of the sequence slots; nothing is starved or stalled."""

from __future__ import annotations

import random

from engine.kv_cache import KVCacheManager
from engine.reasoning import ReasoningState
from engine.request import Request
from engine.scheduler import LONG_LANE_SHARE, Scheduler
from protocol.sampling import SamplingParams
from tests.engine.test_scheduler import BS, EOS, VOCAB, FakeModel, assert_sound

END = 998  # the thinking end marker (the fake model never writes it)


def _sched(max_seqs: int = 8, lanes: int = 100, budget: int = 64) -> tuple[Scheduler, FakeModel]:
    kv = KVCacheManager(256, BS, True)
    sched = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                      max_model_len=4096, long_thinking_tokens=lanes)  # fmt: skip
    return sched, FakeModel(sched)


def _req(rid: str, thinking: int | None, max_tokens: int = 8, prompt: int = 8) -> Request:
    rng = random.Random(rid)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, max_reasoning_tokens=thinking,
        reasoning_end=(END,), reasoning_open=thinking is not None,
    )  # fmt: skip
    req = Request(rid, [rng.randrange(VOCAB - 2) for _ in range(prompt)], params,
                  eos_token_ids=(EOS,), max_model_len=4096)  # fmt: skip
    if thinking is not None:
        req.reasoning = ReasoningState(params)
    return req


def _step(sched: Scheduler, model: FakeModel) -> list[str]:
    out = sched.schedule()
    sampled = model.forward(out)
    sched.update(out, sampled)
    assert_sound(sched)
    return [s.request.request_id for s in out.scheduled]


def test_a_short_prompt_starts_without_the_long_lanes_decodes() -> None:
    sched, model = _sched()
    for i in range(4):
        sched.add_request(_req(f"long{i}", thinking=2000, max_tokens=2100))
    for _ in range(3):
        _step(sched, model)
    assert all(sched.long_lane(r) for r in sched.running)
    sched.add_request(_req("short", thinking=0, max_tokens=4))
    assert _step(sched, model) == ["short"]  # its first step is its own
    assert sched.lane_yields == 1
    assert set(_step(sched, model)) == {"short", "long0", "long1", "long2", "long3"}


def test_short_requests_overtake_queued_long_ones_and_keep_slots() -> None:
    sched, model = _sched(max_seqs=4)
    longs = [_req(f"long{i}", thinking=2000, max_tokens=3000) for i in range(6)]
    for r in longs:
        sched.add_request(r)
    _step(sched, model)
    assert len(sched.running) == int(4 * LONG_LANE_SHARE)  # a slot kept for the short lane
    sched.add_request(_req("late-short", thinking=None, max_tokens=4))
    ran = _step(sched, model)
    assert ran == ["late-short"]
    assert [r.request_id for r in sched.running][-1] == "late-short"


def test_one_lane_when_off_and_no_stall_when_the_short_prompt_cannot_start() -> None:
    sched, model = _sched(lanes=0)
    sched.add_request(_req("long", thinking=2000, max_tokens=3000))
    _step(sched, model)
    sched.add_request(_req("short", thinking=0))
    assert set(_step(sched, model)) == {"long", "short"}  # no lanes: one batch
    # a short prompt that cannot get its blocks: the long lane steps on
    kv = KVCacheManager(6, BS, True)
    tight = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=4096,
                      long_thinking_tokens=100)  # fmt: skip
    tmodel = FakeModel(tight)
    tight.add_request(_req("long", thinking=2000, max_tokens=3000, prompt=8))
    _step(tight, tmodel)
    tight.add_request(_req("big-short", thinking=0, prompt=40))
    assert _step(tight, tmodel) == ["long"]


def test_the_lane_follows_the_budget_left() -> None:
    sched, model = _sched(lanes=10)
    req = _req("r", thinking=16, max_tokens=40)
    sched.add_request(req)
    assert sched.long_lane(req)
    steps = 0
    while sched.long_lane(req):
        _step(sched, model)
        steps += 1
    assert req.thinking_left < 10 and steps < 10


def test_a_short_request_preempts_a_long_one_when_every_slot_is_taken() -> None:
    sched, model = _sched(max_seqs=4)
    for i in range(3):
        sched.add_request(_req(f"long{i}", thinking=2000, max_tokens=3000))
    sched.add_request(_req("short0", thinking=0, max_tokens=50))
    _step(sched, model)
    assert len(sched.running) == 4
    sched.add_request(_req("short1", thinking=0, max_tokens=4))
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["long0"]  # the most thinking left
    assert "short1" in [s.request.request_id for s in out.scheduled]
    sched.update(out, model.forward(out))
    assert_sound(sched)
    for _ in range(100):  # the preempted one comes back once the short ones are done
        if "long0" in [r.request_id for r in sched.running]:
            break
        _step(sched, model)
    assert "long0" in [r.request_id for r in sched.running]

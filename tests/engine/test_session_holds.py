"""Session holds (engine/kv_cache/sessions.py): a conversation's last finished turn keeps
its blocks on the device until the next turn, the TTL, or a request that needs them.

The scheduler and the fake forward pass of tests/engine/test_scheduler.py (every token's
KV read back and checked; output a pure function of the sequence), a settable clock."""

from __future__ import annotations

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import (
    BS,
    FakeModel,
    assert_idle,
    assert_sound,
    make_req,
    reference_output,
    run_to_completion,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 32, ttl: float = 10.0) -> tuple[Scheduler, FakeModel, Clock]:
    clock = Clock()
    kv = KVCacheManager(num_blocks, BS, True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                      session_ttl_s=ttl, clock=clock)  # fmt: skip
    return sched, FakeModel(sched), clock


def turn(rid: str, session: str | None, prompt: list[int] | int, max_tokens: int = 4) -> Request:
    r = make_req(rid, prompt, max_tokens=max_tokens)
    r.session_id = session
    return r


def serve(sched: Scheduler, model: FakeModel, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, model)
    for r in reqs:
        assert r.output_token_ids == reference_output(r), r.request_id


def next_turn(rid: str, prev: Request, new_tokens: int = 8) -> Request:
    """The session's next turn: the previous turn's prompt and output, then new tokens."""
    tail = make_req(rid + "-tail", new_tokens).prompt_token_ids
    return turn(rid, prev.session_id, prev.all_token_ids + tail)


def test_a_held_turn_survives_pressure_and_the_next_turn_hits_it() -> None:
    """Between turns other traffic fills the pool: without a hold the session's history
    is evicted and recomputed; with one it is found whole on the device."""
    for ttl, expect_hit in ((0.0, False), (10.0, True)):
        sched, model, clock = make(num_blocks=24, ttl=ttl)
        first = turn("s1-t1", "s1", 30)
        serve(sched, model, first)
        assert len(sched.sessions) == (1 if ttl else 0)
        clock.now = 1.0
        for i in range(6):  # others: 12 blocks each, sequentially, through the LRU
            serve(sched, model, turn(f"other{i}", None, 44))
        second = next_turn("s1-t2", first)
        serve(sched, model, second)
        history = len(first.all_token_ids) // BS * BS
        assert (second.num_cached_tokens >= history) is expect_hit, second.num_cached_tokens
        assert_sound(sched)


def test_the_next_turn_replaces_the_hold_and_the_ttl_lets_it_go() -> None:
    sched, model, clock = make(ttl=5.0)
    first = turn("a1", "a", 20)
    serve(sched, model, first)
    held = sched.sessions.num_blocks
    assert held == len(sched.kv.block_ids("a1")) > 0
    clock.now = 2.0
    second = next_turn("a2", first)
    serve(sched, model, second)
    assert len(sched.sessions) == 1 and "a" in sched.sessions
    assert sched.kv.block_ids("a1") == []  # the first turn let go, the second held
    clock.now = 6.9  # idle 4.9 s: still held
    sched.schedule()
    assert len(sched.sessions) == 1
    clock.now = 7.0  # idle 5 s: expired
    sched.schedule()
    assert len(sched.sessions) == 0 and sched.sessions.num_expired == 1
    assert_idle(sched)


def test_holds_yield_to_requests_before_anyone_is_preempted() -> None:
    """Sessions hold most of the pool; a long request still runs whole, unpreempted,
    because holds are let go (oldest first) when it needs blocks."""
    sched, model, clock = make(num_blocks=24, ttl=100.0)
    for i in range(4):  # 4 sessions of 5 blocks each: 20 of 23 usable blocks
        clock.now = float(i)
        serve(sched, model, turn(f"s{i}", f"s{i}", 17, max_tokens=3))
    assert len(sched.sessions) == 4
    big = turn("big", None, 60, max_tokens=8)  # 17 blocks
    serve(sched, model, big)
    assert sched.num_preemptions == 0
    assert sched.sessions.num_released_for_room >= 2
    assert "s3" in sched.sessions  # the newest kept
    assert "s0" not in sched.sessions  # the oldest went first
    sched.sessions.release_all()
    assert_idle(sched)


def test_aborted_or_sessionless_turns_are_not_held_and_a_reused_id_releases() -> None:
    sched, model, _ = make()
    r = turn("x", "sx", 12, max_tokens=50)
    sched.add_request(r)
    sched.schedule()
    sched.abort_request("x")
    assert len(sched.sessions) == 0
    serve(sched, model, turn("y", None, 12))
    assert len(sched.sessions) == 0
    serve(sched, model, turn("z", "sz", 12))
    assert sched.sessions.release_request("z") and len(sched.sessions) == 0
    assert_idle(sched)


def test_a_remote_prefill_takes_room_from_holds() -> None:
    sched, model, clock = make(num_blocks=16, ttl=100.0)
    for i in range(3):
        clock.now = float(i)
        serve(sched, model, turn(f"s{i}", f"s{i}", 17, max_tokens=3))
    remote = turn("remote", None, 40, max_tokens=2)  # 10 blocks: only with holds let go
    cached = sched.park_for_remote_kv(remote)
    assert cached == 0 and sched.sessions.num_released_for_room >= 1
    first = model.remote_prefill(remote)
    sched.remote_kv_ready("remote", first)
    run_to_completion(sched, model)
    assert remote.output_token_ids == reference_output(remote)
    sched.sessions.release_all()
    assert_idle(sched)

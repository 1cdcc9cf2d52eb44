"""Scheduler: token budget, chunked prefill, preemption, priorities, stops, remote-KV wait.

A real KVCacheManager under the scheduler, and a fake forward pass (`FakeModel`) that
writes each computed token into a simulated KV pool, checks that every earlier
position reads back the right token through the request's block table, and "samples"
a token that is a pure function of the sequence so far. Whatever the scheduling
(chunks, prefix hits, preemption, remote prefill), a request must therefore produce
exactly the tokens it produces alone.
"""

from __future__ import annotations

import itertools
import random

import pytest

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from protocol.sampling import SamplingParams

BS = 4
VOCAB = 1000
EOS = 999  # never produced by next_token: stops only happen when a test asks for them


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy choice: a deterministic function of the whole sequence."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 998_244_353
    return h % (VOCAB - 1)


class FakeModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = sched.kv
        self.slots: dict[tuple[int, int], int] = {}
        self.steps = 0

    def write(self, req: Request, start: int, end: int) -> None:
        blocks = self.kv.req_blocks[req.request_id]
        assert len(blocks) * BS >= end, f"{req.request_id}: no slot for position {end - 1}"
        for p in range(start, end):
            blk = blocks[p // BS]
            assert blk.ref_cnt == 1, f"{req.request_id} writes into shared block {blk.block_id}"
            assert blk.block_hash is None, f"{req.request_id} writes into cached block"
            self.slots[(blk.block_id, p % BS)] = req.all_token_ids[p]

    def check_reads(self, req: Request, end: int) -> None:
        blocks = self.kv.req_blocks[req.request_id]
        for p in range(end):
            got = self.slots.get((blocks[p // BS].block_id, p % BS))
            assert got == req.all_token_ids[p], (
                f"{req.request_id}: KV at position {p} holds {got}, expected {req.all_token_ids[p]}"
            )

    def forward(self, out: SchedulerOutput) -> dict[str, int]:
        self.steps += 1
        sampled = {}
        seen = set()
        for s in out.scheduled:
            req = s.request
            assert req.request_id not in seen, "a request scheduled twice in one step"
            seen.add(req.request_id)
            assert s.num_new_tokens >= 1
            assert s.start == req.num_computed_tokens
            assert s.start + s.num_new_tokens <= req.num_tokens
            assert s.samples == (s.start + s.num_new_tokens == req.num_tokens)
            assert req.status == RequestStatus.RUNNING
            self.check_reads(req, s.start)
            self.write(req, s.start, s.start + s.num_new_tokens)
            if s.samples:
                sampled[req.request_id] = next_token(req.all_token_ids)
        return sampled

    def remote_prefill(self, req: Request) -> int:
        """What a prefill worker does: write the prompt's KV into the pinned blocks."""
        self.write(req, req.num_computed_tokens, req.num_tokens)
        return next_token(req.all_token_ids)


def make_sched(
    num_blocks: int = 64,
    budget: int = 32,
    max_seqs: int = 8,
    max_model_len: int = 256,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = True,
) -> tuple[Scheduler, FakeModel]:
    kv = KVCacheManager(num_blocks, BS, caching)
    sched = Scheduler(
        kv,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    return sched, FakeModel(sched)


_clock = itertools.count(1)


def make_req(
    rid: str,
    prompt: list[int] | int,
    *,
    max_tokens: int | None = 4,
    max_model_len: int = 256,
    priority: int = 0,
    min_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    if isinstance(prompt, int):
        rng = random.Random(rid)
        prompt = [rng.randrange(VOCAB - 1) for _ in range(prompt)]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
    )
    return Request(
        rid,
        prompt,
        params,
        eos_token_ids=(EOS,),
        max_model_len=max_model_len,
        priority=priority,
        arrival_time=float(next(_clock)),
    )


def reference_output(req: Request, max_model_len: int = 256) -> list[int]:
    """The tokens the request produces when served alone, in one piece."""
    toks = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= req.sampling_params.min_tokens and t in req.stop_ids:
            return out
        if len(out) >= req.max_tokens or len(toks) >= max_model_len:
            return out


def assert_sound(sched: Scheduler) -> None:
    problems = sched.kv.check_invariants()
    assert problems == [], problems


def assert_idle(sched: Scheduler) -> None:
    assert_sound(sched)
    assert not sched.requests and not sched.running and not sched.waiting
    assert not sched.remote_waiting
    assert sched.kv.is_idle(), (sched.kv.num_free_blocks, sched.kv.pool.num_usable_blocks)


def step(sched: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    sampled = model.forward(out)
    finished = sched.update(out, sampled)
    assert_sound(sched)
    return out, finished


def run_to_completion(sched: Scheduler, model: FakeModel, max_steps: int = 2000) -> list[Request]:
    done: list[Request] = []
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        _, finished = step(sched, model)
        done.extend(finished)
    raise AssertionError(f"not done after {max_steps} steps: {sched.requests}")


# -- basics ------------------------------------------------------------------------------------


def test_bad_policy_is_rejected() -> None:
    # duplicate ids are EngineCore.submit's to refuse (tests/engine/test_bad_input.py)
    with pytest.raises(ValueError, match="scheduling policy"):
        make_sched(policy="lifo")


def test_scheduled_request_of() -> None:
    r = make_req("r", 10)
    r.num_computed_tokens = 4
    s = ScheduledRequest.of(r, 3)
    assert (s.start, s.num_new_tokens, s.samples) == (4, 3, False)
    assert ScheduledRequest.of(r, 6).samples


def test_single_request_runs_to_its_reference_output() -> None:
    sched, model = make_sched()
    r = make_req("r", 10, max_tokens=6)
    sched.add_request(r)
    out, _ = step(sched, model)
    assert [(s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [(0, 10, True)]
    assert r.num_cached_tokens == 0
    done = run_to_completion(sched, model)
    assert done == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == reference_output(r)
    assert model.steps == 6
    assert_idle(sched)


def test_token_budget_respected_every_step() -> None:
    sched, model = make_sched(num_blocks=200, budget=24, max_seqs=16)
    reqs = [make_req(f"r{i}", 3 + 7 * i % 40, max_tokens=1 + i % 5) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    budgets = []
    for _ in range(200):
        if not sched.has_work():
            break
        out, _ = step(sched, model)  # step() asserts the budget
        budgets.append(out.num_tokens)
    assert max(budgets) == 24  # the budget was actually the binding limit
    for r in reqs:
        assert r.output_token_ids == reference_output(r)
    assert_idle(sched)


# -- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_splits_to_the_budget_and_samples_once() -> None:
    sched, model = make_sched(budget=16)
    r = make_req("r", 50, max_tokens=2)
    sched.add_request(r)
    chunks = []
    for _ in range(4):
        out, _ = step(sched, model)
        (s,) = out.scheduled
        chunks.append((s.start, s.num_new_tokens, s.samples))
        assert r.num_output_tokens == (1 if s.samples else 0)
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    # blocks are cached only as their tokens are computed
    assert len(sched.kv.pool.cached) == 50 // BS
    out, finished = step(sched, model)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(50, 1)]
    assert finished == [r] and r.output_token_ids == reference_output(r)
    assert_idle(sched)


def test_chunked_prefill_does_not_cache_blocks_before_they_are_computed() -> None:
    sched, model = make_sched(budget=8)
    r = make_req("r", 20, max_tokens=1)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.kv.pool.cached == {}
    sched.update(out, model.forward(out))
    assert len(sched.kv.pool.cached) == 2
    run_to_completion(sched, model)
    assert_idle(sched)


def test_decodes_go_before_new_prefills_and_share_the_step() -> None:
    sched, model = make_sched(budget=16)
    a = make_req("a", 6, max_tokens=8)
    sched.add_request(a)
    step(sched, model)  # a: prefill done, one token out
    b = make_req("b", 40, max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, model)
    got = [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled]
    assert got == [("a", 6, 1, True), ("b", 0, 15, False)]  # mixed prefill + decode
    out, _ = step(sched, model)
    got = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    assert got == [("a", 1), ("b", 15)]
    run_to_completion(sched, model)
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b)
    assert_idle(sched)


def test_without_chunking_a_prompt_over_the_budget_waits() -> None:
    sched, model = make_sched(budget=16, chunked=False)
    big = make_req("big", 17)
    sched.add_request(big)
    for _ in range(5):
        out, _ = step(sched, model)
        assert out.scheduled == []
    assert big.status == RequestStatus.WAITING and big.num_computed_tokens == 0
    assert sched.kv.is_idle()
    sched.abort_request("big")
    assert big.status == RequestStatus.FINISHED_ABORTED
    assert_idle(sched)


def test_without_chunking_prompts_go_whole_and_wait_for_room() -> None:
    sched, model = make_sched(budget=16, chunked=False)
    a, b = make_req("a", 16, max_tokens=3), make_req("b", 10, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 16)]
    out, _ = step(sched, model)
    # a's decode takes 1 token; b's 10 fit in the 15 left, whole
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1),
        ("b", 10),
    ]
    run_to_completion(sched, model)
    assert_idle(sched)


def test_max_num_seqs_is_respected() -> None:
    sched, model = make_sched(num_blocks=100, budget=100, max_seqs=3)
    reqs = [make_req(f"r{i}", 5, max_tokens=3) for i in range(7)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, model)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    while sched.has_work():
        out, _ = step(sched, model)
        assert len(sched.running) <= 3 and len(out.scheduled) <= 3
    assert all(r.output_token_ids == reference_output(r) for r in reqs)
    assert_idle(sched)


# -- prefix cache through the scheduler --------------------------------------------------------


def test_prefix_hit_skips_cached_tokens() -> None:
    sched, model = make_sched()
    shared = make_req("a", 13, max_tokens=1).prompt_token_ids
    a = make_req("a", shared, max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched, model)
    b = make_req("b", [*shared[:12], 5, 6], max_tokens=3)
    sched.add_request(b)
    out, _ = step(sched, model)
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens) == (12, 2)
    assert b.num_cached_tokens == 12
    assert sched.prefix_hit_tokens == 12 and sched.prefix_queried_tokens == 13 + 14
    run_to_completion(sched, model)
    assert b.output_token_ids == reference_output(b)
    # an identical prompt still computes its last token
    c = make_req("c", shared, max_tokens=1)
    sched.add_request(c)
    out, _ = step(sched, model)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(12, 1)]
    assert c.output_token_ids == a.output_token_ids
    assert_idle(sched)


# -- preemption --------------------------------------------------------------------------------


def test_preemption_fcfs_evicts_the_newest_and_it_recomputes() -> None:
    # 6 usable blocks; two prompts of 8 tokens (2 blocks each) grow by 8 tokens each.
    sched, model = make_sched(num_blocks=7, budget=64, caching=False)
    a = make_req("a", 8, max_tokens=9)
    b = make_req("b", 8, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    preempted: list[str] = []
    victim_outputs = None
    for _ in range(100):
        if not sched.has_work():
            break
        out, _ = step(sched, model)
        for r in out.preempted:
            preempted.append(r.request_id)
            assert r.status == RequestStatus.PREEMPTED
            assert r.num_computed_tokens == 0
            assert sched.kv.block_ids(r.request_id) == []
            assert r not in [s.request for s in out.scheduled]
            victim_outputs = list(r.output_token_ids)
        if out.preempted:
            assert out.scheduled and all(s.request is a for s in out.scheduled)
    assert preempted and set(preempted) == {"b"}
    assert b.num_preemptions >= 1 and sched.num_preemptions == len(preempted)
    assert victim_outputs  # b had produced tokens: recompute covers prompt + outputs
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert_idle(sched)


def test_preempted_request_is_recomputed_from_scratch_then_decodes() -> None:
    sched, model = make_sched(num_blocks=7, budget=64, caching=False)
    a = make_req("a", 8, max_tokens=9)
    b = make_req("b", 8, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(50):
        out, _ = step(sched, model)
        if out.preempted:
            break
    assert out.preempted == [b]
    n_known = b.num_tokens
    # b comes back as a prefill of everything it knows, once there is room
    for _ in range(50):
        out, _ = step(sched, model)
        mine = [s for s in out.scheduled if s.request is b]
        if mine:
            assert (mine[0].start, mine[0].num_new_tokens, mine[0].samples) == (0, n_known, True)
            break
    run_to_completion(sched, model)
    assert b.output_token_ids == reference_output(b)
    assert_idle(sched)


def test_preemption_with_prefix_caching_still_gives_the_same_tokens() -> None:
    sched, model = make_sched(num_blocks=9, budget=12)
    reqs = [make_req(f"r{i}", 6 + i, max_tokens=10) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, model)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r), r.request_id
    assert_idle(sched)


def test_preemption_priority_evicts_the_lowest_priority() -> None:
    sched, model = make_sched(num_blocks=7, budget=64, caching=False, policy="priority")
    low = make_req("low", 8, max_tokens=9, priority=5)  # older but less important
    high = make_req("high", 8, max_tokens=9, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    out, _ = step(sched, model)
    assert [s.request.request_id for s in out.scheduled] == ["high", "low"]
    victims = []
    while sched.has_work():
        out, _ = step(sched, model)
        victims += [r.request_id for r in out.preempted]
    assert victims and set(victims) == {"low"}
    assert high.num_preemptions == 0
    assert low.output_token_ids == reference_output(low)
    assert high.output_token_ids == reference_output(high)
    assert_idle(sched)


def test_preempting_a_request_already_scheduled_this_step_gives_its_budget_back() -> None:
    # priority: `high`, behind `low` in the running list, needs a block; `low`, scheduled
    # earlier in the same step, is the victim and leaves the step's batch.
    # 4 usable blocks = 16 tokens: the context window is capped to the pool, as EngineCore does
    sched, model = make_sched(
        num_blocks=5, budget=64, caching=False, policy="priority", max_model_len=16
    )
    low = make_req("low", 2, max_tokens=20, priority=9)
    sched.add_request(low)
    step(sched, model)  # low: 3 tokens in 1 block
    high = make_req("high", 12, max_tokens=20, priority=0)
    sched.add_request(high)
    step(sched, model)  # low decodes in its block; high takes the other 3 blocks
    assert sched.kv.num_free_blocks == 0
    assert [r.request_id for r in sched.running] == ["low", "high"]
    out, _ = step(sched, model)  # low fits in its block, high needs a 4th block
    assert out.preempted == [low]
    assert [(s.request.request_id, s.start) for s in out.scheduled] == [("high", 12)]
    assert out.num_tokens == 1
    run_to_completion(sched, model)
    assert low.output_token_ids == reference_output(low, max_model_len=16)
    assert high.output_token_ids == reference_output(high, max_model_len=16)
    assert_idle(sched)


def test_budget_given_back_by_a_preempted_request_is_reused() -> None:
    # running: low (decode), high (decode, needs a block), mid (chunked prefill). low was
    # scheduled first, is preempted for high, and its token goes to mid's chunk.
    sched, model = make_sched(
        num_blocks=5, budget=3, caching=False, policy="priority", max_model_len=16
    )
    low = make_req("low", 1, max_tokens=None, priority=9, max_model_len=16)
    sched.add_request(low)
    step(sched, model)
    high = make_req("high", 1, max_tokens=None, priority=0, max_model_len=16)
    sched.add_request(high)
    step(sched, model)
    mid = make_req("mid", 10, max_tokens=None, priority=5, max_model_len=16)
    sched.add_request(mid)
    for _ in range(10):
        out, _ = step(sched, model)
        if out.preempted:
            break
    assert out.preempted == [low]
    got = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    assert got == [("high", 1), ("mid", 2)]
    assert out.num_tokens == 3
    run_to_completion(sched, model)
    for r in (low, high, mid):
        assert r.output_token_ids == reference_output(r, max_model_len=16)
    assert_idle(sched)


def test_priority_policy_orders_admission() -> None:
    sched, model = make_sched(max_seqs=1, policy="priority")
    reqs = {
        "p2": make_req("p2", 4, max_tokens=1, priority=2),
        "p0-late": make_req("p0-late", 4, max_tokens=1, priority=0),
        "p1": make_req("p1", 4, max_tokens=1, priority=1),
        "p0-later": make_req("p0-later", 4, max_tokens=1, priority=0),
    }
    for r in reqs.values():
        sched.add_request(r)
    order = []
    while sched.has_work():
        out, _ = step(sched, model)
        order += [s.request.request_id for s in out.scheduled]
    assert order == ["p0-late", "p0-later", "p1", "p2"]
    assert_idle(sched)


def test_fcfs_policy_ignores_priority() -> None:
    sched, model = make_sched(max_seqs=1, policy="fcfs")
    for rid, prio in [("a", 5), ("b", 0), ("c", 1)]:
        sched.add_request(make_req(rid, 4, max_tokens=1, priority=prio))
    order = []
    while sched.has_work():
        out, _ = step(sched, model)
        order += [s.request.request_id for s in out.scheduled]
    assert order == ["a", "b", "c"]
    assert_idle(sched)


# -- abort -------------------------------------------------------------------------------------


def test_abort_waiting_running_and_unknown() -> None:
    sched, model = make_sched(budget=16, max_seqs=1)
    run = make_req("run", 6, max_tokens=10)
    wait = make_req("wait", 6, max_tokens=10)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched, model)
    assert run.status == RequestStatus.RUNNING and wait.status == RequestStatus.WAITING
    assert sched.abort_request("wait") is wait
    assert wait.status == RequestStatus.FINISHED_ABORTED and wait.finish_reason == "abort"
    assert sched.abort_request("run") is run
    assert run.finished and sched.kv.block_ids("run") == []
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        sched.abort_request("nope")
    with pytest.raises(KeyError, match="unknown request id 'run'"):
        sched.abort_request("run")  # already gone
    assert_idle(sched)


def test_abort_between_schedule_and_update() -> None:
    sched, model = make_sched()
    a, b = make_req("a", 6), make_req("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = model.forward(out)
    sched.abort_request("a")
    finished = sched.update(out, sampled)
    assert finished == [] and a.output_token_ids == [] and b.num_output_tokens == 1
    run_to_completion(sched, model)
    assert_idle(sched)


def test_abort_a_preempted_request() -> None:
    sched, model = make_sched(num_blocks=7, budget=64, caching=False)
    a, b = make_req("a", 8, max_tokens=9), make_req("b", 8, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(50):
        out, _ = step(sched, model)
        if out.preempted:
            break
    assert b.status == RequestStatus.PREEMPTED
    sched.abort_request("b")
    run_to_completion(sched, model)
    assert a.output_token_ids == reference_output(a)
    assert_idle(sched)


# -- stop conditions ---------------------------------------------------------------------------


def test_stop_token_finishes_with_stop_reason() -> None:
    sched, model = make_sched()
    probe = make_req("probe", 7, max_tokens=10)
    ref = reference_output(probe)
    stop_tok = ref[2]
    assert stop_tok not in ref[:2]
    r = make_req("r", probe.prompt_token_ids, max_tokens=10, stop_token_ids=(stop_tok,))
    sched.add_request(r)
    done = run_to_completion(sched, model)
    assert done == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.stop_reason == stop_tok and r.output_token_ids == ref[:3]
    assert_idle(sched)


def test_min_tokens_defers_the_stop() -> None:
    probe = make_req("probe", 7, max_tokens=10)
    stop_tok = reference_output(probe)[0]  # the very first output: only min_tokens delays it
    for min_tokens in (0, 1, 3):
        sched, model = make_sched()
        r = make_req(
            "r",
            probe.prompt_token_ids,
            max_tokens=10,
            min_tokens=min_tokens,
            stop_token_ids=(stop_tok,),
        )
        sched.add_request(r)
        run_to_completion(sched, model)
        assert r.output_token_ids == reference_output(r)
        assert r.num_output_tokens >= max(min_tokens, 1)
        if min_tokens <= 1:
            assert r.output_token_ids == [stop_tok] and r.finish_reason == "stop"
        else:
            assert r.output_token_ids[0] == stop_tok and r.num_output_tokens > 1
        assert_idle(sched)


def test_min_tokens_ignores_early_stop_tokens_in_update() -> None:
    sched, model = make_sched()
    r = make_req("r", 5, max_tokens=10, min_tokens=3, stop_token_ids=(7,))
    sched.add_request(r)
    for i, tok in enumerate([7, 7, 7]):
        out = sched.schedule()
        model.forward(out)
        finished = sched.update(out, {"r": tok})
        assert finished == ([r] if i == 2 else [])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7, 7, 7]
    assert_idle(sched)


def test_eos_stops_unless_ignored() -> None:
    for ignore_eos, expect in [(False, RequestStatus.FINISHED_STOPPED), (True, None)]:
        sched, model = make_sched()
        r = make_req("r", 5, max_tokens=3, ignore_eos=ignore_eos)
        sched.add_request(r)
        out = sched.schedule()
        model.forward(out)
        finished = sched.update(out, {"r": EOS})
        if expect is None:
            assert finished == [] and r.status == RequestStatus.RUNNING
            sched.abort_request("r")
        else:
            assert finished == [r] and r.status == expect and r.stop_reason == EOS
        assert_idle(sched)


def test_max_tokens_finishes_with_length() -> None:
    sched, model = make_sched()
    r = make_req("r", 5, max_tokens=1)
    sched.add_request(r)
    _, finished = step(sched, model)
    assert finished == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.finish_reason == "length" and r.num_output_tokens == 1
    assert_idle(sched)


def test_max_model_len_finishes_with_length() -> None:
    # the scheduler's context window binds before max_tokens
    sched, model = make_sched(max_model_len=12)
    r = make_req("r", 9, max_tokens=None, max_model_len=10_000)
    sched.add_request(r)
    run_to_completion(sched, model)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 12 and r.num_output_tokens == 3
    assert_idle(sched)
    # the request's own window (max_tokens None -> room left) binds the same way
    sched, model = make_sched(max_model_len=10_000)
    r = make_req("r2", 9, max_tokens=None, max_model_len=14)
    sched.add_request(r)
    run_to_completion(sched, model)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 14
    assert_idle(sched)


# -- remote KV ---------------------------------------------------------------------------------


def test_parked_request_pins_blocks_and_is_never_scheduled() -> None:
    sched, model = make_sched(budget=16)
    parked = make_req("parked", 10, max_tokens=3)
    assert sched.park_for_remote_kv(parked) == 0
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KV
    pinned = sched.kv.block_ids("parked")
    assert len(pinned) == 3 and sched.kv.num_free_blocks == 63 - 3
    assert not sched.has_work() and "parked" in sched.requests
    for _ in range(3):
        out, _ = step(sched, model)
        assert out.scheduled == [] and out.preempted == []
    # a local request gets the whole budget while the other one waits for its KV
    other = make_req("other", 16, max_tokens=2)
    sched.add_request(other)
    out, _ = step(sched, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("other", 16)]
    run_to_completion(sched, model)
    assert sched.kv.block_ids("parked") == pinned and parked.num_output_tokens == 0
    assert sched.kv.pool.lookup(sched.kv.block_hashes(parked)[0]) is None  # not yet computed
    first = model.remote_prefill(parked)
    got = sched.remote_kv_ready("parked", first)
    assert got is parked and parked.status == RequestStatus.WAITING  # rejoins via admission
    assert parked.output_token_ids == [first] and parked.num_computed_tokens == 10
    # the prompt's full blocks are now findable, in the blocks the remote side wrote
    hashes = sched.kv.block_hashes(parked)[:2]
    assert [sched.kv.pool.lookup(h) for h in hashes] == sched.kv.req_blocks["parked"][:2]
    out, _ = step(sched, model)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(10, 1)]
    run_to_completion(sched, model)
    assert parked.output_token_ids == reference_output(parked)
    assert_idle(sched)


def test_park_with_prefix_hit_returns_the_cached_length() -> None:
    sched, model = make_sched()
    a = make_req("a", 13, max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched, model)
    b = make_req("b", [*a.prompt_token_ids[:12], 1, 2, 3], max_tokens=2)
    assert sched.park_for_remote_kv(b) == 12
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    first = model.remote_prefill(b)  # writes positions 12.. only
    sched.remote_kv_ready("b", first)
    run_to_completion(sched, model)
    assert b.output_token_ids == reference_output(b)
    assert_idle(sched)


def test_park_without_room_raises_and_changes_nothing() -> None:
    sched, model = make_sched(num_blocks=4)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        sched.park_for_remote_kv(make_req("big", 13))
    assert_idle(sched)
    r = make_req("r", 5)
    sched.add_request(r)
    run_to_completion(sched, model)
    assert_idle(sched)


def test_failed_park_leaves_no_stale_hashes_for_a_reused_id() -> None:
    """After a refused park, a different prompt under the same id must not inherit the
    refused prompt's block hashes (it would be served another prompt's KV)."""
    sched, model = make_sched(num_blocks=4)  # 3 usable blocks
    first = make_req("x", 13)  # needs 4 blocks: refused
    with pytest.raises(RuntimeError):
        sched.park_for_remote_kv(first)
    # the refused prompt's first 8 tokens get cached by another request
    donor = make_req("donor", [*first.prompt_token_ids[:8], 1], max_tokens=1)
    sched.add_request(donor)
    run_to_completion(sched, model)
    other = make_req("x", [5] * 9, max_tokens=1)  # a different prompt, same id
    assert sched.kv.find_prefix(other).num_tokens == 0
    sched.add_request(other)
    run_to_completion(sched, model)  # FakeModel checks every KV read
    assert other.output_token_ids == reference_output(other)
    assert_idle(sched)


def test_remote_kv_ready_with_a_stopping_first_token() -> None:
    sched, model = make_sched()
    r = make_req("r", 6, max_tokens=1)
    sched.park_for_remote_kv(r)
    sched.remote_kv_ready("r", model.remote_prefill(r))
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 1
    assert_idle(sched)
    r = make_req("s", 6, max_tokens=5)
    sched.park_for_remote_kv(r)
    model.remote_prefill(r)
    sched.remote_kv_ready("s", EOS)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == EOS
    assert_idle(sched)


def test_remote_kv_ready_respects_max_num_seqs() -> None:
    """KV landing from a prefill worker must not push the batch past max_num_seqs, the
    cap local admission honours; the request may wait for a slot instead."""
    sched, model = make_sched(max_seqs=1)
    local = make_req("local", 5, max_tokens=6)
    sched.add_request(local)
    step(sched, model)
    r = make_req("r", 9, max_tokens=3)
    sched.park_for_remote_kv(r)
    sched.remote_kv_ready("r", model.remote_prefill(r))
    assert len(sched.running) <= 1, [q.request_id for q in sched.running]
    run_to_completion(sched, model)  # step() checks the limit every step
    assert local.output_token_ids == reference_output(local)
    assert r.output_token_ids == reference_output(r)
    assert_idle(sched)


def test_remote_kv_failed_falls_back_to_local_prefill() -> None:
    sched, model = make_sched(max_seqs=2)
    early = make_req("early", 5, max_tokens=3)
    sched.add_request(early)
    r = make_req("r", 9, max_tokens=3)
    sched.park_for_remote_kv(r)
    got = sched.remote_kv_failed("r")
    assert got is r and r.status == RequestStatus.WAITING
    assert r.num_computed_tokens == 0 and sched.kv.block_ids("r") == []
    assert sched.waiting.peek() is r  # ahead of requests that arrived before it
    run_to_completion(sched, model)
    assert r.output_token_ids == reference_output(r)
    assert early.output_token_ids == reference_output(early)
    assert_idle(sched)


@pytest.mark.parametrize("ending", ["failed", "ready"])
def test_abort_while_parked_keeps_blocks_pinned_until_released(ending: str) -> None:
    sched, model = make_sched(num_blocks=8)
    r = make_req("r", 12)
    sched.park_for_remote_kv(r)
    pinned = sched.kv.block_ids("r")
    free_before = sched.kv.num_free_blocks
    assert sched.abort_request("r") is r and r.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.block_ids("r") == pinned and sched.kv.num_free_blocks == free_before
    # other traffic cannot take the pinned blocks while a write may still land
    hog = make_req("hog", 4 * sched.kv.num_free_blocks - 1, max_tokens=1)
    sched.add_request(hog)
    run_to_completion(sched, model)
    assert sched.kv.block_ids("r") == pinned
    model.remote_prefill(r)  # the late write lands in r's own blocks
    if ending == "failed":
        assert sched.remote_kv_failed("r") is r
    else:
        assert sched.remote_kv_ready("r", 1) is r
        assert r.output_token_ids == []
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert not sched.running and not sched.waiting
    assert_idle(sched)


def test_a_second_abort_while_parked_still_keeps_blocks_pinned() -> None:
    """Cancellation can arrive twice (client disconnect, then deadline); the blocks
    must stay pinned until the transfer side says no write can land."""
    sched, _ = make_sched(num_blocks=8)
    r = make_req("r", 12)
    sched.park_for_remote_kv(r)
    pinned = sched.kv.block_ids("r")
    sched.abort_request("r")
    sched.abort_request("r")
    assert sched.kv.block_ids("r") == pinned, "pinned blocks released by a second abort"
    sched.remote_kv_failed("r")
    assert_idle(sched)


def test_remote_kv_for_unknown_ids_raises() -> None:
    sched, _ = make_sched()
    with pytest.raises(KeyError):
        sched.remote_kv_ready("ghost", 1)
    with pytest.raises(KeyError):
        sched.remote_kv_failed("ghost")
    assert_idle(sched)


def test_a_queue_pinned_out_by_remote_kv_has_no_work_until_something_happens() -> None:
    """Nothing runs and the head of the queue cannot get its blocks while a parked request
    pins them: a step can do nothing until the KV lands (or a request comes or goes), so
    has_work is False and the engine's loop waits instead of stepping through empty steps
    (a simulated worker took each as a step of 0 s and never left the instant)."""
    sched, model = make_sched(num_blocks=9)  # 8 usable blocks of 4 tokens
    parked = make_req("parked", 20, max_tokens=2)  # pins 5 blocks
    sched.park_for_remote_kv(parked)
    local = make_req("local", 14, max_tokens=2)  # needs 4 blocks; 3 are free
    sched.add_request(local)
    out, _ = step(sched, model)
    assert out.scheduled == [] and out.preempted == []
    assert sched.stalled and not sched.has_work()
    later = make_req("later", 3, max_tokens=1)  # an arrival: look again (FCFS: it waits too)
    sched.add_request(later)
    assert sched.has_work()
    out, _ = step(sched, model)
    assert out.scheduled == [] and not sched.has_work()
    sched.remote_kv_ready("parked", model.remote_prefill(parked))
    assert sched.has_work()
    run_to_completion(sched, model)
    for r in (parked, local, later):
        assert r.output_token_ids == reference_output(r), r.request_id
    assert_idle(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_adopted_kv_behind_a_head_that_cannot_fit_is_taken_back_when_nothing_runs(
    policy: str,
) -> None:
    """A request whose remote KV landed waits for a batch slot holding its blocks. When
    the head of the queue cannot fit beside them and nothing runs, no step will ever
    free a block: the holder behind gives its blocks back and recomputes later, as a
    preempted request does (only running requests were preempted, and this stalled)."""
    sched, model = make_sched(num_blocks=9, policy=policy)  # 8 usable blocks of 4 tokens
    a = make_req("a", 12, max_tokens=10)  # grows to 22 tokens: 6 blocks
    sched.add_request(a)
    step(sched, model)  # a: 3 blocks
    b = make_req("b", 16, max_tokens=3)
    sched.park_for_remote_kv(b)  # 4 blocks pinned, 1 left
    sched.remote_kv_ready("b", model.remote_prefill(b))  # b needs a 5th block to decode
    while a.status == RequestStatus.RUNNING:  # a takes the last block, then preempts itself
        step(sched, model)
    assert [r.request_id for r in sched.waiting] == ["a", "b"] and not sched.running
    out, _ = step(sched, model)  # a cannot fit beside b's 4 blocks: b gives them back
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and sched.kv.block_ids("b") == []
    run_to_completion(sched, model)
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b) and b.num_preemptions == 1
    assert_idle(sched)


# -- randomized --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_randomized_traffic_keeps_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    policy = "priority" if seed % 2 else "fcfs"
    sched, model = make_sched(num_blocks=24, budget=20, max_seqs=6, policy=policy)
    bases = [[rng.randrange(VOCAB - 1) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    everyone: list[Request] = []
    parked: list[Request] = []
    for t in range(500):
        if t < 350 and rng.random() < 0.3:
            tail = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 14))]
            r = make_req(
                f"r{len(everyone)}",
                rng.choice(bases) + tail,
                max_tokens=rng.randint(1, 12),
                priority=rng.randrange(3),
            )
            everyone.append(r)
            if rng.random() < 0.25:
                try:
                    sched.park_for_remote_kv(r)
                    parked.append(r)
                except RuntimeError:
                    sched.add_request(r)
            else:
                sched.add_request(r)
        if parked and rng.random() < 0.2:
            r = parked.pop(rng.randrange(len(parked)))
            if rng.random() < 0.7:
                sched.remote_kv_ready(r.request_id, model.remote_prefill(r))
            else:
                sched.remote_kv_failed(r.request_id)
        live = sorted(rid for rid, r in sched.requests.items() if not r.finished)
        if live and rng.random() < 0.03:
            sched.abort_request(rng.choice(live))
        assert_sound(sched)
        step(sched, model)
    for r in parked:
        sched.remote_kv_failed(r.request_id)
    run_to_completion(sched, model)
    assert_idle(sched)
    assert sched.num_preemptions > 0  # the pool was small enough to matter
    assert sum(r.num_preemptions > 0 for r in everyone) > 1
    checked = 0
    for r in everyone:
        assert r.finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == reference_output(r), r.request_id
            checked += 1
    assert checked > 50


def test_at_most_max_loras_adapters_run_at_once_and_waits_are_counted() -> None:
    """A request for a third adapter waits while two others run (counted once), others
    overtake it, and it runs once a slot frees; every request ends with its own tokens."""
    from engine import scheduler as scheduler_module
    from protocol.lora import AdapterRef

    sched, model = make_sched(budget=64, max_seqs=8)
    sched.max_loras = 2
    waited: list[str] = []
    sched.on_lora_wait = lambda r: waited.append(r.request_id)
    a, b, c = (AdapterRef(n, f"/adapters/{n}") for n in "abc")
    reqs = []
    for i, lora in enumerate([a, b, c, a, None, b]):
        r = make_req(f"r{i}", 6, max_tokens=3 + i)
        r.lora = lora
        sched.add_request(r)
        reqs.append(r)
    alone = {r.request_id: list(r.all_token_ids) for r in reqs}
    while sched.has_work():
        out = sched.schedule()
        running = {r.lora for r in sched.running if r.lora is not None}
        assert len(running) <= 2, running
        assert len({s.request.lora for s in out.scheduled if s.request.lora}) <= 2
        sched.update(out, model.forward(out))
    assert all(r.finished for r in reqs)
    assert waited == ["r2"]  # c's request, once, though it waited several steps
    for r in reqs:  # the tokens each gets alone (the fake model's function of its sequence)
        seq = list(alone[r.request_id])
        for _ in range(r.num_output_tokens):
            seq.append(next_token(seq))
        assert r.all_token_ids == seq
    # a head that waited too long stops being overtaken: its adapter's turn comes
    sched, model = make_sched(budget=64, max_seqs=8)
    sched.max_loras = 1
    first, blocked = make_req("x", 6, max_tokens=30), make_req("y", 6, max_tokens=2)
    first.lora, blocked.lora = a, b
    sched.add_request(first)
    sched.add_request(blocked)
    blocked.lora_skips = scheduler_module.LORA_MAX_SKIPS
    late = make_req("z", 6, max_tokens=2)
    late.lora = a
    sched.add_request(late)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["x"]  # z does not overtake y

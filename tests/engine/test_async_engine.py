"""The asyncio interface the workers drive: concurrent streams, cancellation, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from engine import LLM, AsyncEngine, DuplicateRequestError, NewRequest, SamplingParams
from engine.async_engine import EngineDeadError
from engine.request import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=64)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    """Offline greedy tokens of each prompt, computed before any AsyncEngine drives the core."""
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture
def engine(llm: LLM, expected: list[list[int]]) -> Iterator[AsyncEngine]:
    """An AsyncEngine over the shared core (its thread then owns the core: nothing else may
    step it); the core must be idle and sound afterwards."""
    engine = AsyncEngine(llm.engine)
    try:
        yield engine
    finally:
        engine.close()
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    return [
        t
        async for out in engine.generate(NewRequest(rid, prompt, GREEDY))
        for t in out.new_token_ids
    ]


async def _consume(stream: AsyncIterator[RequestOutput]) -> None:
    async for _ in stream:
        pass


async def _until_idle(engine: AsyncEngine, what: str) -> None:
    """Aborts are applied on the engine thread; wait for them."""
    for _ in range(200):
        if await asyncio.wrap_future(engine.inspect(lambda core: core.is_idle())):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_concurrent_streams_match_offline(
    engine: AsyncEngine, expected: list[list[int]]
) -> None:
    got = await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
    assert got == expected


async def test_cancelling_a_stream_aborts_the_request(engine: AsyncEngine) -> None:
    seen = 0
    async for _ in engine.generate(NewRequest("long", PROMPTS[0], LONG)):
        seen += 1
        if seen == 3:
            break  # the client went away
    await _until_idle(engine, "the request was not aborted")


async def test_task_cancellation_aborts(engine: AsyncEngine) -> None:
    task = asyncio.create_task(_consume(engine.generate(NewRequest("c", PROMPTS[1], LONG))))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_idle(engine, "the request was not aborted")


async def test_bad_input_raises_at_once_and_others_continue(
    engine: AsyncEngine, expected: list[list[int]]
) -> None:
    good = asyncio.create_task(_collect(engine, "good", PROMPTS[0]))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="prompt is empty"):
        await _collect(engine, "bad", [])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=-1)
    assert await good == expected[0]


async def test_closed_engine_refuses(llm: LLM, expected: list[list[int]]) -> None:
    engine = AsyncEngine(llm.engine)
    engine.close()
    with pytest.raises(EngineDeadError):
        await _collect(engine, "x", PROMPTS[0])


async def test_duplicate_id_is_refused_and_the_first_stream_goes_on(
    engine: AsyncEngine, expected: list[list[int]]
) -> None:
    stream = await engine.submit(NewRequest("same", PROMPTS[0], GREEDY))
    with pytest.raises(DuplicateRequestError):
        await engine.submit(NewRequest("same", PROMPTS[1], GREEDY))
    assert [t async for out in stream for t in out.new_token_ids] == expected[0]


async def test_remote_plan_then_failure_prefills_locally(
    engine: AsyncEngine, expected: list[list[int]]
) -> None:
    """A planned remote prefill holds its blocks until settled; a failure prefills here
    and gives the same greedy tokens."""
    stream = await engine.submit(NewRequest("rp", PROMPTS[2], GREEDY), remote_min_uncached=1)
    assert stream.remote_plan is not None and stream.remote_plan.num_cached_tokens == 0
    snap = await asyncio.wrap_future(engine.inspect(lambda core: core.snapshot()))
    assert snap.remote_waiting == 1 and snap.kv_used_blocks == len(stream.remote_plan.block_ids)
    await engine.remote_failed("rp")
    assert [t async for out in stream for t in out.new_token_ids] == expected[2]


async def test_a_queue_pinned_out_by_remote_kv_waits_without_stepping(
    engine: AsyncEngine,
) -> None:
    """While a planned remote prefill pins most of the pool, a local prompt that does not
    fit in the rest cannot start and nothing runs: the engine thread waits for an event
    rather than spinning through empty steps. Freeing the pinned blocks lets it run."""
    pin = await engine.submit(
        NewRequest("pin", [100 + i % 500 for i in range(700)], GREEDY), remote_min_uncached=1
    )
    assert pin.remote_plan is not None  # 44 of the 63 blocks pinned
    blocked = engine.generate(NewRequest("blocked", [200 + i % 500 for i in range(400)], GREEDY))
    task = asyncio.ensure_future(_consume(blocked))
    await asyncio.sleep(0.1)
    steps = engine.steps
    await asyncio.sleep(0.3)
    assert engine.steps - steps <= 1  # before, thousands of empty steps
    assert engine.snapshot.waiting == 1 and engine.snapshot.running == 0
    engine.abort("pin")
    await engine.remote_failed("pin")  # no write can land: the blocks go back
    await asyncio.wait_for(task, 60)


async def test_cancelled_while_admitting_leaves_nothing(engine: AsyncEngine) -> None:
    task = asyncio.create_task(engine.submit(NewRequest("gone", PROMPTS[0], LONG)))
    await asyncio.sleep(0)  # the admission is queued, not yet answered
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_idle(engine, "the admitted request was not aborted")


async def test_a_reader_that_falls_behind_gets_the_waiting_steps_as_one_output(
    engine: AsyncEngine, expected: list[list[int]]
) -> None:
    stream = await engine.submit(NewRequest("slow", PROMPTS[0], GREEDY))
    while await asyncio.wrap_future(
        engine.inspect(lambda core: core.has_unfinished_requests())
    ):
        await asyncio.sleep(0.01)  # every step's output waits in the stream
    outs = [out async for out in stream]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert outs[0].new_token_ids == expected[0]
    assert outs[0].num_output_tokens == len(expected[0])


def test_followed_by_joins_tokens_and_keeps_the_later_state() -> None:
    a = RequestOutput("r", [1, 2], False, new_logprobs=None, num_output_tokens=2)
    b = RequestOutput("r", [3], True, "stop", stop_reason=3, num_output_tokens=3)
    ab = a.followed_by(b)
    assert (ab.new_token_ids, ab.finished, ab.finish_reason, ab.stop_reason) == (
        [1, 2, 3], True, "stop", 3,
    )  # fmt: skip
    assert ab.new_logprobs is None and ab.num_output_tokens == 3


async def test_the_snapshot_is_what_other_threads_read(engine: AsyncEngine) -> None:
    """After a request, the published snapshot counts what the prefix cache holds of a
    prompt as admission does, and the load figures the metrics read."""
    prompt = list(range(100, 150))  # 3 full blocks of 16, then 2 tokens
    await _collect(engine, "warm", prompt)
    snap = engine.snapshot  # published by the engine thread after the last step
    assert snap.prefix_hit(prompt) == 48
    assert snap.prefix_hit(prompt[:40]) == 32  # whole blocks, the last token never
    assert snap.prefix_hit([7, *prompt[1:]]) == 0 and snap.prefix_hit(prompt, "salt") == 0
    admitted = await engine.submit(NewRequest("again", prompt, GREEDY))
    assert admitted.cached_tokens == snap.prefix_hit(prompt)
    await _consume(admitted)
    assert snap.kv_total_blocks == 63 and 0 <= engine.snapshot.kv_used_blocks <= 63

"""The asyncio interface the workers drive: concurrent streams, cancellation, errors."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncEngine, DuplicateRequestError, NewRequest, SamplingParams
from engine.async_engine import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=64)


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(NewRequest(rid, prompt, GREEDY)):
        tokens += out.new_token_ids
    return tokens


def test_concurrent_streams_match_offline(llm: LLM) -> None:
    expected = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    engine = AsyncEngine(llm.engine)

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.close()
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


def test_cancelling_a_stream_aborts_the_request(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine)

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        seen = 0
        async for _ in engine.generate(NewRequest("long", PROMPTS[0], params)):
            seen += 1
            if seen == 3:
                break  # the client went away
        # the abort is applied on the engine thread; wait for it
        for _ in range(200):
            if await engine.run(lambda core: core.is_idle()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("request was not aborted")

    try:
        asyncio.run(main())
    finally:
        engine.close()
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


def test_task_cancellation_aborts(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine)

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        task = asyncio.create_task(_consume(engine.generate(NewRequest("c", PROMPTS[1], params))))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if await engine.run(lambda core: core.is_idle()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("request was not aborted")

    try:
        asyncio.run(main())
    finally:
        engine.close()


async def _consume(stream) -> None:  # type: ignore[no-untyped-def]
    async for _ in stream:
        pass


def test_bad_input_raises_at_once_and_others_continue(llm: LLM) -> None:
    expected = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    engine = AsyncEngine(llm.engine)

    async def main() -> list[int]:
        good = asyncio.create_task(_collect(engine, "good", PROMPTS[0]))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(engine, "bad", [])
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            SamplingParams(top_p=0)
        return await good

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.close()


def test_closed_engine_refuses(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine)
    engine.close()

    async def main() -> None:
        with pytest.raises(EngineDeadError):
            await _collect(engine, "x", PROMPTS[0])

    asyncio.run(main())


def test_duplicate_id_is_refused_and_the_first_stream_goes_on(llm: LLM) -> None:
    expected = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    engine = AsyncEngine(llm.engine)

    async def main() -> list[int]:
        stream = await engine.submit(NewRequest("same", PROMPTS[0], GREEDY))
        with pytest.raises(DuplicateRequestError):
            await engine.submit(NewRequest("same", PROMPTS[1], GREEDY))
        return [t async for out in stream for t in out.new_token_ids]

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.close()
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


def test_remote_plan_then_failure_prefills_locally(llm: LLM) -> None:
    """A planned remote prefill holds its blocks until settled; a failure prefills here
    and gives the same greedy tokens."""
    expected = llm.generate([PROMPTS[2]], GREEDY)[0].token_ids
    engine = AsyncEngine(llm.engine)

    async def main() -> list[int]:
        stream = await engine.submit(NewRequest("rp", PROMPTS[2], GREEDY), remote_min_uncached=1)
        assert stream.remote_plan is not None and stream.remote_plan.num_cached_tokens == 0
        snap = await engine.run(lambda core: core.snapshot())
        assert snap.remote_waiting == 1 and snap.kv_used_blocks == len(stream.remote_plan.block_ids)
        await engine.remote_failed("rp")
        return [t async for out in stream for t in out.new_token_ids]

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.close()
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


def test_cancelled_while_admitting_leaves_nothing(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine)

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        task = asyncio.create_task(engine.submit(NewRequest("gone", PROMPTS[0], params)))
        await asyncio.sleep(0)  # the admission is queued, not yet answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if await engine.run(lambda core: core.is_idle()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the admitted request was not aborted")

    try:
        asyncio.run(main())
    finally:
        engine.close()

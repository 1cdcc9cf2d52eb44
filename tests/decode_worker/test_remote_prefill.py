"""Remote prefill between an in-process decode worker and prefill worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from engine import LLM, SamplingParams
from tests.decode_worker.conftest import Pair, start_pair, stop_pair

PROMPTS = [list(range(100, 100 + n)) for n in (40, 77, 150)] + [[5, 6, 7]]

# every test starts workers of its own; they decode the model's file once between them
pytestmark = [pytest.mark.usefixtures("shared_weights"), pytest.mark.slow]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", num_blocks=192)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [r.token_ids for r in llm.generate(PROMPTS, params)]


def test_disaggregated_greedy_equals_aggregated(shm_pair: Pair, reference) -> None:  # type: ignore[no-untyped-def]
    for prompt, ref in zip(PROMPTS, reference):
        tokens, usage = shm_pair.generate(prompt)
        assert tokens == ref
        assert usage.remote_prefill == (len(prompt) >= 32), len(prompt)
    m = shm_pair.decode.metrics
    assert m.requests.labels(prefill="remote")._value.get() >= 3
    assert m.remote_finished.labels(result="ok")._value.get() >= 3
    assert m.transferred_bytes._value.get() > 0
    # the write time is measured (it was once encoded before the write: always 0)
    count = m.registry.get_sample_value("diptych_transfer_write_seconds_count")
    total = m.registry.get_sample_value("diptych_transfer_write_seconds_sum")
    assert count is not None and count >= 3 and total is not None and total > 0
    assert shm_pair.idle()


def test_prefix_cached_prompt_stays_local(shm_pair: Pair, reference) -> None:  # type: ignore[no-untyped-def]
    tokens, usage = shm_pair.generate(PROMPTS[2])  # its KV landed in the decode worker's cache
    assert tokens == reference[2]
    assert not usage.remote_prefill and usage.cached_tokens >= 144
    assert shm_pair.idle()


def test_seeded_sampling_and_logprobs_match_offline(shm_pair: Pair) -> None:
    """The first token is sampled remotely, the rest locally, from one seed."""
    prompt = PROMPTS[1] + [2, 3, 4] * 20
    tokens, usage = shm_pair.generate(
        prompt, max_tokens=6, temperature=0.9, seed=7, logprobs=3
    )
    assert usage.remote_prefill
    offline = LLM(dtype="float32", num_blocks=192).generate(
        [prompt],
        SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=7, logprobs=3),
    )[0]
    assert tokens == offline.token_ids
    assert offline.logprobs is not None and len(shm_pair.last_logprobs) == 6
    for got, want in zip(shm_pair.last_logprobs, offline.logprobs):
        assert abs(got.logprob - want.logprob) < 1e-4
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]
    assert shm_pair.idle()


@pytest.mark.parametrize("transfer", ["tcp"])
def test_other_backends(tmp_path, transfer, reference) -> None:  # type: ignore[no-untyped-def]
    pair = start_pair(tmp_path, transfer)
    try:
        for prompt, ref in zip(PROMPTS[:2], reference[:2]):
            tokens, usage = pair.generate(prompt)
            assert tokens == ref and usage.remote_prefill
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_no_prefill_worker_means_local(tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    pair = start_pair(tmp_path, with_prefill=False)
    try:
        tokens, usage = pair.generate(PROMPTS[2])
        assert tokens == reference[2] and not usage.remote_prefill
        assert pair.idle()
    finally:
        stop_pair(pair)


def _result(pair: Pair, outcome: str) -> float:
    return pair.decode.metrics.remote_finished.labels(result=outcome)._value.get()


def test_refused_write_falls_back_at_once(tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    # a prefill worker that considers every deadline too close refuses to write
    pair = start_pair(tmp_path, prefill_kw={"write_margin": 10_000.0})
    try:
        tokens, _ = pair.generate(PROMPTS[1])
        assert tokens == reference[1]
        assert _result(pair, "refused") == 1
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_malformed_notice_falls_back_and_the_loop_survives(  # type: ignore[no-untyped-def]
    tmp_path, reference, monkeypatch
) -> None:
    import json

    import prefill_worker.worker as prefill_module

    real = prefill_module.PrefillNotice

    class Corrupt(real):  # type: ignore[misc, valid-type]
        def encode(self) -> bytes:
            d = json.loads(super().encode())
            d["logprob"] = {"logprob": "not a number", "top": [{"token_id": "x"}]}
            return json.dumps(d).encode()

    monkeypatch.setattr(prefill_module, "PrefillNotice", Corrupt)
    pair = start_pair(tmp_path)
    try:
        tokens, usage = pair.generate(PROMPTS[1])
        assert tokens == reference[1] and not usage.remote_prefill  # prefilled here instead
        assert _result(pair, "malformed") == 1
        assert pair.decode.metrics.malformed_notices._value.get() == 1
        monkeypatch.setattr(prefill_module, "PrefillNotice", real)
        tokens, usage = pair.generate(PROMPTS[2])  # shares 64 cached tokens with PROMPTS[1]
        assert tokens == reference[2] and usage.remote_prefill  # the notice loop still runs
        assert _result(pair, "ok") == 1
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_a_failed_publish_falls_back_at_once(tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    pair = start_pair(tmp_path)
    try:

        async def refuse(msg: object) -> None:
            raise RuntimeError("the queue is away")

        pair.decode.rt.queue.publish = refuse  # type: ignore[method-assign]
        tokens, usage = pair.generate(PROMPTS[1])
        assert tokens == reference[1] and not usage.remote_prefill
        assert _result(pair, "publish_error") == 1
        assert pair.idle() and not pair.decode.remote.pending
    finally:
        stop_pair(pair)


@pytest.mark.parametrize("odd_layout", [{"block_size": 32}, {"kv_cache_dtype": "int8"}])
def test_layout_mismatch_is_dead_lettered(tmp_path, reference, odd_layout) -> None:  # type: ignore[no-untyped-def]
    pair = start_pair(tmp_path, with_prefill=False)
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.worker import PrefillWorker
    from tests.decode_worker.conftest import engine_config

    odd = PrefillWorker(
        PrefillWorkerConfig(
            discovery_url=pair.url,
            queue_url=pair.url,
            engine=engine_config(**odd_layout),  # another KV layout
            metrics_port=None,
        )
    )
    pair.loop.run(odd.start())
    pair.prefill = odd
    try:
        import time

        for _ in range(100):
            if len(pair.decode.prefill_workers):
                break
            time.sleep(0.05)
        tokens, _ = pair.generate(PROMPTS[1])
        assert tokens == reference[1]
        assert _result(pair, "dead_letter") == 1
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_deadline_falls_back_without_reusing_blocks_early(tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    pair = start_pair(tmp_path, decode_kw={"remote_prefill_timeout": 1.0, "late_write_grace": 0.5})
    assert pair.prefill is not None
    try:
        # the prefill worker stops fetching: the request waits in the queue
        loop_task = pair.prefill._loop_task
        assert loop_task is not None
        pair.loop.loop.call_soon_threadsafe(loop_task.cancel)
        tokens, _ = pair.generate(PROMPTS[2])
        assert tokens == reference[2]
        assert _result(pair, "timeout") == 1
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_abort_while_waiting_keeps_blocks_until_the_notice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from protocol.sampling import SamplingParams as Wire
    from runtime.rpc.types import GenerateRequest

    pair = start_pair(tmp_path)
    assert pair.prefill is not None
    try:
        loop_task = pair.prefill._loop_task
        assert loop_task is not None
        pair.loop.loop.call_soon_threadsafe(loop_task.cancel)  # hold the request in the queue

        async def cancel_early() -> list[int]:
            from runtime.rpc.client import DecodeWorkerClient

            assert pair.decode.info is not None
            async with DecodeWorkerClient(pair.decode.info.grpc_address) as c:
                stream = c.generate(GenerateRequest("gone", tuple(PROMPTS[2]), Wire(max_tokens=4)))
                task = asyncio.ensure_future(stream.__anext__())
                await _until(lambda: "gone" in pair.decode.remote.pending)  # published
                stream.cancel()
                task.cancel()
                # the worker has let the request go (closing its stream aborts it), ...
                await _until(lambda: handler.active == 0)
                # ... yet the blocks stay pinned: a write may still land
                return await pair.decode.engine.block_ids("gone")

        handler = pair.decode.handler
        assert handler is not None

        pinned = pair.loop.run(cancel_early())
        assert len(pinned) == -(-len(PROMPTS[2]) // 16)
        assert "gone" in pair.decode.remote.pending
        pair.prefill._loop_task = None
        pair.loop.run(_restart_loop(pair))
        assert pair.idle()  # the notice arrived, the aborted request released its blocks
    finally:
        stop_pair(pair)


async def _until(ok: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < end, f"not within {timeout}s"
        await asyncio.sleep(0.01)


async def _restart_loop(pair: Pair) -> None:
    import asyncio

    assert pair.prefill is not None
    pair.prefill._loop_task = asyncio.create_task(pair.prefill._serve_forever())
    for _ in range(200):
        if not pair.decode.remote.pending:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the remote prefill never completed")


def test_a_broker_restart_longer_than_a_call_does_not_wait_out_the_deadline(  # type: ignore[no-untyped-def]
    tmp_path, reference, caplog
) -> None:
    """NATS goes away while a prefill worker computes a request and stays away longer
    than one queue call retries (publish_timeout): the claim is retried until the server
    is back, so the remote prefill completes moments later, not at the deadline."""
    import dataclasses
    import logging
    import threading

    from tests.servers import NatsServer

    caplog.set_level(logging.WARNING, logger="prefill_worker.worker")

    def claim_gave_up_once() -> bool:
        return any("the queue is unavailable" in r.getMessage() for r in caplog.records)

    nats = NatsServer("nats", tmp_path / "nats" / "data")
    nats.start()
    pair = start_pair(
        tmp_path / "cp", queue_url=nats.url, decode_kw={"remote_prefill_timeout": 60.0}
    )
    assert pair.prefill is not None
    # one queue call's retry budget while the server is away (publish_timeout, read at
    # each call): 1 s instead of the default 5 s, so the outage that outlasts it is short
    budget = 1.0
    for w in (pair.decode, pair.prefill):
        w.rt.queue.options = dataclasses.replace(w.rt.queue.options, publish_timeout=budget)
    try:
        gate, reached = asyncio.Event(), threading.Event()
        submit = pair.prefill.engine.submit

        async def held_submit(*args, **kwargs):  # type: ignore[no-untyped-def]
            reached.set()  # the delivery is fetched; hold its prefill until told
            await gate.wait()
            return await submit(*args, **kwargs)

        pair.prefill.engine.submit = held_submit  # type: ignore[method-assign]
        result: list[tuple[list[int], object]] = []
        t = threading.Thread(target=lambda: result.append(pair.generate(PROMPTS[2])))
        t.start()
        assert reached.wait(60)
        nats.stop()
        pair.loop.loop.call_soon_threadsafe(gate.set)  # prefill, then claim: no server
        # the server stays away until a claim call has spent its budget and given up
        # (the worker says it retries)
        end = time.monotonic() + 60
        while not claim_gave_up_once():
            assert time.monotonic() < end, "the claim never gave up on the absent server"
            time.sleep(0.05)
        assert t.is_alive()  # the request still waits for its prefill
        back = time.monotonic()
        nats.start()
        t.join(60)
        took = time.monotonic() - back
        tokens, usage = result[0]
        assert tokens == reference[2] and usage.remote_prefill  # type: ignore[attr-defined]
        assert _result(pair, "ok") == 1 and _result(pair, "timeout") == 0
        assert took < 15.0, f"finished {took:.1f}s after the server came back"
        assert pair.idle()
    finally:
        stop_pair(pair)
        nats.stop()


def test_a_stopping_prefill_worker_finishes_what_it_holds(tmp_path, reference) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM's path (`PrefillWorker.stop`) while a prefill is computing: the worker
    leaves discovery and pulls nothing more, but the prefill it holds is written and
    notified; the decode worker gets it remotely, no fallback."""
    import asyncio
    import threading

    pair = start_pair(tmp_path)
    prefill = pair.prefill
    assert prefill is not None
    try:
        gate, reached = asyncio.Event(), threading.Event()
        submit = prefill.engine.submit

        async def held_submit(*args, **kwargs):  # type: ignore[no-untyped-def]
            reached.set()
            await gate.wait()
            return await submit(*args, **kwargs)

        prefill.engine.submit = held_submit  # type: ignore[method-assign]
        result: list[tuple[list[int], object]] = []
        t = threading.Thread(target=lambda: result.append(pair.generate(PROMPTS[2])))
        t.start()
        assert reached.wait(60)
        stopping = asyncio.run_coroutine_threadsafe(prefill.stop(), pair.loop.loop)
        pair.loop.loop.call_soon_threadsafe(gate.set)
        stopping.result(60)
        pair.prefill = None  # stopped
        t.join(60)
        tokens, usage = result[0]
        assert tokens == reference[2] and usage.remote_prefill  # type: ignore[attr-defined]
        assert _result(pair, "ok") == 1
        assert pair.idle()
    finally:
        stop_pair(pair)


def test_both_workers_report_their_time_to_ready(shm_pair: Pair) -> None:
    """Registered in discovery: each says when its process started and how long it took
    to become ready (the planner's dashboard shows both)."""
    assert shm_pair.prefill is not None
    for metrics in (shm_pair.decode.metrics, shm_pair.prefill.metrics):
        ready = metrics.ready_seconds._value.get()
        assert 0 < ready < time.time() - metrics.started_at + 1


def test_a_prefill_worker_of_other_numerics_refuses_a_deterministic_request(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--deterministic` decode worker offers only to prefill workers of its numerics,
    but one may join after the offer: it refuses with a not-ok notice, and the decode
    worker prefills the prompt itself at once, the tokens those of the deterministic
    engine alone."""
    det = {"dtype": "bfloat16", "deterministic": True}
    pair = start_pair(tmp_path_factory.mktemp("det"), decode_engine=det,
                      prefill_engine={"dtype": "bfloat16"})  # fmt: skip
    try:
        remote = pair.decode.remote
        # the offer as made before the other worker joined
        monkeypatch.setattr(remote, "rule", lambda adapter=None: remote._rule)
        tokens, usage = pair.generate(PROMPTS[1], max_tokens=4)
        assert not usage.remote_prefill
        assert pair.prefill is not None
        refused = pair.prefill.metrics.prefills.labels(result="refused")._value.get()
        assert refused == 1
        assert pair.idle()
    finally:
        stop_pair(pair)
    offline = LLM(num_blocks=192, **det).generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )[0]
    assert tokens == offline.token_ids

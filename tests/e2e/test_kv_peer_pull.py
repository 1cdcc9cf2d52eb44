"""Prefix pulls between decode workers on real processes (issue 40, "reuse across
workers"): `diptych serve` with two decode workers on the default model in fp32, over
the shm transfer. A worker told that its peer holds a prompt has the peer write those
blocks into its pool (decode_worker/peer_kv.py): its greedy tokens are the ones the
peer computed, its usage counts the pulled blocks as cached, and a pull of blocks the
peer holds only in its host tier is restored there first. A pull of what the peer
lacks is refused and the prompt is computed. Through the frontend, the router sends a
repeated prompt to the idle worker with a pull from the busy one that holds it. Both
pools end idle."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from protocol.sampling import SamplingParams
from runtime.rpc import DecodeWorkerClient, GenerateRequest
from tests.e2e.serving import STREAM_PROMPTS, Server, greedy_stream

pytestmark = pytest.mark.slow

BS = 16
NEW = 12
WORKERS = ["decode-0", "decode-1"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("peer-pull"),
        "--prefill-workers", "0", "--decode-workers", "2", "--dtype", "float32",
        # 23 usable blocks: two 10-block prompts and a third push the first out, into
        # the host tier (about 20 blocks)
        "--num-blocks", "24", "--kv-host-memory", "0.016",
        "--router-peer-pull-cost", "0",  # (the router test: a pull beats any load)
        "--peer-pull-timeout", "2",  # (the stopped holder's test)
    )  # fmt: skip
    yield server
    server.stop()


def _prompt(seed: int, n: int = 10 * BS + 3) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 40_000) for _ in range(n))


def _generate(server: Server, worker: str, rid: str, prompt: tuple[int, ...],
              peer: str = "") -> tuple[list[int], int]:  # fmt: skip
    """(greedy tokens, cached prompt tokens) of one request sent straight to `worker`
    (as a frontend would, naming `peer` as the holder of the whole prompt)."""
    address = server.manifest[worker]["grpc"]
    request = GenerateRequest(
        rid, prompt, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
        kv_peer=peer, kv_peer_blocks=(len(prompt) - 1) // BS if peer else 0,
    )  # fmt: skip

    async def run() -> tuple[list[int], int]:
        tokens: list[int] = []
        cached = -1
        async with DecodeWorkerClient(address, worker_id=worker) as client:
            async for chunk in client.generate(request, timeout=120):
                tokens += chunk.token_ids
                if chunk.usage is not None and cached < 0:
                    cached = chunk.usage.cached_tokens
        return tokens, cached

    return asyncio.run(run())


def _counter(server: Server, worker: str, name: str) -> float:
    return server.metrics(worker).get(name, 0.0)


def _pulls(server: Server, worker: str, result: str) -> float:
    return _counter(server, worker, f'diptych_worker_kv_peer_pulls_total{{result="{result}"}}')


def test_a_pulled_prefix_gives_the_peers_tokens(fleet: Server) -> None:
    prompt = _prompt(1)
    blocks = (len(prompt) - 1) // BS
    computed, cached = _generate(fleet, "decode-0", "p1-a", prompt)
    assert cached == 0 and len(computed) == NEW
    pushed = _counter(fleet, "decode-0", "diptych_worker_kv_peer_pushed_blocks_total")
    pulled, cached = _generate(fleet, "decode-1", "p1-b", prompt, peer="decode-0")
    assert pulled == computed
    assert cached == blocks * BS  # decode-1 never saw the prompt: every block was pulled
    assert _pulls(fleet, "decode-1", "ok") == 1
    assert _counter(fleet, "decode-0", "diptych_worker_kv_peer_pushed_blocks_total") == (
        pushed + blocks
    )


def test_the_peer_restores_blocks_from_its_host_tier_for_a_pull(fleet: Server) -> None:
    prompt = _prompt(2)
    computed, _ = _generate(fleet, "decode-0", "p2-a", prompt)
    for i in (3, 4):  # the pool fills: the first prompt's blocks leave for the host tier
        _generate(fleet, "decode-0", f"p2-fill-{i}", _prompt(i))
    restored = _counter(fleet, "decode-0", "diptych_worker_kv_tier_restored_blocks_total")
    pulled, cached = _generate(fleet, "decode-1", "p2-b", prompt, peer="decode-0")
    assert pulled == computed and cached == (len(prompt) - 1) // BS * BS
    assert _counter(fleet, "decode-0", "diptych_worker_kv_tier_restored_blocks_total") > restored


def test_a_pull_of_what_the_peer_lacks_is_refused_and_computed(fleet: Server) -> None:
    prompt = _prompt(5)
    refused = _pulls(fleet, "decode-1", "refused")
    tokens, cached = _generate(fleet, "decode-1", "p5-b", prompt, peer="decode-0")
    assert cached == 0 and _pulls(fleet, "decode-1", "refused") == refused + 1
    # the same tokens as the peer computes for it
    assert _generate(fleet, "decode-0", "p5-a", prompt) == (tokens, 0)


def test_a_holder_that_does_not_answer_costs_the_timeout_and_nothing_else(
    fleet: Server,
) -> None:
    """The holder is frozen (SIGSTOP) when it is asked: the pull times out after
    --peer-pull-timeout, the prompt is computed, and the blocks reserved for the write
    are let go of once no write can land; the holder, thawed, refuses the stale ask."""
    prompt = _prompt(6)
    computed, _ = _generate(fleet, "decode-0", "p6-a", prompt)
    timeouts = _pulls(fleet, "decode-1", "timeout")
    pid = fleet.manifest["decode-0"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        tokens, cached = _generate(fleet, "decode-1", "p6-b", prompt, peer="decode-0")
        waited = time.monotonic() - began
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (tokens, cached) == (computed, 0)
    assert waited >= 2.0  # (the timeout: an upper bound would time this machine, not the code)
    assert _pulls(fleet, "decode-1", "timeout") == timeouts + 1


def test_the_router_pulls_for_an_idle_worker_what_a_busy_one_holds(fleet: Server) -> None:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=300)
    prompt = STREAM_PROMPTS[0] + " Keep to these notes: " + " ".join(
        f"note {j} says item {j * 7 % 13} comes before item {j * 5 % 11}." for j in range(9)
    )
    expected, _ = greedy_stream(client, prompt, 24, [0], 0)  # computed by one worker
    pulled_before = sum(_pulls(fleet, w, "ok") for w in WORKERS)
    # the same prompt again, long, keeps its worker busy (its context is its load)
    first = threading.Event()
    busy = threading.Thread(target=_long_stream, args=(client, prompt, first), daemon=True)
    busy.start()
    assert first.wait(120)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, cached = "", 0
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    busy.join(300)
    assert text == expected
    assert cached >= 8 * BS  # the idle worker had the busy one's blocks written to it
    assert sum(_pulls(fleet, w, "ok") for w in WORKERS) == pulled_before + 1


def _long_stream(client: openai.OpenAI, prompt: str, first: threading.Event) -> None:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}], max_tokens=160, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for _ in stream:
        first.set()


def test_both_pools_end_idle(fleet: Server) -> None:
    end = time.monotonic() + 60  # a timed-out pull's blocks go after the late-write grace
    for w in WORKERS:
        while fleet.metrics(w)["diptych_worker_kv_usage"] != 0.0:
            assert time.monotonic() < end, f"{w} holds blocks"
            time.sleep(0.5)

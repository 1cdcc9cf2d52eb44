"""`diptych serve --engine sim`: the real frontend, workers, queue and transfer over a
simulated engine; the official openai client; `diptych profile --url` against it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from diptych.cli import main
from tests.e2e.serving import Server, scrape

LONG = " ".join(f"word{i}" for i in range(300))  # well over the 128-token remote threshold


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    server = Server(
        tmp_path_factory.mktemp("sim-serve"),
        "--engine", "sim", "--profile", "H200:Llama-3.1-70B:tp8", "--time-scale", "4",
        "--prefill-workers", "1", "--decode-workers", "2",
    )  # fmt: skip
    yield server  # type: ignore[misc]
    assert server.stop() == 0


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_it_serves_the_simulated_model_deterministically(sim_server: Server) -> None:
    client = _client(sim_server)
    assert [m.id for m in client.models.list().data] == ["Llama-3.1-70B"]
    texts = [
        client.completions.create(
            model="Llama-3.1-70B", prompt=LONG, max_tokens=12, temperature=0
        ).choices[0]
        for _ in range(2)
    ]
    assert texts[0].text == texts[1].text and texts[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="Llama-3.1-70B", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        stream=True, temperature=0,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert 1 <= len(chunks) <= 8


def test_long_prompts_go_to_the_prefill_worker_and_every_block_comes_back(
    sim_server: Server,
) -> None:
    client = _client(sim_server)
    for i in range(4):
        client.completions.create(model="Llama-3.1-70B", prompt=f"{i} {LONG}", max_tokens=4)
    decode = [sim_server.metrics(f"decode-{i}") for i in range(2)]
    started = sum(m.get("diptych_worker_remote_prefills_started_total", 0.0) for m in decode)
    assert started >= 4
    for child in ("decode-0", "decode-1", "prefill-0"):
        m = sim_server.metrics(child)
        assert m["diptych_worker_kv_used_blocks"] == 0.0, child
        assert m["diptych_worker_kv_total_blocks"] > 100_000  # an H200's pool, in blocks


def test_profile_sweeps_a_running_server(sim_server: Server, tmp_path: Path) -> None:
    out = tmp_path / "served.json"
    rc = main(["profile", "--url", sim_server.url, "--output", str(out), "--prefill-tokens",
               "32,256", "--cached-tokens", "0,128", "--batch-sizes", "1,4", "--contexts",
               "64,256", "--repeats", "1"])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["engine"]["through"] == "http"
    assert all(t > 0 for row in doc["prefill"]["seconds"] + doc["decode"]["seconds"] for t in row)
    assert httpx.get(sim_server.url + "/v1/models", timeout=10).status_code == 200


def _frontend_metrics(server: Server) -> dict[str, float]:
    return scrape(server.url)


def test_kv_router_sends_each_next_turn_to_the_worker_holding_it(sim_server: Server) -> None:
    """Real processes, two decode workers: every later turn of a conversation finds its
    history in the prefix cache of the worker it is routed to (least-loaded routing would
    send about half of them to the other worker)."""
    client = _client(sim_server)
    # the frontend follows each worker's events from when it sees it: wait until the
    # index holds what four warm-up prompts left on the workers
    for i in range(4):
        client.completions.create(model="Llama-3.1-70B", prompt=f"warm {i} {LONG}", max_tokens=1)
    end = time.monotonic() + 20
    while _frontend_metrics(sim_server)["diptych_frontend_router_indexed_blocks"] < 4 * 19:
        assert time.monotonic() < end, "the router's index stayed cold"
        time.sleep(0.1)
    before = _frontend_metrics(sim_server)
    later_turns = 0
    for s in range(6):
        history = f"Session {s}: " + " ".join(f"topic{s}w{i}" for i in range(150))
        previous = 0
        for turn in range(3):
            history += " " + " ".join(f"turn{turn}q{i}" for i in range(20))
            r = client.completions.create(
                model="Llama-3.1-70B", prompt=history, max_tokens=4, temperature=0
            )
            assert r.usage is not None
            details = r.usage.prompt_tokens_details
            cached = details.cached_tokens if details and details.cached_tokens else 0
            if turn:
                later_turns += 1
                # all of the last turn's full blocks (the last token is never counted)
                assert cached >= (previous - 1) // 16 * 16, (s, turn, cached, previous)
            previous = r.usage.prompt_tokens
    after = _frontend_metrics(sim_server)

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    # each later turn went to the worker holding its history, or to the other one with the
    # history written into its pool by the holder (a pull: decode_worker/peer_kv.py)
    held = ('diptych_frontend_router_decisions_total{reason="prefix"}',
            'diptych_frontend_router_decisions_total{reason="pull"}')  # fmt: skip
    assert sum(grew(k) for k in held) >= later_turns
    # the router predicted the hits the workers reported
    actual = grew("diptych_frontend_router_actual_cached_tokens_total")
    assert actual >= later_turns * 800
    assert grew("diptych_frontend_router_predicted_cached_tokens_total") == actual
    assert after["diptych_frontend_router_indexed_blocks"] > 0

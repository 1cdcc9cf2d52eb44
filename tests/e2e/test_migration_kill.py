"""A decode worker SIGKILLed mid-stream on real processes: `diptych serve` with two decode
workers serving the default model in fp32, greedy streams in flight, the worker killed
one that holds some of them. Every stream completes, with the same text as an unbroken
run, through the official openai client; the frontend migrated those on the dead
worker; the survivor's blocks are back to idle."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.serving import (
    STREAM_PROMPTS,
    Server,
    greedy_stream,
    kill_a_busy_worker,
    scrape,
    streams_through_a_kill,
)

pytestmark = pytest.mark.slow

PROMPTS = STREAM_PROMPTS
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("migrate"),
        "--prefill-workers", "0", "--decode-workers", "2", "--dtype", "float32",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_streams_on_a_killed_decode_worker_finish_elsewhere_unchanged(pair: Server) -> None:
    client = openai.OpenAI(base_url=pair.url + "/v1", api_key="x", max_retries=0, timeout=300)
    unbroken = [greedy_stream(client, p, MAX_TOKENS, [0], 0) for p in PROMPTS]
    assert all(f == "length" for _, f in unbroken)
    workers = ["decode-0", "decode-1"]

    def kill() -> None:
        kill_a_busy_worker(pair, workers)

    results = streams_through_a_kill(client, PROMPTS, MAX_TOKENS, kill, under_way=6, server=pair)
    assert results == unbroken, [r if isinstance(r, BaseException) else r[1] for r in results]

    front = scrape(pair.url)
    assert front['diptych_frontend_failovers_total{kind="migration"}'] >= 1
    assert front["diptych_frontend_stream_errors_total"] == 0
    assert pair.metrics(workers[0])["diptych_worker_kv_used_blocks"] == 0.0

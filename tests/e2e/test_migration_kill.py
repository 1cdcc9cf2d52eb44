"""A decode worker SIGKILLed mid-stream on real processes: `diptych serve` with two decode
workers serving the default model in fp32, greedy streams in flight on both. Every
stream completes, with the same text as an unbroken run, through the official openai
client; the frontend migrated those on the dead worker; the survivor's blocks are back
to idle."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.serving import Server, scrape

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain, step by step, how bread is made at home.",
    "Describe a walk through a busy market in the morning.",
    "List the things a traveller should pack for a week in the mountains.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("migrate"),
        "--prefill-workers", "0", "--decode-workers", "2", "--dtype", "float32",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def _stream(client: openai.OpenAI, prompt: str, progress: list[int], i: int) -> tuple[str, str]:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, finish = "", ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            progress[i] += 1
    return text, finish


def test_streams_on_a_killed_decode_worker_finish_elsewhere_unchanged(pair: Server) -> None:
    client = openai.OpenAI(base_url=pair.url + "/v1", api_key="x", max_retries=0, timeout=300)
    unbroken = [_stream(client, p, [0], 0) for p in PROMPTS]
    assert all(f == "length" for _, f in unbroken)

    progress = [0] * len(PROMPTS)
    results: list[tuple[str, str] | BaseException | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        try:
            results[i] = _stream(client, PROMPTS[i], progress, i)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while min(progress) < 6 and time.monotonic() < end:  # every stream under way
        time.sleep(0.01)
    assert min(progress) >= 6, progress
    victim = pair.manifest["decode-0"]["pid"]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert results == unbroken, [r if isinstance(r, BaseException) else r[1] for r in results]

    front = scrape(pair.url)
    assert front['diptych_frontend_failovers_total{kind="migration"}'] >= 1
    assert front["diptych_frontend_stream_errors_total"] == 0
    assert pair.metrics("decode-1")["diptych_worker_kv_used_blocks"] == 0.0

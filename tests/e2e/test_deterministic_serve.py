"""`diptych serve --deterministic` on real processes, bf16, through the official openai
client: one prefill worker and two decode workers.

- 48 greedy chats sent one at a time (each prompt cold) give the text of the aggregated
  engine in this process, which prefills them all in one batch in 64-token chunks; sent
  again 12 at a time (their prompts now in the prefix caches), they give the same text
  and the same logprobs, bit for bit: disaggregation, batching, the prefix cache and
  chunking change no logit;
- seeded chats at temperature 1 draw the same tokens alone and 12 at a time;
- streams on a decode worker SIGKILLed mid-stream migrate and end with the text of an
  unbroken run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

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

PROMPTS = [
    f"{['Give', 'Tell', 'Name'][i % 3]} me one {['fact', 'story', 'joke', 'word'][i % 4]} "
    f"about the number {i}."
    for i in range(48)
]
MAX_TOKENS = 8
BASE = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("deterministic"),
        "--prefill-workers", "1", "--decode-workers", "2", "--dtype", "bfloat16",
        "--deterministic", "--min-remote-prefill-tokens", "1",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def _offline(seed: int | None) -> list[str]:
    """Each chat's text from an aggregated deterministic engine here, all in one batch
    under a 64-token budget (so in chunks)."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if seed is None else 1.0,
                            seed=seed, ignore_eos=True)  # fmt: skip
    config = EngineConfig(dtype="bfloat16", deterministic=True, num_blocks=512,
                          max_num_batched_tokens=64, max_num_seqs=64)  # fmt: skip
    with LLM.from_config(config) as llm:
        out = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [r.text for r in out]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


Chat = tuple[str, list[float]]


def _chat(client: openai.OpenAI, prompt: str, seed: int | None) -> Chat:
    """The completion's text and its tokens' logprobs (the model's logits, so equal
    logprobs are equal logits)."""
    r = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0.0 if seed is None else 1.0, seed=seed, logprobs=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and r.choices[0].message.content is not None
    return r.choices[0].message.content, [t.logprob for t in content]


def _at_once(client: openai.OpenAI, prompts: list[str], seed: int | None) -> list[Chat]:
    out: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = _chat(client, prompts[i], seed)

    for wave in range(0, len(prompts), 12):
        threads = [threading.Thread(target=run, args=(i,))
                   for i in range(wave, min(wave + 12, len(prompts)))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    return out


def test_greedy_chats_alone_and_12_at_a_time_equal_the_aggregated_engine(fleet: Server) -> None:
    client = _client(fleet)
    card = client.models.list().data[0]
    assert getattr(card, "deterministic", None) is True
    alone = [_chat(client, p, None) for p in PROMPTS]
    assert [text for text, _ in alone] == _offline(None)
    assert _at_once(client, PROMPTS, None) == alone  # texts and logprobs

    decode = [fleet.metrics(w) for w in ("decode-0", "decode-1")]
    remote = sum(m.get('diptych_worker_requests_total{prefill="remote"}', 0) for m in decode)
    assert remote > 0  # the prefill worker computed prompts' KV
    assert all(m["diptych_worker_deterministic_local_prefills_total"] == 0 for m in decode)
    info = [k for k in decode[0] if k.startswith("diptych_worker_kernels_info")]
    assert info and all('deterministic="yes"' in k for k in info), info


def test_seeded_sampling_draws_the_same_tokens_alone_and_at_once(fleet: Server) -> None:
    client = _client(fleet)
    prompts = PROMPTS[:12]
    alone = [_chat(client, p, 7) for p in prompts]
    assert _at_once(client, prompts, 7) == alone
    assert [text for text, _ in alone] == _offline(7)[:12]

    # n = 3 (choice i seeded seed + i): the same choices alone and beside 11 others
    def three() -> list[str | None]:
        r = client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": PROMPTS[20]}], n=3, seed=11,
            max_tokens=MAX_TOKENS, temperature=1.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    single = three()
    beside: list[Any] = []
    others = threading.Thread(target=lambda: beside.append(_at_once(client, prompts[:11], 7)))
    others.start()
    assert three() == single
    others.join(300)
    assert beside == [alone[:11]]


def test_streams_on_a_killed_decode_worker_finish_unchanged(fleet: Server) -> None:
    client = _client(fleet)
    # 96 tokens: with 40 a deterministic decode (the one-call stack since 8e03fa6) could
    # finish the victim's streams between the scrape that picked it and the kill
    unbroken = [greedy_stream(client, p, 96, [0], 0) for p in STREAM_PROMPTS]
    workers = ["decode-0", "decode-1"]
    results = streams_through_a_kill(
        client, STREAM_PROMPTS, 96, lambda: kill_a_busy_worker(fleet, workers), under_way=6,
        server=fleet,
    )
    assert results == unbroken, [r if isinstance(r, BaseException) else r[1] for r in results]
    assert scrape(fleet.url)['diptych_frontend_failovers_total{kind="migration"}'] >= 1

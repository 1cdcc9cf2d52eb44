"""`diptych serve --kv-cache-dtype int8 --num-speculative-tokens 3` (1 prefill + 1
decode worker): the prefill worker writes int8 blocks, about half the bytes of bf16,
into the decode worker's int8 pool; the decode worker drafts by prompt lookup and
verifies over that pool; the served text is the offline engine's with the same KV
cache and no drafts, streamed or not. `--kv-cache-dtype fp8`: the same remote prefill
with fp8 (e4m3) blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import openai
import pytest

from engine import LLM, SamplingParams
from protocol.kv_layout import KvLayout
from tests.e2e.conftest import BASE_FLAGS
from tests.e2e.serving import Server
from tests.e2e.test_serve_openai import LONG

pytestmark = pytest.mark.slow

QUOTE = (
    "Repeat the following sentence exactly, twice: The quick brown fox jumps over the "
    "lazy dog while the harbour bells ring at noon."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(
        tmp_path_factory.mktemp("serve-int8"), *BASE_FLAGS,
        "--kv-cache-dtype", "int8", "--num-speculative-tokens", "3",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", num_blocks=64, kv_cache_dtype="int8")


def test_remote_prefill_moves_int8_blocks(server: Server, offline: LLM) -> None:
    _check_remote_prefill(server, offline, "int8")


def test_remote_prefill_moves_fp8_blocks(tmp_path_factory: pytest.TempPathFactory) -> None:
    s = Server(tmp_path_factory.mktemp("serve-fp8"), *BASE_FLAGS, "--kv-cache-dtype", "fp8")
    try:
        _check_remote_prefill(s, LLM(dtype="float32", num_blocks=64, kv_cache_dtype="fp8"),
                              "float8_e4m3fn")  # fmt: skip
    finally:
        assert s.stop() == 0, "".join(s.log[-30:])


def _check_remote_prefill(server: Server, offline: LLM, pool_dtype: str) -> None:
    """One long prompt prefilled remotely: the offline engine's text, and the decode
    worker received exactly the prompt's blocks in the quantized format."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=LONG, max_tokens=16, temperature=0)
    want = offline.generate(LONG, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.choices[0].text == want.text

    metrics = server.metrics("decode-0")
    assert metrics['diptych_worker_requests_total{prefill="remote"}'] == 1
    layout: KvLayout = offline.engine.runner.layout
    assert layout.dtype == pool_dtype
    assert out.usage is not None
    blocks = -(-out.usage.prompt_tokens // layout.block_size)
    received = metrics["diptych_transfer_received_bytes_total"]
    assert received == blocks * layout.block_bytes
    fp32_block = dataclasses.replace(layout, dtype="float32").block_bytes
    assert received / (blocks * fp32_block) == 66 / 256  # a quarter of fp32's, ~half of bf16's


def test_drafted_tokens_stream_as_the_models_own(server: Server, offline: LLM) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": QUOTE}]
    plain = SamplingParams(temperature=0, max_tokens=48, num_speculative_tokens=0)
    want = offline.chat(messages, plain)[0].text
    before = server.metrics("decode-0").get("diptych_worker_spec_accepted_tokens_total", 0)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, stream=True  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want
    metrics = server.metrics("decode-0")
    accepted = metrics["diptych_worker_spec_accepted_tokens_total"]
    assert accepted > before
    assert 0 < metrics["diptych_worker_spec_acceptance_rate"] <= 1
    # a request may opt out of the server's default
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0,  # type: ignore[arg-type]
        extra_body={"num_speculative_tokens": 0},
    )  # fmt: skip
    assert out.choices[0].message.content == want
    assert server.metrics("decode-0")["diptych_worker_spec_accepted_tokens_total"] == accepted

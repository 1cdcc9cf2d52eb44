"""The official ``openai`` client against the frontend served by uvicorn: chat and
completions, streamed and not, usage, logprobs, errors as the client's exception types;
greedy output equal to the offline ``engine.LLM`` for the same prompt."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import CompletionResult, SamplingParams
from frontend.metrics import FrontendMetrics
from tests.frontend.harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in a sentence."}
]
Reference = Callable[[str | list[int], SamplingParams], CompletionResult]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_models_lists_the_served_model(client: openai.OpenAI, served: Cluster) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_matches_offline_engine(
    client: openai.OpenAI, served: Cluster, reference: Reference
) -> None:
    ids = served.llm.tokenizer.apply_chat_template(QUESTION)
    ref = reference(ids, greedy(24))
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, user="u-1"
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert r.usage.prompt_tokens_details is not None


def test_chat_stream_with_usage_matches_offline_engine(
    client: openai.OpenAI, served: Cluster, reference: Reference
) -> None:
    ids = served.llm.tokenizer.apply_chat_template(QUESTION)
    ref = reference(ids, greedy(20, ignore_eos=True))
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_completion_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_matches_offline_engine(client: openai.OpenAI, reference: Reference) -> None:
    prompt = "The three primary colors are"
    ref = reference(prompt, greedy(16))
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage is not None and r.usage.completion_tokens == len(ref.token_ids)

    # the same prompt as token ids, streamed
    stream = client.completions.create(
        model=MODEL, prompt=ref.prompt_token_ids, temperature=0, max_tokens=16, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_completion_echo_and_default_max_tokens(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt)
    assert r.usage is not None and r.usage.completion_tokens <= 16  # the API's default


def test_chat_logprobs_match_offline_engine(
    client: openai.OpenAI, served: Cluster, reference: Reference
) -> None:
    ids = served.llm.tokenizer.apply_chat_template(QUESTION)
    ref = reference(ids, greedy(8, logprobs=3, ignore_eos=True))
    assert ref.logprobs is not None
    for stream in (False, True):
        kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
        kw.update(logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        if stream:
            content: list[Any] = []
            for c in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
                if c.choices and c.choices[0].logprobs is not None:
                    content += c.choices[0].logprobs.content or []
        else:
            r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
            assert r.choices[0].logprobs is not None
            content = r.choices[0].logprobs.content or []
        assert len(content) == 8
        for entry, lp in zip(content, ref.logprobs):
            assert math.isclose(entry.logprob, lp.logprob, abs_tol=1e-4)
            assert len(entry.top_logprobs) == 3
            assert entry.token == entry.top_logprobs[0].token  # greedy takes the top token
            assert [t.logprob for t in entry.top_logprobs] == sorted(
                (t.logprob for t in entry.top_logprobs), reverse=True
            )
            assert bytes(entry.bytes or []).decode() == entry.token
        raw_text = served.llm.tokenizer.decode(ref.token_ids, skip_special_tokens=False)
        assert "".join(e.token for e in content) == raw_text


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Water boils at", temperature=0, max_tokens=6, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top, offset, prev in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, [0, *lp.text_offset]
    ):
        assert top[token] == logprob and 2 <= len(top) <= 3
        assert offset >= prev


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "In a quiet village by the sea, " * 8  # several full KV blocks
    usages = []
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        usages.append(r.usage.prompt_tokens_details.cached_tokens)
    assert usages[1] is not None and usages[1] >= 32


def test_api_errors_arrive_as_client_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=3.5)
    assert br.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=0)
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert br.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_request_id_is_echoed_or_made(served: Cluster) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    r = httpx.post(
        f"{served.base_url}/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    r = httpx.post(f"{served.base_url}/v1/completions", json=body)
    assert len(r.headers["x-request-id"]) >= 16
    r = httpx.post(f"{served.base_url}/v1/completions", json={"model": "x", "prompt": "Hi"})
    assert r.status_code == 404 and r.headers["x-request-id"]


F = "diptych_frontend_"


def scrape(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition, keyed ``name`` or ``name{k="v",...}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def assert_completions_observed(
    before: dict[str, float], after: dict[str, float], *, requests: int, prompt: int, output: int
) -> None:
    """``requests`` finished completions, of ``prompt`` and ``output`` tokens in all, are
    what the frontend metrics gained between two scrapes."""

    def gained(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert gained(F + 'requests_total{endpoint="/v1/completions",status="200"}') == requests
    for name in ("time_to_first_token_seconds", "request_duration_seconds"):
        assert gained(f"{F}{name}_count") == requests, name
        assert gained(f"{F}{name}_sum") > 0, name
    # one per output token after a request's first chunk (which holds at least one token)
    assert 0 < gained(F + "inter_token_latency_seconds_count") <= output - requests
    assert gained(F + "inter_token_latency_seconds_sum") > 0
    assert gained(F + "prompt_tokens_total") == prompt
    assert gained(F + "generation_tokens_total") == output
    assert after.get(F + "requests_in_flight") == 0


def test_health_ready_and_metrics(client: openai.OpenAI, served: Cluster) -> None:
    def metrics() -> dict[str, float]:
        return scrape(httpx.get(f"{served.base_url}/metrics").text)

    before = metrics()
    usages = []
    for prompt in ("One, two,", "Red, green,"):
        out = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 6
        usages.append(out.usage)
    assert httpx.get(f"{served.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{served.base_url}/ready").json()["decode_workers"] == 1
    key = F + 'requests_total{endpoint="/v1/completions",status="200"}'
    # the request counter is bumped once the response is sent: wait for it, then compare
    wait_until(lambda: metrics().get(key, 0.0) >= before.get(key, 0.0) + 2, 5, "the count")
    after = metrics()
    assert_completions_observed(
        before,
        after,
        requests=2,
        prompt=sum(u.prompt_tokens for u in usages),
        output=sum(u.completion_tokens for u in usages),
    )
    assert after[F + "decode_workers"] == 1


def test_the_metrics_check_fails_when_nothing_was_observed() -> None:
    """A registry with every series registered but nothing observed exports zeros: the
    check above must not mistake that for served requests."""
    fresh = scrape(generate_latest(FrontendMetrics().registry).decode())
    assert F + "time_to_first_token_seconds_count" in fresh  # the series exist, at zero
    for before in (fresh, {}):
        with pytest.raises(AssertionError):
            assert_completions_observed(before, fresh, requests=2, prompt=6, output=12)

"""Stop strings (also split across tokens) end the output and cancel the worker's
request; a client that disconnects, streaming or not, aborts its request on the worker.
The engine ends idle with consistent block accounting (the ``served`` teardown checks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from engine import CompletionResult, SamplingParams
from tests.frontend.harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Here is a short story about a dragon and a knight:"
Reference = Callable[[str | list[int], SamplingParams], CompletionResult]


def split_stop(served: Cluster, ref: CompletionResult) -> tuple[str, str]:
    """A stop string made of the end of one output token and the start of the next, and
    the text before its first occurrence."""
    tok = served.llm.tokenizer
    pieces = [tok.decode([t]) for t in ref.token_ids]
    text = ref.text
    assert "".join(pieces) == text
    for i in range(6, len(pieces) - 2):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 3 and len(b) >= 3 and a.isascii() and b.isascii():
            stop = a[-2:] + b[:2]
            boundary = len("".join(pieces[: i + 1]))
            if text.find(stop) == boundary - 2:  # its first occurrence spans this boundary
                return stop, text[: boundary - 2]
    raise AssertionError(f"no usable token boundary in {pieces}")


@pytest.fixture
def story(reference: Reference) -> CompletionResult:
    return reference(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens(
    client: openai.OpenAI, served: Cluster, story: CompletionResult, stream: bool
) -> None:
    stop, expected = split_stop(served, story)
    handler = served.workers["w0"].handler
    aborted_before = len(handler.aborted)
    kw = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40, stop=[stop, "@@@@"])
    kw["extra_body"] = {"ignore_eos": True}
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))  # type: ignore[call-overload]
        pieces = [c.choices[0].text for c in chunks]
        text, finish = "".join(pieces), chunks[-1].choices[0].finish_reason
        assert all(stop not in p for p in pieces)
    else:
        r = client.completions.create(**kw)  # type: ignore[call-overload]
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage is not None and r.usage.completion_tokens < 40
    assert text == expected and stop not in text
    assert finish == "stop"
    # The frontend cancelled the rest of the request on the worker.
    wait_until(lambda: len(handler.aborted) > aborted_before, 10, "the worker abort")
    served.assert_engine_clean()


def test_stop_string_in_chat_with_include_stop(client: openai.OpenAI, served: Cluster) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
        stop="Paris",
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content is not None
    assert r.choices[0].message.content.endswith("Paris")
    assert r.choices[0].finish_reason == "stop"


def _long_request(stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 600,  # a minute of decoding here: only an abort ends it early
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_streaming_client_disconnect_aborts_the_request(served: Cluster) -> None:
    handler = served.workers["w0"].handler
    before = len(handler.aborted)
    with httpx.stream(
        "POST", f"{served.base_url}/v1/completions", json=_long_request(True), timeout=60
    ) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines == 3:
                break  # leaving the block closes the connection
    t0 = time.monotonic()
    wait_until(lambda: len(handler.aborted) > before, 10, "the worker abort")
    served.assert_engine_clean(timeout=10)
    assert time.monotonic() - t0 < 10
    metrics = httpx.get(f"{served.base_url}/metrics").text
    assert "diptych_frontend_client_disconnects_total 0.0" not in metrics


def test_non_streaming_client_disconnect_aborts_the_request(served: Cluster) -> None:
    handler = served.workers["w0"].handler
    before = len(handler.aborted)
    started = len(handler.started)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            httpx.post(f"{served.base_url}/v1/completions", json=_long_request(False), timeout=2)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: len(handler.started) > started, 10, "the request to reach the worker")
    t.join(10)
    assert errors and isinstance(errors[0], httpx.ReadTimeout)  # the client gave up
    wait_until(lambda: len(handler.aborted) > before, 10, "the worker abort")
    served.assert_engine_clean(timeout=10)

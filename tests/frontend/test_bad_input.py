"""Bad requests get a 4xx with an OpenAI error body naming the problem, and the server
keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN
from tests.frontend.harness import Cluster

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


def compl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}


LONG_PROMPT = "word " * (MAX_MODEL_LEN + 10)

# (path, body (bytes are sent as is), status, param or None, text in the message)
HUGE_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**9}}}
CASES: list[tuple[str, Any, int, str | None, str]] = [
    (CHAT, b'{"model": "x", "messages": [', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, b"", 400, None, "not valid JSON"),
    (CHAT, {"messages": MSGS}, 400, "model", "required"),
    (CHAT, {"model": MODEL}, 400, "messages", "required"),
    (CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", ""),
    (CHAT, chat(messages="hello"), 400, "messages", ""),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", ""),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages",
        "text only",
    ),
    (CHAT, chat(model="gpt-4"), 404, "model", "does not exist"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "number"),
    (CHAT, chat(temperature=2.5), 400, "temperature", "less than or equal"),
    (CHAT, chat(top_p=1.5), 400, "top_p", ""),
    (CHAT, chat(top_k=-2), 400, "top_k", ""),
    (CHAT, chat(min_p=-0.1), 400, "min_p", ""),
    (CHAT, chat(presence_penalty=3), 400, "presence_penalty", ""),
    (CHAT, chat(frequency_penalty=-2.5), 400, "frequency_penalty", ""),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", ""),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", ""),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens", "integer"),
    (CHAT, chat(max_tokens=True), 400, "max_tokens", "integer"),
    (CHAT, chat(max_tokens=10**12), 400, "max_tokens", ""),
    (CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", "maximum context length"),
    (CHAT, chat(max_completion_tokens=5000), 400, "max_completion_tokens", "context length"),
    (CHAT, chat(n=0), 400, "n", "greater than or equal"),
    (CHAT, chat(n=129), 400, "n", ""),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs", "requires logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", ""),
    (CHAT, chat(stop=7), 400, "stop", "string or a list"),
    (CHAT, chat(stop_token_ids=[10**7]), 400, "stop_token_ids", "must be in"),
    (CHAT, chat(logit_bias={"x": 10}), 400, "logit_bias", "token ids"),
    (CHAT, chat(logit_bias={"50": 101}), 400, "logit_bias", "[-100, 100]"),
    (CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias", "token ids in"),
    (CHAT, chat(seed="x"), 400, "seed", ""),
    (CHAT, chat(stream="yes"), 400, "stream", ""),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", "stream=true"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", "not supported"),
    (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema", ""),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
        400,
        "response_format.json_schema.schema",
        "cannot be compiled",
    ),
    (CHAT, chat(structured_outputs={"regex": "(("}), 400, "structured_outputs.regex", "compiled"),
    (CHAT, chat(structured_outputs={"xml": "a"}), 400, "structured_outputs.xml", "not supported"),
    # compiles, then blew up the lexer a few tokens in: refused by its repeat counts
    (CHAT, chat(guided_regex="(x{1000}){1000}"), 400, "guided_regex", "over the limit of 10000"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": HUGE_SCHEMA}}),
        400,
        "response_format.json_schema.schema",
        "maxLength 1e+09 is over the limit",
    ),
    (CHAT, chat(guided_choice=[]), 400, "guided_choice", "list of 1"),
    (CHAT, chat(guided_regex="a", guided_choice=["a"]), 400, "guided_choice", "at most one"),
    (COMPL, compl(guided_grammar="start: ("), 400, "guided_grammar", "compiled"),
    (COMPL, compl(guided_json="{not json"), 400, "guided_json", "not valid JSON"),
    (CHAT, chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "messages", "context"),
    (COMPL, compl(prompt=LONG_PROMPT), 400, "prompt", "maximum context length"),
    (COMPL, compl(prompt=""), 400, "prompt", "empty"),
    (COMPL, compl(prompt=[]), 400, "prompt", "empty"),
    (COMPL, compl(prompt=["a", "b"]), 400, "prompt", "batch"),
    (COMPL, compl(prompt=[1, -5]), 400, "prompt", ""),
    (COMPL, compl(prompt=[1, 10**8]), 400, "prompt", "token ids must be in"),
    (COMPL, compl(prompt={"text": "x"}), 400, "prompt", "string or a list of token ids"),
    (COMPL, compl(best_of=2), 400, "best_of", "not supported"),
    (COMPL, compl(suffix="end"), 400, "suffix", "not supported"),
    (COMPL, compl(echo=True, logprobs=1), 400, "echo", "not supported"),
    (COMPL, compl(logprobs=50), 400, "logprobs", ""),
    (COMPL, compl(model="nope"), 404, "model", "does not exist"),
]


@pytest.mark.parametrize(
    "path,body,status,param,text", CASES, ids=[f"{i}-{c[0][4:8]}" for i, c in enumerate(CASES)]
)
def test_bad_request(
    served: Cluster, path: str, body: Any, status: int, param: str | None, text: str
) -> None:
    url = served.base_url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert text in error["message"], error


def test_routes_and_sizes(served: Cluster) -> None:
    r = httpx.get(f"{served.base_url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{served.base_url}/v1/chat/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    huge = b'{"model": "m", "prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = httpx.post(f"{served.base_url}/v1/completions", content=huge, timeout=60)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_unknown_fields_are_ignored_and_server_still_serves(served: Cluster) -> None:
    body = chat(temperature=0, frobnicate=True, metadata={"a": "b"}, store=False, user="me")
    r = httpx.post(served.base_url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]

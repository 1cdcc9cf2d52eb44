"""A reasoning model served by `diptych serve` on real processes, through the official
openai client: a tiny random Qwen3 (fp32, greedy) with a Qwen3-style chat template, one
prefill worker and two decode workers; prompts under 48 tokens are prefilled by their
decode worker (aggregated), longer ones by the prefill worker (disaggregated) unless
the decode worker caches them.

- for thinking budgets 0 / 16 / 128, streamed and not, aggregated and disaggregated:
  the reasoning tokens (usage) are at most the budget plus the end marker, thinking
  comes back as ``reasoning_content`` and an answer follows as ``content``; streamed
  and whole outputs agree;
- the Responses API returns a reasoning item, the answer, and the count, with
  ``reasoning.effort`` mapped by ``--reasoning-budget-low``;
- ``tool_choice: required`` constrains the answer after the thinking: a tool call;
- streams thinking on a decode worker that is SIGKILLed migrate, and their budget holds;
- one API key may have one long-thinking request in flight (429 for a second, while
  another key's goes through).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.serving import Server, kill_a_busy_worker, scrape
from tests.tiny_qwen3 import tiny_qwen3

pytestmark = pytest.mark.slow

SHORT = "What is 2 + 2?"
LONG = "Think about this carefully. " * 12 + "What is 2 + 2?"  # over 48 tokens
END = 1  # Qwen3's </think> is one token
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            # bounded values: a random model would write an integer forever
            "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    server = Server(
        tmp_path_factory.mktemp("reasoning"),
        "--model", str(model), "--dtype", "float32", "--prefill-workers", "1",
        "--decode-workers", "2", "--min-remote-prefill-tokens", "48",
        "--reasoning-budget-low", "16", "--api-key", "k1", "--api-key", "k2",
        "--max-long-thinking-per-key", "1",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def _client(fleet: Server, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0)


def _chat(client: openai.OpenAI, prompt: str, budget: int, stream: bool) -> tuple[str, str, int]:
    """(reasoning_content, content, usage's reasoning tokens) of one greedy chat."""
    kwargs: dict[str, Any] = dict(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": prompt}],
        max_tokens=budget + 24, temperature=0, extra_body={"max_reasoning_tokens": budget},
    )  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        assert r.usage is not None and r.usage.completion_tokens_details is not None
        reasoning = r.usage.completion_tokens_details.reasoning_tokens or 0
        return getattr(msg, "reasoning_content", None) or "", msg.content or "", reasoning
    thought, said, used = "", "", -1
    chunks = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            said += delta.content or ""
        if chunk.usage is not None and chunk.usage.completion_tokens_details is not None:
            used = chunk.usage.completion_tokens_details.reasoning_tokens or 0
    return thought, said, used


@pytest.mark.parametrize("budget", [0, 16, 128])
def test_the_budget_holds_streamed_and_not_aggregated_and_disaggregated(
    fleet: Server, budget: int
) -> None:
    client = _client(fleet)
    decode = ["decode-0", "decode-1"]
    before = sum(fleet.metrics(w).get('diptych_worker_requests_total{prefill="remote"}', 0)
                 for w in decode)  # fmt: skip
    for prompt in (SHORT, f"Case {budget}. {LONG}"):  # a fresh long prompt: not cached
        whole = _chat(client, prompt, budget, stream=False)
        streamed = _chat(client, prompt, budget, stream=True)
        assert streamed == whole, prompt
        thought, said, used = whole
        assert (END if budget == 0 else 2) <= used <= budget + END, used
        assert said.strip(), "an answer follows the thinking"
        assert bool(thought) == (budget > 0)
    after = sum(fleet.metrics(w).get('diptych_worker_requests_total{prefill="remote"}', 0)
                for w in decode)  # fmt: skip
    assert after - before == 1  # the long prompt's first time (then it is cached)
    counted = scrape(fleet.url)
    keyed = [k for k in counted if k.startswith("diptych_frontend_reasoning_tokens_total{")]
    assert len(keyed) == 1 and counted[keyed[0]] > 0 and "k1" not in keyed[0]  # a digest


def test_the_responses_api_returns_a_reasoning_item(fleet: Server) -> None:
    client = _client(fleet)
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input=SHORT, reasoning={"effort": "low"},
                                max_output_tokens=48, temperature=0)  # fmt: skip
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    assert r.output[0].content and r.output[0].content[0].text  # type: ignore[union-attr]
    assert r.output_text.strip()
    assert r.usage is not None and 2 <= r.usage.output_tokens_details.reasoning_tokens <= 17
    events = list(client.responses.create(model=model, input=SHORT, reasoning={"effort": "low"},
                                          max_output_tokens=48, temperature=0, stream=True))
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    done = events[-1]  # incomplete: the answer ran to max_output_tokens
    assert done.type == f"response.{r.status}"
    assert [i.type for i in done.response.output] == kinds  # type: ignore[union-attr]
    assert done.response.output_text == r.output_text  # type: ignore[union-attr]


def test_a_required_tool_call_follows_the_thinking(fleet: Server) -> None:
    client = _client(fleet)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Add 2 and 2."}], tools=[TOOL],
        tool_choice="required", temperature=0, max_tokens=200,
        extra_body={"max_reasoning_tokens": 16},
    )  # fmt: skip
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None)
    assert msg.tool_calls and msg.tool_calls[0].function.name == "add"
    assert r.choices[0].finish_reason == "tool_calls"


def test_thinking_streams_on_a_killed_decode_worker_keep_their_budget(fleet: Server) -> None:
    client = _client(fleet)
    budget, n = 400, 4
    prompts = [f"Count the sheep in field number {i}, one by one." for i in range(n)]
    progress = [0] * n
    results: list[tuple[str, str, int] | BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = _counted_stream(client, prompts[i], budget, progress, i)
        except BaseException as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while min(progress) < 20 and time.monotonic() < end:  # every stream thinking
        time.sleep(0.01)
    assert min(progress) >= 20, progress
    kill_a_busy_worker(fleet, ["decode-0", "decode-1"])
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    for r in results:
        assert isinstance(r, tuple), r
        thought, said, used = r
        assert thought and said.strip()
        assert used <= budget + END, used
    migrations = scrape(fleet.url).get(
        'diptych_frontend_failovers_total{kind="migration"}', 0
    )
    assert migrations >= 1


def _counted_stream(client: openai.OpenAI, prompt: str, budget: int, progress: list[int],
                    i: int) -> tuple[str, str, int]:  # fmt: skip
    thought, said, used = "", "", -1
    chunks = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": prompt}],
        max_tokens=budget + 24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"max_reasoning_tokens": budget},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            said += delta.content or ""
            progress[i] += 1
        if chunk.usage is not None and chunk.usage.completion_tokens_details is not None:
            used = chunk.usage.completion_tokens_details.reasoning_tokens or 0
    return thought, said, used


def _long_stream(fleet: Server, key: str) -> Any:
    """A long-thinking stream of `key`, in flight (its first chunk read)."""
    client = _client(fleet, key)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Think long."}], max_tokens=2100,
        temperature=0, stream=True, extra_body={"max_reasoning_tokens": 2000},
    )  # fmt: skip
    next(iter(stream))
    return stream


def test_long_thinking_requests_are_capped_per_key(fleet: Server) -> None:
    first = _long_stream(fleet, "k1")
    try:
        with pytest.raises(openai.RateLimitError, match="long-thinking"):
            _long_stream(fleet, "k1")
        _, said, used = _chat(_client(fleet, "k1"), SHORT, 16, stream=False)
        assert said.strip() and used <= 17  # not a long one: no cap
        _long_stream(fleet, "k2").close()  # another key's goes through
    finally:
        first.close()
    deadline = time.monotonic() + 30
    while True:  # the slot comes back when the first stream is closed
        try:
            _long_stream(fleet, "k1").close()
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)

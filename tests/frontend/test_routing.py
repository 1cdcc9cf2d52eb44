"""Several decode workers: least-loaded spread, retry before the first token, migration
of a stream whose worker dies, clear errors when no worker is left, /ready following
registrations."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine import CompletionResult, SamplingParams
from frontend.config import FrontendConfig
from frontend.router import LeastLoadedRouter, RouteRequest, WorkerView
from frontend.server import serve_frontend
from tests.frontend.conftest import MAX_MODEL_LEN, openai_client
from tests.frontend.harness import Cluster, LoopThread, free_port, wait_until

MODEL = "SmolLM2-135M-Instruct"
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a short story about a lighthouse keeper."}
]
Reference = Callable[[str | list[int], SamplingParams], CompletionResult]


class FirstTry(LeastLoadedRouter):
    """Sends every first attempt to ``worker_id``; retries and migrations go least-loaded."""

    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id
        self.attempts: list[tuple[int, str]] = []

    def select(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> str:
        ids = [c.worker_id for c in candidates]
        chosen = self.worker_id if request.attempt == 0 and self.worker_id in ids else None
        chosen = chosen or super().select(request, candidates)
        self.attempts.append((request.attempt, chosen))
        return chosen


def metric(c: Cluster, line_prefix: str) -> float:
    for line in httpx.get(f"{c.base_url}/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_least_loaded_spreads_concurrent_requests(cluster: Cluster) -> None:
    for wid in ("w1", "w2"):
        cluster.add_worker(wid)
    cluster.start_frontend()
    cluster.wait_ready(2)
    client = openai_client(cluster)
    results: list[str] = []

    def one(i: int) -> None:
        r = client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        results.append(r.choices[0].text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4
    assert [len(cluster.workers[w].handler.started) for w in ("w1", "w2")] == [2, 2]
    # The pool follows each worker's Events stream: load reports arrived, and are idle now.
    assert cluster.frontend is not None
    pool = cluster.frontend.app.state.frontend.pool
    wait_until(
        lambda: all(v.load is not None and v.load.running_requests == 0 for v in pool.views()),
        10,
        "idle load reports from both workers",
    )


def test_killed_worker_mid_stream_is_migrated(cluster: Cluster, reference: Reference) -> None:
    ids = cluster.llm.tokenizer.apply_chat_template(STORY)
    ref = reference(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    for wid in ("w1", "w2"):
        cluster.add_worker(wid)
    router = FirstTry("w1")
    cluster.start_frontend(router=router)
    cluster.wait_ready(2)
    stream = openai_client(cluster).chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, finish, usage, contents, killed = "", None, None, 0, False
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        contents += bool(chunk.choices[0].delta.content)
        if contents == 5 and not killed:
            cluster.kill_worker("w1")  # mid-stream: its gRPC stream fails UNAVAILABLE
            killed = True
    assert text == ref.text  # one uninterrupted stream, as if nothing happened
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 48
    assert usage.prompt_tokens == len(ids)
    assert [w for _, w in router.attempts] == ["w1", "w2"]
    w2_requests = cluster.workers["w2"].handler.started
    assert len(w2_requests) == 1 and w2_requests[0].endswith("~1")
    assert metric(cluster, 'diptych_frontend_failovers_total{kind="migration"}') == 1

    # The dead worker is still registered (its lease has not expired): later requests
    # avoid it rather than fail.
    r = openai_client(cluster).chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=4
    )
    assert r.choices[0].message.content


def test_retry_before_the_first_token(cluster: Cluster) -> None:
    cluster.register_dead_worker("dead")  # a crashed worker's record: nothing listens
    cluster.add_worker("w1")
    router = FirstTry("dead")
    cluster.start_frontend(router=router)
    cluster.wait_ready(2)
    r = openai_client(cluster).completions.create(
        model=MODEL, prompt="The sky is", temperature=0, max_tokens=4
    )
    assert r.choices[0].text
    assert router.attempts == [(0, "dead"), (1, "w1")]
    assert metric(cluster, 'diptych_frontend_failovers_total{kind="retry"}') == 1


def test_no_worker_left_ends_with_a_clear_error(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.start_frontend()
    cluster.wait_ready(1)
    client = openai_client(cluster)
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen = 0
    with pytest.raises(openai.APIError, match="decode worker"):
        for _ in stream:
            seen += 1
            if seen == 3:
                cluster.kill_worker("w1")
    # Not streamed: an HTTP 503 (the client raises InternalServerError for 5xx).
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert e.value.status_code == 503
    assert metric(cluster, "diptych_frontend_stream_errors_total") == 1


def test_ready_follows_registrations(cluster: Cluster) -> None:
    cluster.start_frontend()
    assert httpx.get(f"{cluster.base_url}/health").status_code == 200
    r = httpx.get(f"{cluster.base_url}/ready")
    assert r.status_code == 503 and r.json()["decode_workers"] == 0
    with pytest.raises(openai.InternalServerError) as e:
        openai_client(cluster).chat.completions.create(model=MODEL, messages=STORY, max_tokens=4)
    assert e.value.status_code == 503 and "no decode worker" in str(e.value)

    cluster.add_worker("w1")
    cluster.wait_ready(1)
    cluster.add_worker("w2")
    cluster.wait_ready(2)
    cluster.unregister("w1")
    wait_until(lambda: cluster.ready_workers() == 1, 10, "w1 to leave")
    cluster.unregister("w2")
    wait_until(lambda: httpx.get(f"{cluster.base_url}/ready").status_code == 503, 10, "not ready")


def test_request_timeout_is_a_504_and_frees_the_worker(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.start_frontend(request_timeout_s=1.0)
    cluster.wait_ready(1)
    with pytest.raises(openai.InternalServerError) as e:
        openai_client(cluster).completions.create(
            model=MODEL, prompt="Count:", max_tokens=500, extra_body={"ignore_eos": True}
        )
    assert e.value.status_code == 504
    cluster.assert_engine_clean()


def test_worker_refusal_is_a_400(cluster: Cluster) -> None:
    """Without a context window from discovery or config, the worker's own check is
    the one that refuses a long prompt; its INVALID_ARGUMENT becomes a 400."""
    cluster.add_worker("w1", max_model_len=None)
    cluster.start_frontend()
    cluster.wait_ready(1)
    with pytest.raises(openai.BadRequestError, match="context window"):
        openai_client(cluster).completions.create(
            model=MODEL, prompt=[100] * (MAX_MODEL_LEN + 5), max_tokens=4
        )


def test_worker_failure_is_a_500_and_the_server_goes_on(cluster: Cluster) -> None:
    worker = cluster.add_worker("w1")
    cluster.start_frontend()
    cluster.wait_ready(1)
    client = openai_client(cluster)
    worker.handler.fail = RuntimeError("boom")
    with pytest.raises(openai.InternalServerError, match="boom") as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert e.value.status_code == 500
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "server_error"
    worker.handler.fail = None
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=4).choices[0].text


def test_serve_frontend_runs_until_cancelled(loop: LoopThread, tmp_path: Path) -> None:
    """The CLI's path: the app builds its own tokenizer and discovery client."""
    port = free_port()
    config = FrontendConfig(
        discovery_url=f"embedded:{tmp_path}", host="127.0.0.1", port=port, log_level="warning"
    )
    running = loop.submit(serve_frontend(config))
    url = f"http://127.0.0.1:{port}"

    def health() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(health, 60, "the frontend to serve")
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
    running.cancel()
    wait_until(lambda: not health(), 20, "the frontend to stop")


def test_a_pool_at_zero_holds_requests_until_a_worker_joins(cluster: Cluster) -> None:
    """Scale to zero: with --hold-for-workers the frontend stays ready, holds requests
    (counted in diptych_frontend_requests_held, what the planner scales up on) until a
    decode worker joins, then serves them; past the bound or the hold, a 503."""
    cluster.start_frontend(hold_for_workers_s=30.0, max_held=2)
    r = httpx.get(f"{cluster.base_url}/ready")
    assert r.status_code == 200 and r.json()["decode_workers"] == 0
    client = openai_client(cluster)
    results: list[str] = []

    def ask() -> None:
        out = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4,
                                             temperature=0)  # fmt: skip
        results.append(out.choices[0].finish_reason)

    held = [threading.Thread(target=ask) for _ in range(2)]
    for t in held:
        t.start()
    wait_until(lambda: metric(cluster, "diptych_frontend_requests_held") == 2, 10, "2 held")
    with pytest.raises(openai.InternalServerError, match="already wait") as e:  # the bound
        client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4)
    assert e.value.status_code == 503
    cluster.add_worker("w1")
    for t in held:
        t.join(60)
    assert results == ["length", "length"]
    assert metric(cluster, "diptych_frontend_requests_held") == 0


def test_a_hold_that_no_worker_ends_is_a_503(cluster: Cluster) -> None:
    cluster.start_frontend(hold_for_workers_s=0.5)
    with pytest.raises(openai.InternalServerError, match=r"joined within 0\.5 s") as e:
        openai_client(cluster).chat.completions.create(model=MODEL, messages=STORY, max_tokens=4)
    assert e.value.status_code == 503

"""The frontend's edge: API keys (401 with the OpenAI error body, probes left open),
load shedding (429 with Retry-After when every worker's queue is full, batch first),
a worker's own refusal becoming a 429, and HTTPS."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from frontend.auth import ApiKeys, bearer_token, collect_api_keys
from frontend.config import AdmissionConfig
from frontend.errors import Overloaded
from frontend.router import WorkerView
from frontend.workers import check_admission, priority_class, queued
from runtime.rpc import ErrorCode, GenerateError, LoadReport
from runtime.worker_info import KvLayout, WorkerInfo
from tests.frontend.conftest import openai_client
from tests.frontend.harness import Cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"


# -- pure parts ------------------------------------------------------------------------------
def test_keys_are_collected_from_flags_files_and_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n  beta  \nalpha\n")
    assert collect_api_keys(["flag"], [str(f)], "gamma, delta,") == (
        "flag", "alpha", "beta", "gamma", "delta",
    )  # fmt: skip
    with pytest.raises(ValueError, match="printable"):
        collect_api_keys(["two words"])
    with pytest.raises(ValueError, match="cannot read"):
        collect_api_keys(files=[str(tmp_path / "missing")])
    keys = ApiKeys(["alpha", "beta"])
    assert keys.accepts(b"beta") and not keys.accepts(b"bet") and not keys.accepts(b"")
    assert bearer_token(b"Bearer  beta ") == b"beta"
    assert bearer_token(b"Basic beta") is None and bearer_token(b"Bearer") is None


def _view(
    wid: str,
    in_flight: int = 0,
    max_running: int | None = None,
    max_queued: int | None = None,
    **load: int,
) -> WorkerView:
    layout = KvLayout(
        num_blocks=100, num_layers=2, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32"
    )
    info = WorkerInfo(worker_id=wid, role="decode", incarnation_id="i", model="m",
                      grpc_address="127.0.0.1:1", kv_layout=layout, max_running=max_running,
                      max_queued=max_queued)  # fmt: skip
    return WorkerView(wid, info, in_flight, LoadReport(**load) if load else None)


def test_the_pool_is_saturated_only_when_every_worker_queue_is_full() -> None:
    config = AdmissionConfig(max_queued_per_worker=4, batch_share=0.5)
    full = _view("a", running_requests=8, active_requests=12)
    assert queued(full) == 4
    assert queued(_view("b", in_flight=3)) == 3  # no report yet: this frontend's own
    assert queued(_view("c", 6, running_requests=2, waiting_requests=1)) == 4  # sent since
    half = _view("d", running_requests=8, active_requests=10)
    check_admission(config, [full, half], 0, "interactive")  # d has room
    check_admission(config, [], 0, "interactive")  # no worker: a 503 elsewhere, not a 429
    with pytest.raises(Overloaded) as e:
        check_admission(config, [full, full], 0, "interactive")
    assert e.value.status_code == 429 and e.value.headers() == {"Retry-After": "1"}
    with pytest.raises(Overloaded, match="batch requests are refused from 2"):
        check_admission(config, [full, half], 0, "batch")
    check_admission(config, [full, _view("e", running_requests=8, active_requests=9)], 0, "batch")
    with pytest.raises(Overloaded, match="limit of 3"):
        check_admission(AdmissionConfig(max_in_flight=3), [half], 3, "interactive")
    check_admission(AdmissionConfig(max_queued_per_worker=None), [full, full], 99, "batch")
    assert priority_class(None, 0) == "interactive" and priority_class(None, 5) == "batch"
    assert priority_class(" Batch ", -3) == "batch"
    assert priority_class("interactive", 9) == "interactive"
    with pytest.raises(ValueError, match="X-Priority"):
        priority_class("urgent", 0)


def test_a_burst_is_shed_by_the_places_left_under_the_workers_own_bounds() -> None:
    """Default config: each worker's stated bound. A worker that states it runs 8 at once
    and queues 4 takes 12 of a burst before any report; requests admitted and not yet on
    a worker (being tokenized) count against those places."""
    config = AdmissionConfig()
    idle = _view("a", max_running=8, max_queued=4)
    assert queued(idle) == 0 and queued(_view("b", 10, max_running=8)) == 2
    busy = _view("c", 3, max_running=8, running_requests=8, waiting_requests=2)
    assert queued(busy) == 2  # its report shows it full: its slots are what it runs
    check_admission(config, [idle], 11, "interactive", unplaced=11)
    with pytest.raises(Overloaded):
        check_admission(config, [idle], 12, "interactive", unplaced=12)
    check_admission(config, [idle, _view("d", max_running=8, max_queued=4)], 12, "interactive", 12)
    with pytest.raises(Overloaded):
        check_admission(config, [_view("e", 12, max_running=8, max_queued=4)], 12, "interactive")
    check_admission(AdmissionConfig(max_queued_per_worker=0), [busy], 99, "batch", 99)
    check_admission(config, [idle, _view("f")], 99, "batch", 99)  # f states no bound


# -- served ----------------------------------------------------------------------------------
def test_api_keys_guard_the_api_and_leave_the_probes_open(cluster: Cluster) -> None:
    cluster.add_worker("w1")
    cluster.start_frontend(api_keys=("k-one", "k-two"))
    cluster.wait_ready(1)
    url = cluster.base_url
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + path, timeout=10).status_code == 200, path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"}):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.headers["x-request-id"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=10)
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="k-two", max_retries=0, timeout=60)
    out = good.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 3
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'diptych_frontend_requests_total{endpoint="/v1/models",status="401"} 4.0' in metrics
    assert "k-one" not in metrics and "k-two" not in metrics


def _report(cluster: Cluster, wid: str, load: LoadReport) -> None:
    async def go() -> None:
        cluster.workers[wid].handler.publisher.update_load(load)

    cluster.loop.run(go())

    def seen() -> bool:
        assert cluster.frontend is not None
        views = cluster.frontend.app.state.frontend.pool.views()
        return any(v.worker_id == wid and v.load == load for v in views)

    wait_until(seen, 10, f"{wid}'s load report at the frontend")


def test_a_saturated_pool_sheds_batch_first_then_everything(cluster: Cluster) -> None:
    for wid in ("w1", "w2"):
        cluster.add_worker(wid)
    cluster.start_frontend(
        admission=AdmissionConfig(max_queued_per_worker=8, batch_share=0.5, retry_after_s=2.5)
    )
    cluster.wait_ready(2)
    client = openai_client(cluster)
    url = cluster.base_url
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    batch = {"X-Priority": "batch"}
    for wid in ("w1", "w2"):  # 5 queued on each: batch is refused from 4, interactive at 8
        _report(cluster, wid, LoadReport(running_requests=4, active_requests=9))
    r = httpx.post(url + "/v1/completions", json=body, headers=batch, timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    r = httpx.post(url + "/v1/completions", json={**body, "priority": 1}, timeout=30)
    assert r.status_code == 429  # a body priority above 0 is batch too
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Priority": "x"}, timeout=30)
    assert r.status_code == 400

    # (a request served resets the stand-in worker's report: set both after the last)
    _report(cluster, "w1", LoadReport(running_requests=4, active_requests=12))
    _report(cluster, "w2", LoadReport(running_requests=4, active_requests=20))
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
    assert e.value.response.headers["retry-after"] == "3"

    for wid in ("w1", "w2"):  # the queues drain: everything is admitted again
        _report(cluster, wid, LoadReport(running_requests=1, active_requests=1))
    r = httpx.post(url + "/v1/completions", json=body, headers=batch, timeout=30)
    assert r.status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'diptych_frontend_requests_shed_total{priority_class="batch"} 2.0' in metrics
    assert 'diptych_frontend_requests_shed_total{priority_class="interactive"} 1.0' in metrics


def test_workers_refusing_for_a_full_queue_become_a_429(cluster: Cluster) -> None:
    for wid in ("w1", "w2"):
        worker = cluster.add_worker(wid)
        worker.handler.fail = GenerateError(ErrorCode.RESOURCE_EXHAUSTED, "queue full")
    cluster.start_frontend()
    cluster.wait_ready(2)
    with pytest.raises(openai.RateLimitError, match="full") as e:
        openai_client(cluster).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert sorted(len(w.handler.started) for w in cluster.workers.values()) == [0, 0]
    cluster.workers["w2"].handler.fail = None
    out = openai_client(cluster).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None


def test_the_api_over_https(cluster: Cluster, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    cluster.add_worker("w1")
    cluster.start_frontend(tls_certfile=str(cert), tls_keyfile=str(key))
    assert cluster.frontend is not None
    url = f"https://{cluster.frontend.address}"
    trust = ssl.create_default_context(cafile=str(cert))
    wait_until(
        lambda: httpx.get(url + "/ready", verify=trust, timeout=5).status_code == 200,
        10, "ready over https",
    )  # fmt: skip
    client = openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=60,
        http_client=httpx.Client(verify=trust),
    )  # fmt: skip
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    with pytest.raises(httpx.HTTPError):  # plain http to the https port
        httpx.get(f"http://{cluster.frontend.address}/health", timeout=5)
    # an idle TLS connection left open holds the server's stop for its TLS shutdown
    # (bounded by the drain timeout); close it, as a client that is done would
    client.close()


def test_a_stopping_frontend_refuses_new_connections_and_finishes_its_streams(
    cluster: Cluster,
) -> None:
    """SIGTERM's path (`FrontendServer.stop`): the listening socket closes at once, a
    stream in flight runs to its end within the drain timeout, and one that would
    outlast it is cut when it expires."""
    import threading
    import time

    worker = cluster.add_worker("w1")
    worker.handler.delay_s = 0.1  # a slow worker: a long stream

    def drain(timeout: float, under_way: int) -> tuple[list[str | None], list[int], float, float]:
        cluster.start_frontend(drain_timeout_s=timeout)
        cluster.wait_ready(1)
        url = cluster.base_url
        finish: list[str | None] = []
        tokens: list[int] = []
        chunks = [0]
        ended = [0.0]

        def stream() -> None:
            try:
                s = openai_client(cluster).completions.create(
                    model=MODEL, prompt="Once upon a time", max_tokens=64, stream=True,
                    extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                )  # fmt: skip
                for chunk in s:
                    if chunk.usage is not None:
                        tokens.append(chunk.usage.completion_tokens)
                    for c in chunk.choices:
                        chunks[0] += 1
                        if c.finish_reason:
                            finish.append(c.finish_reason)
            except (openai.APIError, httpx.HTTPError):
                pass  # cut
            ended[0] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: chunks[0] >= under_way, 30, "the stream under way")
        frontend = cluster.frontend
        assert frontend is not None
        stopping = threading.Thread(target=lambda: cluster.loop.run(frontend.stop()))
        stopping.start()
        wait_until(lambda: _refused(url), 5, "new connections refused")
        t.join(60)
        stopping.join(60)
        cluster.frontend = None
        return finish, tokens, ended[0], time.monotonic()

    finish, tokens, stream_end, stop_end = drain(30.0, 3)
    assert finish == ["length"] and tokens == [64]  # whole, although the server stopped
    assert stop_end >= stream_end
    worker.handler.delay_s = 5.0  # the next chunk comes after the drain timeout
    finish, tokens, _, _ = drain(1.0, 1)
    assert finish == [] and tokens == []  # cut at the drain timeout


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False

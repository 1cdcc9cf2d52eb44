"""Backend URLs, factories and the metrics helpers."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from runtime.config import RuntimeConfig, make_discovery, make_prefill_queue, parse_url
from runtime.discovery import DiscoveryOptions, EmbeddedDiscovery, EtcdDiscovery
from runtime.errors import BackendUnavailable, ConfigError
from runtime.metrics import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    histogram,
    metric_name,
    new_registry,
    serve_metrics,
)
from runtime.queue import EmbeddedPrefillQueue, JetStreamPrefillQueue, QueueOptions


def test_parse_urls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert parse_url("etcd://a:1,b").endpoints == (("a", 1), ("b", 2379))
    assert parse_url("nats://[::1]:4223").endpoints == (("::1", 4223),)
    assert parse_url("embedded:/x/y").state_dir == Path("/x/y")
    assert parse_url("embedded:///x/y").state_dir == Path("/x/y")
    monkeypatch.setenv("DIPTYCH_STATE_DIR", str(tmp_path))
    assert parse_url("embedded").state_dir == tmp_path
    assert str(parse_url("etcd://h:5")) == "etcd://h:5"
    # credentials and TLS, never printed
    u = parse_url("nats://alice:s%40cret@a,b:5")
    assert (u.auth.user, u.auth.password, u.auth.tls) == ("alice", "s@cret", False)
    assert u.endpoints == (("a", 4222), ("b", 5)) and str(u) == "nats://alice:***@a:4222,b:5"
    t = parse_url("nats://tok@h")
    assert t.auth.token == "tok" and t.auth.user is None and str(t) == "nats://***@h:4222"
    assert parse_url("tls://h").auth.tls and str(parse_url("tls://h")) == "tls://h:4222"
    e = parse_url("etcds://root:pw@h?ca=/etc/hosts")
    assert e.scheme == "etcd" and e.auth.tls and e.auth.ca_file == "/etc/hosts"
    assert str(e) == "etcds://root:***@h:2379?ca=%2Fetc%2Fhosts"
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    assert parse_url(f"etcd://root@h?password_file={pw}").auth.password == "from-file"


@pytest.mark.parametrize(
    "url",
    ["", "redis://x", "etcd://", "etcd://h:0", "etcd://h:99999", "etcd://u@h", "etcd//h",
     "nats://h?bogus=1", "nats://:pw@h", "etcd://h?ca=/no/such/file", "nats://h?cert=/etc/hosts"],
)  # fmt: skip
def test_bad_urls_are_explained(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)


def test_factories_pick_the_backend(tmp_path: Path) -> None:
    assert isinstance(make_discovery("etcd://h:1"), EtcdDiscovery)
    assert isinstance(make_discovery(f"embedded:{tmp_path}"), EmbeddedDiscovery)
    assert isinstance(make_prefill_queue("nats://h"), JetStreamPrefillQueue)
    assert isinstance(make_prefill_queue(f"embedded:{tmp_path}"), EmbeddedPrefillQueue)
    with pytest.raises(ConfigError, match="not a discovery backend"):
        make_discovery("nats://h")
    with pytest.raises(ConfigError, match="not a queue backend"):
        make_prefill_queue("etcd://h")


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="ttl"):
        DiscoveryOptions(ttl=0.5)
    with pytest.raises(ConfigError, match="keepalive_interval"):
        DiscoveryOptions(ttl=5, keepalive_interval=6)
    with pytest.raises(ConfigError, match="max_deliveries"):
        QueueOptions(max_deliveries=0)
    with pytest.raises(ConfigError, match="done_ttl"):
        QueueOptions(ack_wait=100, done_ttl=200)


def test_runtime_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIPTYCH_DISCOVERY_URL", "etcd://e:1")
    monkeypatch.setenv("DIPTYCH_QUEUE_URL", "nats://n:2")
    monkeypatch.setenv("DIPTYCH_NAMESPACE", "prod")
    cfg = RuntimeConfig.from_env()
    assert (cfg.discovery_url, cfg.queue_url, cfg.namespace) == ("etcd://e:1", "nats://n:2", "prod")
    d = cfg.discovery(ttl=4.0)
    assert isinstance(d, EtcdDiscovery) and d.namespace == "prod" and d.options.ttl == 4.0
    q = cfg.prefill_queue(ack_wait=3.0)
    assert isinstance(q, JetStreamPrefillQueue) and q.namespace == "prod"


async def test_unreachable_servers_fail_fast_with_a_clear_error() -> None:
    from tests.runtime.rt_helpers import free_port

    port = free_port()
    d = make_discovery(f"etcd://127.0.0.1:{port}", DiscoveryOptions(op_timeout=1.0))
    with pytest.raises(BackendUnavailable, match="cannot reach etcd"):
        await d.connect()
    q = make_prefill_queue(f"nats://127.0.0.1:{port}", QueueOptions(publish_timeout=1.0))
    with pytest.raises(BackendUnavailable, match="cannot reach NATS"):
        await q.connect()


async def test_nats_without_jetstream_is_explained(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory("nats-no-js")
    q = make_prefill_queue(server.url, QueueOptions(publish_timeout=1.0))
    with pytest.raises(BackendUnavailable, match="nats-server -js"):
        await q.connect()


def test_metrics_endpoint() -> None:
    registry = new_registry()
    ttft = histogram(registry, "frontend", "ttft_seconds", "Time to first token", TTFT_BUCKETS)
    ttft.observe(0.123)
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'diptych_frontend_ttft_seconds_bucket{le="0.15"} 1.0' in text
    finally:
        server.close()
    assert list(ITL_BUCKETS) == sorted(ITL_BUCKETS)
    assert metric_name("worker", "kv_usage") == "diptych_worker_kv_usage"
    with pytest.raises(ValueError, match="component"):
        metric_name("router", "x")
    with pytest.raises(ValueError, match="metric name"):
        metric_name("worker", "Bad-Name")


def test_the_metrics_endpoint_answers_probes_and_404s_the_rest() -> None:
    ready = {"now": False}
    probes = {
        "/health": lambda: (True, "ok"),
        "/ready": lambda: (ready["now"], "ready" if ready["now"] else "not registered"),
    }
    server = serve_metrics(new_registry(), "127.0.0.1", 0, probes, advertise_host="10.9.8.7")
    try:
        port = server.address.rpartition(":")[2]
        assert server.address == f"10.9.8.7:{port}"  # what discovery publishes
        base = f"http://127.0.0.1:{port}"

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(base + path, timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        assert get("/health") == (200, '{"status": "ok"}')
        assert get("/ready") == (503, '{"status": "not registered"}')
        ready["now"] = True
        assert get("/ready")[0] == 200
        code, body = get("/healthz")
        assert code == 404 and "/metrics" in body
        assert get("/metrics")[0] == 200
    finally:
        server.close()

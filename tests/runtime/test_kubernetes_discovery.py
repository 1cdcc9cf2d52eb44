"""Discovery on Kubernetes Leases, beyond the conformance tests every backend passes
(tests/runtime/test_discovery.py): expiry on the reader's clock, an API outage ridden
out, stale Leases purged, the URL, and the API calls it makes (what its Role grants)."""

from __future__ import annotations

import asyncio

import pytest

from runtime.config import make_discovery, parse_url
from runtime.discovery import DiscoveryOptions
from runtime.discovery.kubernetes import KubernetesDiscovery, lease_name
from runtime.errors import ConfigError, ControlPlaneError
from tests.runtime.fake_kube import FakeKubeApi
from tests.runtime.rt_helpers import TTL, worker


def test_the_url_names_the_namespace_or_the_pods_own() -> None:
    assert parse_url("kubernetes://llm").k8s_namespace == "llm"
    assert parse_url("kubernetes://").k8s_namespace is None
    assert str(parse_url("kubernetes://llm")) == "kubernetes://llm"
    with pytest.raises(ConfigError, match="not a Kubernetes namespace"):
        parse_url("kubernetes://Bad_Name")
    d = make_discovery("kubernetes://llm", DiscoveryOptions(namespace="fleet"))
    assert isinstance(d, KubernetesDiscovery)


class Clock:
    def __init__(self) -> None:
        import time

        self.t = time.time()

    def __call__(self) -> float:
        return self.t


async def _connected(api: FakeKubeApi, clock: Clock, namespace: str) -> KubernetesDiscovery:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = api.url
    d = KubernetesDiscovery(
        DiscoveryOptions(namespace=namespace, ttl=TTL, poll_interval=0.02),
        "llm",
        api_client=client.ApiClient(cfg),
        clock=clock,
    )
    await d.connect()
    return d


async def test_a_record_lives_while_renewed_on_the_readers_clock(namespace: str) -> None:
    api, clock = FakeKubeApi(), Clock()
    try:
        d = await _connected(api, clock, namespace)
        lease = await d._grant(TTL)
        await d._put(f"/diptych/{namespace}/decode/a", worker("a").to_json(), lease)
        assert [w.worker_id for w in await d.list("decode")] == ["a"]
        clock.t += TTL + 0.5  # no renewal since: gone, though the Lease object is there
        assert await d.list("decode") == [] and await d.get("decode", "a") is None
        assert (("llm", lease_name(f"/diptych/{namespace}/decode/a"))) in api.leases
        assert await d._keepalive(lease)  # renewed (renewTime = now): live again
        assert [w.worker_id for w in await d.list("decode")] == ["a"]
        clock.t += 20 * TTL  # long dead: the next registration deletes it
        await d._grant(TTL)
        assert not api.leases
        await d.close()
    finally:
        api.close()


async def test_an_api_outage_is_a_control_plane_error_and_is_ridden_out(namespace: str) -> None:
    api, clock = FakeKubeApi(), Clock()
    try:
        d = await _connected(api, clock, namespace)
        reg = await d.register(worker("a"))
        api.down = True
        with pytest.raises(ControlPlaneError, match="503"):
            await d.list("decode")
        await asyncio.sleep(TTL / 2)  # keepalives fail meanwhile; the registration retries
        api.down = False
        clock.t += 0.1
        await asyncio.sleep(TTL / 2)
        assert [w.worker_id for w in await d.list("decode")] == ["a"]
        await reg.close()
        assert await d.list("decode") == [] and not api.leases
        await d.close()
        # every call it made: what the chart's discovery Role grants (get, list, create,
        # patch, delete on leases) and nothing else
        assert set(api.calls) <= {"GET", "POST", "PATCH", "DELETE"}
    finally:
        api.close()

"""The Kubernetes connector against a recording test API server.

THE SEAM: no Kubernetes API server can run here, so `FakeApiServer` answers the two
calls the connector makes (GET and PATCH of apps/v1 deployments/<name>/scale, or of a
LeaderWorkerSet's leaderworkersets/<name>/scale) the way the real one does, and records
them; the real `kubernetes` client is used
unchanged. What a real cluster adds (RBAC, admission, the Deployment controller
making pods) is not tested here.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from diptych.local_fleet import send_json
from planner import Limits, Planner, PoolLimits
from planner.connectors.kubernetes import HandEdited, KubernetesConnector
from planner.policy import Proposal
from planner.scrape import Snapshot
from planner.service import PlannerService
from planner.source import Round
from runtime.errors import ConfigError
from tests.planner.test_service import Clock, Flaky

PREFIX = "/apis/apps/v1/namespaces/"
LWS_PREFIX = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/"
_RESOURCE = {PREFIX: "deployments", LWS_PREFIX: "leaderworkersets"}


class FakeApiServer:
    """Deployments' scale subresources in `replicas`; every request in `calls`."""

    def __init__(self, replicas: dict[tuple[str, str], int]) -> None:
        self.replicas = replicas
        self.calls: list[tuple[str, str, Any, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _target(self) -> tuple[str, str] | None:
                path = self.path.split("?")[0]
                for prefix, resource in _RESOURCE.items():
                    parts = path.removeprefix(prefix).split("/")
                    if path.startswith(prefix) and len(parts) == 4 and parts[1:4:2] == [
                        resource, "scale"
                    ]:  # fmt: skip
                        return parts[0], parts[2]
                return None

            def _send(self, code: int, doc: dict[str, Any]) -> None:
                send_json(self, code, doc)

            def _scale(self, key: tuple[str, str]) -> dict[str, Any]:
                n = fake.replicas[key]
                return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                        "metadata": {"namespace": key[0], "name": key[1]},
                        "spec": {"replicas": n}, "status": {"replicas": n}}  # fmt: skip

            def _answer(self, body: Any) -> None:
                key = self._target()
                fake.calls.append(
                    (self.command, self.path, body, self.headers.get("Content-Type", ""))
                )
                if key is None or key not in fake.replicas:
                    self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                     "code": 404})  # fmt: skip
                    return
                if body is not None:
                    fake.replicas[key] = int(body["spec"]["replicas"])
                self._send(200, self._scale(key))

            def do_GET(self) -> None:
                self._answer(None)

            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length)))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    fake = FakeApiServer({("llm", "diptych-prefill"): 1, ("llm", "diptych-decode"): 2})
    yield fake
    fake.close()


def _connector(
    api: FakeApiServer, clock: Clock | None = None, kinds: dict[str, str] | None = None
) -> KubernetesConnector:
    cfg = client.Configuration()
    cfg.host = api.url
    return KubernetesConnector(
        namespace="llm",
        api_client=client.ApiClient(cfg),
        manual_hold_s=100,
        clock=clock or Clock(),
        kinds=kinds,
    )


def _path(name: str) -> str:
    return f"{PREFIX}llm/deployments/{name}/scale"


async def test_scale_reads_then_patches_the_scale_subresource(api: FakeApiServer) -> None:
    k8s = _connector(api)
    await k8s.scale("prefill", 3)
    await k8s.scale("prefill", 3)  # already there: read only, no write
    await k8s.scale("decode", 1)
    await k8s.close()
    assert [(m, p, b) for m, p, b, _ in api.calls] == [
        ("GET", _path("diptych-prefill"), None),
        ("PATCH", _path("diptych-prefill"), {"spec": {"replicas": 3}}),
        ("GET", _path("diptych-prefill"), None),
        ("GET", _path("diptych-decode"), None),
        ("PATCH", _path("diptych-decode"), {"spec": {"replicas": 1}}),
    ]
    patch_type = api.calls[1][3]
    assert patch_type in ("application/merge-patch+json", "application/strategic-merge-patch+json")
    assert api.replicas == {("llm", "diptych-prefill"): 3, ("llm", "diptych-decode"): 1}


async def test_a_leaderworkerset_pool_is_scaled_through_its_own_scale(api: FakeApiServer) -> None:
    """Multi-node workers (the chart's lws.enabled): the pool is a LeaderWorkerSet, one
    replica a group of pods; the same read-then-patch on its scale subresource."""
    k8s = _connector(api, kinds={"decode": "LeaderWorkerSet"})
    assert await k8s.current("decode") == 2
    await k8s.scale("decode", 3)
    await k8s.scale("prefill", 2)  # still a Deployment
    await k8s.close()
    lws = f"{LWS_PREFIX}llm/leaderworkersets/diptych-decode/scale"
    assert [(m, p, b) for m, p, b, _ in api.calls] == [
        ("GET", lws, None),
        ("GET", lws, None),
        ("PATCH", lws, {"spec": {"replicas": 3}}),
        ("GET", _path("diptych-prefill"), None),
        ("PATCH", _path("diptych-prefill"), {"spec": {"replicas": 2}}),
    ]
    assert api.replicas == {("llm", "diptych-prefill"): 2, ("llm", "diptych-decode"): 3}
    with pytest.raises(ConfigError, match="must be one of"):
        _connector(api, kinds={"decode": "StatefulSet"})


async def test_a_hand_edit_is_left_alone_for_the_hold_then_resumed(api: FakeApiServer) -> None:
    clock = Clock()
    k8s = _connector(api, clock)
    await k8s.scale("decode", 4)
    api.replicas[("llm", "diptych-decode")] = 6  # kubectl scale --replicas 6
    clock.t = 10
    with pytest.raises(HandEdited, match="scaled to 6 by hand"):
        await k8s.scale("decode", 4)
    clock.t = 50
    with pytest.raises(HandEdited):
        await k8s.scale("decode", 4)
    assert api.replicas[("llm", "diptych-decode")] == 6  # not overwritten
    clock.t = 111  # the hold is over: the planner's target again
    await k8s.scale("decode", 4)
    assert api.replicas[("llm", "diptych-decode")] == 4
    await k8s.close()


async def test_a_missing_deployment_is_a_clear_error(api: FakeApiServer) -> None:
    cfg = client.Configuration()
    cfg.host = api.url
    k8s = KubernetesConnector(
        namespace="llm", deployments={"prefill": "nope", "decode": "diptych-decode"},
        api_client=client.ApiClient(cfg),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"llm/nope: HTTP 404.*no such Deployment"):
        await k8s.scale("prefill", 2)
    await k8s.close()


class Mirror(Flaky):
    """Rounds in which the ready workers are what the fake cluster runs."""

    def __init__(self, api: FakeApiServer) -> None:
        super().__init__()
        self.api = api

    async def scrape(self) -> Round:
        base = await super().scrape()
        workers = {
            pool: {f"{pool}-{i}": Snapshot() for i in range(self.api.replicas[("llm", name)])}
            for pool, name in (("prefill", "diptych-prefill"), ("decode", "diptych-decode"))
        }
        return Round(base.frontend, workers)


class Grow:
    name = "grow"

    def propose(self, obs: Any, forecast: Any) -> list[Proposal]:
        return [Proposal("prefill", 2, "test"), Proposal("decode", 3, "test")]


async def test_the_planner_logs_a_hand_edit_once_and_counts_it(api: FakeApiServer) -> None:
    clock = Clock()
    k8s = _connector(api, clock)
    limits = Limits(PoolLimits(1, 4), PoolLimits(1, 4), up_cooldown_s=0, down_cooldown_s=0)
    svc = PlannerService(Planner(Grow(), limits), Mirror(api), k8s, interval_s=10, clock=clock)
    await svc.tick_once()
    for t in (10, 20):
        clock.t = t
        await svc.tick_once()
    assert api.replicas == {("llm", "diptych-prefill"): 2, ("llm", "diptych-decode"): 3}
    api.replicas[("llm", "diptych-decode")] = 1  # by hand
    for t in (30, 40, 50):
        clock.t = t
        await svc.tick_once()
    await k8s.close()
    hand = [e for e in svc.events if e.kind == "hand_edit"]
    assert len(hand) == 1 and "by hand" in hand[0].text  # logged once, not every tick
    errors = {s.labels["kind"]: s.value for s in svc.metrics.errors.collect()[0].samples
              if s.name.endswith("_total") and s.value}  # fmt: skip
    assert errors.get("hand_edit", 0) >= 3 and "scale" not in errors
    assert api.replicas[("llm", "diptych-decode")] == 1


def test_no_credentials_is_one_clear_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in a pod and no kubeconfig: a ConfigError that says what to pass, which the
    CLI prints as one line (no traceback)."""
    from runtime.errors import ConfigError

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"no credentials.*pass --kubeconfig"):
        KubernetesConnector()
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "nope"))):
        KubernetesConnector(kubeconfig=str(tmp_path / "nope"))

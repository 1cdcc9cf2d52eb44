"""Policy on the rendered chart: checkov's Kubernetes checks (a well-kept scanner) plus
ours, for every value set; and the planner's Role against the calls its Kubernetes
connector really makes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import ROOT, VALUE_SETS, containers, find, objects, pod_specs

# Skipped fleet-wide, with the reason; skips for one object sit on it as a
# checkov.io/skip annotation (the planner's token, the bundled etcd's plain HTTP, RDMA's
# IPC_LOCK).
CHECKOV_SKIPS = {
    # tags are pinned (never latest, schema-checked); image.digest pins by digest for
    # those who want it, which no default can know
    "CKV_K8S_43": "image digest",
    # IfNotPresent with pinned, immutable tags: Always re-pulls multi-GB CUDA images on
    # every pod start for nothing
    "CKV_K8S_15": "pull policy Always",
}


def _checkov() -> str:
    found = ROOT / ".venv-checkov" / "bin" / "checkov"
    if found.exists():
        return str(found)
    path = shutil.which("checkov")
    if path is None:
        pytest.fail("checkov is missing: scripts/install --test puts it in .venv-checkov")
    return path


def test_checkov_passes_on_every_value_set(tmp_path: Path) -> None:
    for name in VALUE_SETS:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objects(name)))
    cmd = [
        _checkov(), "-d", str(tmp_path), "--framework", "kubernetes", "--quiet", "--compact",
        "-o", "json", "--skip-download", "--skip-check", ",".join(CHECKOV_SKIPS),
    ]  # fmt: skip
    if os.geteuid() == 0 and shutil.which("unshare"):
        cmd = ["unshare", "-n", *cmd]  # checkov phones home unless it cannot
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        (c["check_id"], c["check_name"], c["resource"], Path(c["file_path"]).stem)
        for r in reports
        for c in r["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(map(str, failed))
    summary = reports[0]["summary"]
    assert summary["passed"] > 1000 and summary["parsing_errors"] == 0, summary


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_is_bounded_probed_non_root_and_pinned(value_set: str) -> None:
    objs = objects(value_set)
    specs = dict(pod_specs(objs))
    init_names = {(w, c["name"]) for w, s in specs.items() for c in s.get("initContainers", [])}
    for workload, c in containers(objs):
        where = f"{value_set}: {workload}/{c['name']}"
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{where}: {kind}"
        # a LeaderWorkerSet group's other pods serve nothing: their `diptych tp-node`
        # exits when a rank fails, and the group restarts (RecreateGroupOnPodRestart)
        ranks_only = c.get("args", [""])[0] == "tp-node"
        if (workload, c["name"]) not in init_names and not ranks_only:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert probe in c, f"{where}: no {probe}"
        pod_sc, sc = specs[workload].get("securityContext", {}), c.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and pod_sc.get("runAsUser", 0) > 0, where
        assert sc.get("runAsUser", pod_sc["runAsUser"]) != 0, where
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert sc.get("privileged") is not True, where
        image = c["image"]
        if "@sha256:" not in image:
            name, _, tag = image.rpartition(":")
            assert name and "/" not in tag and tag and tag != "latest", f"{where}: {image}"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workers_get_the_time_their_drain_takes(value_set: str) -> None:
    """SIGTERM comes after preStop; the kubelet kills at terminationGracePeriodSeconds:
    the grace must cover the preStop sleep plus the worker's whole --drain-timeout."""
    for o in find(objects(value_set), "Deployment"):
        spec = o["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        drain = [float(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-timeout=")]
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre = float(hook[1]) if hook[:1] == ["sleep"] else 0.0
        assert spec["terminationGracePeriodSeconds"] > sum(drain) + pre, o["metadata"]["name"]


def test_gpu_pools_ask_for_gpus_and_cpu_only_for_none() -> None:
    for value_set, want in (("default", 1), ("cpu-only", None)):
        for o in find(objects(value_set), "Deployment"):
            if o["metadata"]["name"].endswith(("-decode", "-prefill")):
                (c,) = o["spec"]["template"]["spec"]["containers"]
                assert c["resources"]["limits"].get("nvidia.com/gpu") == want, value_set


def test_rdma_pools_get_the_device_the_capability_and_the_verbs_env() -> None:
    objs = objects("rdma-multinode")
    for pool in ("decode", "prefill"):
        (o,) = find(objs, "Deployment", f"diptych-{pool}")
        pod = o["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1" and "rc" in env["UCX_TLS"].split(",")
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "default/ib-sriov"
        assert "--transfer=nixl" in c["args"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm" and mounts["model"] == "/models"


# -- the planner's Role against its connector's calls -----------------------------------

_VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update", "POST": "create", "DELETE": "delete"}


def _rbac_of(method: str, path: str) -> tuple[str, str, str, str]:
    """(apiGroup, resource[/subresource], verb, name) of one API request path."""
    parts = path.split("?")[0].strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    assert rest[0] == "namespaces", path
    resource, name, sub = rest[2], rest[3] if len(rest) > 3 else "", rest[4:]
    verb = _VERBS[method] if name else {"GET": "list", "POST": "create"}[method]
    return group, "/".join([resource, *sub]), verb, name


def test_the_planner_role_grants_exactly_what_its_connector_calls() -> None:
    from tests.planner.test_kubernetes_connector import FakeApiServer, _connector

    calls: set[tuple[str, str, str, str]] = set()
    for kind in ("Deployment", "LeaderWorkerSet"):  # the pools as either (lws.enabled)
        api = FakeApiServer({("llm", "diptych-prefill"): 1, ("llm", "diptych-decode"): 1})
        try:
            kinds = {"prefill": kind, "decode": kind}
            connector = _connector(api, kinds=kinds)  # namespace llm, the chart's

            asyncio.run(_scenario(api, connector))
            calls |= {_rbac_of(m, p) for m, p, _, _ in api.calls}
        finally:
            api.close()
    assert calls == {
        (group, f"{resource}/scale", verb, f"diptych-{pool}")
        for group, resource in (("apps", "deployments"),
                                ("leaderworkerset.x-k8s.io", "leaderworkersets"))
        for verb in ("get", "patch")
        for pool in ("prefill", "decode")
    }  # fmt: skip
    for value_set in VALUE_SETS:
        objs = objects(value_set)
        roles = find(objs, "Role", "diptych-planner")
        if not find(objs, "Deployment", "diptych-planner"):
            assert not roles and not find(objs, "RoleBinding", "diptych-planner"), value_set
            continue
        (role,) = roles
        granted = _granted(role)
        pools = {
            (d["metadata"]["name"], d["kind"]) for d in objs
            if d["kind"] in ("Deployment", "LeaderWorkerSet")
        } - {("diptych-frontend", "Deployment"), ("diptych-planner", "Deployment")}  # fmt: skip
        group_of = {"Deployment": "apps", "LeaderWorkerSet": "leaderworkerset.x-k8s.io"}
        wanted = {c for c in calls for name, kind in pools
                  if c[3] == name and c[0] == group_of[kind]}  # fmt: skip
        assert granted == wanted, (value_set, granted ^ wanted)
        lws = sorted(name.removeprefix("diptych-") for name, kind in pools
                     if kind == "LeaderWorkerSet")  # fmt: skip
        (planner_pod,) = [s for n, s in pod_specs(objs) if n == "diptych-planner"]
        lws_args = [a for a in planner_pod["containers"][0]["args"] if a.startswith("--lws")]
        assert sorted("".join(lws_args).removeprefix("--lws-pools=").split(",")) == (
            lws if lws else [""]
        ), value_set
        (binding,) = find(objs, "RoleBinding", "diptych-planner")
        (planner,) = find(objs, "Deployment", "diptych-planner")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        sa = planner["spec"]["template"]["spec"]["serviceAccountName"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "llm"}]


async def _scenario(api: Any, connector: Any) -> None:
    """Every call the connector makes: a read and a write, a read alone, a hand edit."""
    from planner.connectors.kubernetes import HandEdited

    await connector.scale("prefill", 3)  # read, write
    await connector.scale("prefill", 3)  # read, already there: no write
    await connector.scale("decode", 2)
    api.replicas[("llm", "diptych-decode")] = 5  # an operator's hand edit
    with pytest.raises(HandEdited):  # read, then held: no write
        await connector.scale("decode", 1)
    await connector.close()


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str, str]]:
    return {
        (g, r, v, n)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
        for n in rule.get("resourceNames", ["*"])
    }


def test_the_discovery_role_grants_exactly_what_kubernetes_discovery_calls() -> None:
    """Drive the Lease backend through registration, renewal, lists, reads, a watch,
    a purge and a close against the stand-in API server; map every request to RBAC."""
    from kubernetes import client

    from runtime.discovery import DiscoveryOptions
    from runtime.discovery.kubernetes import KubernetesDiscovery
    from tests.runtime.fake_kube import FakeKubeApi
    from tests.runtime.rt_helpers import worker

    api = FakeKubeApi()
    try:

        async def scenario() -> None:
            cfg = client.Configuration()
            cfg.host = api.url
            d = KubernetesDiscovery(
                DiscoveryOptions(namespace="fleet", ttl=2.0), "llm",
                api_client=client.ApiClient(cfg),
            )  # fmt: skip
            await d.connect()
            reg = await d.register(worker("a"))
            await d.list("decode")
            await d.get("decode", "a")
            watch = d.watch("decode")
            await anext(watch)
            await asyncio.sleep(1.5)  # a keepalive and a re-list
            await watch.aclose()
            await reg.close()
            await d.close()

        asyncio.run(scenario())
        calls = {_rbac_of(m, p) for m, p in api.requests}
    finally:
        api.close()
    used = {(g, r, v) for g, r, v, _ in calls}
    assert used == {("coordination.k8s.io", "leases", v)
                    for v in ("get", "list", "create", "patch", "delete")}  # fmt: skip
    objs = objects("kubernetes-discovery")
    (role,) = find(objs, "Role", "diptych-discovery")
    assert {(g, r, v) for g, r, v, _ in _granted(role)} == used
    assert not find(objs, "StatefulSet", "diptych-etcd")
    (binding,) = find(objs, "RoleBinding", "diptych-discovery")
    accounts = {s["name"] for s in binding["subjects"]}
    assert accounts == {"diptych-fleet", "diptych-planner"}
    for o in find(objs, "Deployment"):
        spec = o["spec"]["template"]["spec"]
        assert spec.get("serviceAccountName") in accounts, o["metadata"]["name"]
        args = spec["containers"][0]["args"]
        assert "--discovery=kubernetes://llm" in args and not any("--etcd" in a for a in args)
    for value_set in VALUE_SETS:  # only that value set has it
        if value_set != "kubernetes-discovery":
            assert not find(objects(value_set), "Role", "diptych-discovery"), value_set

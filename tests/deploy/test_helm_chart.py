"""The chart lints and renders clean for every value set, and every object it renders is
valid Kubernetes (1.30, the oldest it supports, and the newest schemas on hand), strictly:
no field a real API server would drop."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import (
    CHART,
    CRD_KINDS,
    NAMESPACE,
    VALUE_SETS,
    find,
    manifests,
    objects,
    pod_specs,
    values,
)

KUBE_VERSIONS = ("1.30.0", "1.37.0")


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_helm_lint_is_clean(value_set: str) -> None:
    import helm_python as helm

    for kube in KUBE_VERSIONS:
        report = helm.lint(
            str(CHART), values(value_set), strict=True, namespace=NAMESPACE, kube_version=f"v{kube}"
        )
        findings = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not findings, findings


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_object_validates_strictly(value_set: str) -> None:
    import kubernetes_validate

    objs = objects(value_set)
    assert objs
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        for kube in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, kube, strict=True)
            except kubernetes_validate.ValidationError as e:
                what = f"{obj['kind']}/{obj['metadata']['name']} ({kube})"
                raise AssertionError(f"{what}: {e}") from None


def test_crd_objects_are_well_formed() -> None:
    """ServiceMonitor and HTTPRoute have no schema here: check what their controllers need."""
    objs = objects("everything-on")
    monitors = find(objs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {
        "diptych-frontend", "diptych-decode", "diptych-prefill", "diptych-planner"
    }  # fmt: skip
    services = find(objs, "Service")
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        want = m["spec"]["selector"]["matchLabels"]
        hits = [s for s in services if want.items() <= s["metadata"]["labels"].items()]
        assert len(hits) == 1, (m["metadata"]["name"], [s["metadata"]["name"] for s in hits])
        ports = {p["name"] for p in hits[0]["spec"]["ports"]}
        assert {e["port"] for e in m["spec"]["endpoints"]} <= ports
    (route,) = find(objs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    (svc,) = find(objs, "Service", backend["name"])
    assert backend["port"] in {p["port"] for p in svc["spec"]["ports"]}
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateway"}]


def _names(objs: list[dict[str, Any]], kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in find(objs, kind)}


def test_each_switch_leaves_out_what_it_names() -> None:
    full = objects("default")
    assert _names(full, "Deployment") == {
        "diptych-frontend", "diptych-decode", "diptych-prefill", "diptych-planner"
    }  # fmt: skip
    assert _names(full, "StatefulSet") == {"diptych-nats", "diptych-etcd"}
    assert not find(full, "Ingress") and len(find(full, "NetworkPolicy")) == 2  # on by default
    assert {"diptych-cluster", "diptych-control-plane-client"} <= _names(full, "Secret")

    # what closes the control plane, each switched off: none of its objects or flags
    open_ = objects("open-control-plane")
    assert not find(open_, "NetworkPolicy") and not find(open_, "Secret")
    args = find(open_, "Deployment", "diptych-decode")[0]["spec"]["template"]["spec"]
    flat = args["containers"][0]["args"]
    assert "--nats=nats://diptych-nats:4222" in flat and "--etcd=diptych-etcd:2379" in flat
    (nats,) = find(open_, "StatefulSet", "diptych-nats")
    assert "--jetstream" in nats["spec"]["template"]["spec"]["containers"][0]["args"]

    agg = objects("aggregated")
    assert "diptych-prefill" not in _names(agg, "Deployment")
    (decode,) = find(agg, "Deployment", "diptych-decode")
    assert "--no-remote-prefill" in decode["spec"]["template"]["spec"]["containers"][0]["args"]
    (role,) = find(agg, "Role")
    assert role["rules"][0]["resourceNames"] == ["diptych-decode"]

    ext = objects("external-control-plane")
    assert not find(ext, "StatefulSet")
    args = find(ext, "Deployment", "diptych-decode")[0]["spec"]["template"]["spec"]
    flat = args["containers"][0]["args"]
    assert "--nats=nats.infra.svc:4222" in flat
    assert any(a.startswith("--etcd=etcd-0.etcd.infra.svc:2379,") for a in flat)

    off = objects("planner-off")
    assert "diptych-planner" not in _names(off, "Deployment")
    assert not find(off, "Role") and not find(off, "ServiceAccount")
    (prefill,) = find(off, "Deployment", "diptych-prefill")
    assert prefill["spec"]["replicas"] == 2  # without a planner the chart sets the size
    # with one too at install (an upgrade keeps the live size: test_chart_pools.py)
    assert find(full, "Deployment", "diptych-prefill")[0]["spec"]["replicas"] == 1


def test_notes_say_how_to_reach_the_api_and_the_dashboard() -> None:
    notes = manifests("default")["diptych/templates/NOTES.txt"]
    assert "port-forward svc/diptych-frontend 8000:8000" in notes
    assert "/v1/chat/completions" in notes
    assert "port-forward svc/diptych-planner 8001:8001" in notes and "/dashboard" in notes
    ingress = manifests("everything-on")["diptych/templates/NOTES.txt"]
    assert "https://llm.example.com/v1" in ingress
    assert "/dashboard" not in manifests("planner-off")["diptych/templates/NOTES.txt"]


def test_values_schema_rejects_what_would_render_a_broken_fleet() -> None:
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({})
    for bad in (
        {"model": {"source": "s3"}},
        {"decode": {"replicas": -1}},
        {"transfer": {"backend": "rdma"}},
        {"planner": {"policy": "hpa"}},
        {"image": {"tag": "latest"}},
        {"frontend": {"prot": 8000}},
    ):
        with pytest.raises(helm.HelmError):
            chart.validate_schema(bad)


def test_the_api_key_secret_reaches_the_frontend_and_nothing_else() -> None:
    def mounted(value_set: str) -> dict[str, Any]:
        found = {}
        for o in find(objects(value_set), "Deployment"):
            spec = o["spec"]["template"]["spec"]
            secrets = [v["secret"] for v in spec.get("volumes", []) if v["name"] == "api-keys"]
            args = [a for c in spec["containers"] for a in c.get("args", [])]
            keys = [a for a in args if a.startswith("--api-key")]
            if secrets or keys:
                found[o["metadata"]["name"]] = (secrets, keys)
        return found

    assert mounted("default") == {}
    secret = {"secretName": "diptych-api-keys", "defaultMode": 0o400}
    assert mounted("everything-on") == {
        "diptych-frontend": ([secret], ["--api-key-file=/etc/diptych/api-keys/api-keys"])
    }


def test_the_cluster_secret_reaches_every_diptych_pod_as_a_file() -> None:
    def gated(value_set: str) -> dict[str, bool]:
        out = {}
        for name, spec in pod_specs(objects(value_set)):
            for c in spec["containers"]:
                if "/diptych" not in c["image"]:
                    continue
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                vols = {v["name"]: v for v in spec["volumes"]}
                path = env.get("DIPTYCH_CLUSTER_SECRET_FILE")
                ok = path == "/etc/diptych/cluster-secret/secret" and vols[
                    mounts["/etc/diptych/cluster-secret"]
                ]["secret"]["secretName"] == "diptych-cluster"
                out[name] = bool(ok) if path else False
        return out

    assert not any(gated("open-control-plane").values())
    for value_set in ("default", "everything-on"):  # made by the chart, or named
        everything = gated(value_set)
        assert everything and all(everything.values()), (value_set, everything)

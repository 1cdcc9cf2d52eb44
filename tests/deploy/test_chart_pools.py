"""What a platform engineer sets per pool reaches the pods it names, and nothing else:
the RDMA device, the update strategy, the size across upgrades, the model's storage,
and the extra pod-spec fields."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.chart import CHART, ROOT, find, objects, render

DEPLOY_DOC = ROOT / "docs" / "deploy.md"
POOLS = ("decode", "prefill")


def _pod(objs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (o,) = find(objs, "Deployment", f"diptych-{role}")
    return dict(o["spec"]["template"]["spec"])


def _doc_example(first_line: str) -> dict[str, Any]:
    """The YAML block of docs/deploy.md that starts with `first_line`."""
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_DOC.read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return dict(yaml.safe_load(block))


def _rdma(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        kind: {k: v for k, v in c["resources"][kind].items() if k.startswith("rdma/")}
        for kind in ("requests", "limits")
    }


def test_a_users_rdma_resource_replaces_the_default() -> None:
    """Helm merges maps of values: a resource named by the user must not be added to the
    default one (two RDMA devices asked for: Pending wherever a node has only one)."""
    docs = _doc_example("# rdma.yaml")
    for objs in (objects("rdma-multinode"), render(docs)):
        for pool in POOLS:
            (c,) = _pod(objs, pool)["containers"]
            want = {"rdma/rdma_shared_device_a": 1}
            assert _rdma(c) == {"requests": want, "limits": want}, pool
    default = render({"rdma": {"enabled": True}})
    (c,) = _pod(default, "decode")["containers"]
    assert _rdma(c) == {"requests": {"rdma/ib": 1}, "limits": {"rdma/ib": 1}}
    (c,) = _pod(render({}), "decode")["containers"]
    assert _rdma(c) == {"requests": {}, "limits": {}}


def _strategy(objs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (o,) = find(objs, "Deployment", f"diptych-{role}")
    return dict(o["spec"]["strategy"])


def test_gpu_pools_roll_without_a_spare_gpu() -> None:
    """maxSurge 1 needs a free GPU for the new pod before an old one stops: on a full
    cluster the rollout waits forever. The pools replace a pod at a time by default;
    the frontends (CPU) still surge; each pool's strategy is a value."""
    objs = objects("default")
    for pool in POOLS:
        assert _strategy(objs, pool) == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}
        }, pool  # fmt: skip
    assert _strategy(objs, "frontend") == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}
    }  # fmt: skip
    objs = render({
        "decode": {"updateStrategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}},
        "prefill": {"updateStrategy": {"type": "Recreate"}},
        "frontend": {"updateStrategy": {"rollingUpdate": {"maxSurge": 2}}},
    })  # fmt: skip
    assert _strategy(objs, "decode")["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}
    assert _strategy(objs, "prefill") == {"type": "Recreate"}  # no rollingUpdate with it
    assert _strategy(objs, "frontend")["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 0}


def test_extra_pod_fields_land_on_their_pool_only() -> None:
    extras = {
        role: {
            "runtimeClassName": f"{role}-runtime",
            "priorityClassName": f"{role}-priority",
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": role}},
                }
            ],
            "extraVolumes": [{"name": f"{role}-extra", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": f"{role}-extra", "mountPath": f"/opt/{role}"}],
        }
        for role in ("frontend", *POOLS)
    }
    objs = render(extras)
    for role, given in extras.items():
        pod = _pod(objs, role)
        for key in ("runtimeClassName", "priorityClassName", "topologySpreadConstraints"):
            assert pod[key] == given[key], (role, key)
        assert pod["volumes"][-1] == given["extraVolumes"][0], role
        (c,) = pod["containers"]
        assert c["volumeMounts"][-1] == given["extraVolumeMounts"][0], role
        others = {m["mountPath"] for m in c["volumeMounts"]} - {f"/opt/{role}"}
        assert not any(p.startswith("/opt/") for p in others), role
    for role in ("frontend", *POOLS, "planner"):  # none of them unless asked for
        pod = _pod(objects("default"), role)
        assert not {"runtimeClassName", "priorityClassName", "topologySpreadConstraints"} & set(pod)


def _replicas(objs: list[dict[str, Any]], role: str) -> Any:
    (o,) = find(objs, "Deployment", f"diptych-{role}")
    return o["spec"].get("replicas")


def test_the_pools_start_at_their_replicas_with_or_without_the_planner() -> None:
    """A Deployment without spec.replicas is one pod, and `helm upgrade` from a release
    that had the field sends replicas: null (one pod) too: the chart always writes it."""
    sizes = {"decode": {"replicas": 3}, "prefill": {"replicas": 2}}
    for planner in (True, False):
        objs = render({**sizes, "planner": {"enabled": planner}})
        assert _replicas(objs, "decode") == 3 and _replicas(objs, "prefill") == 2, planner
    for value_set in ("default", "planner-off", "everything-on"):
        assert isinstance(_replicas(objects(value_set), "decode"), int), value_set


def test_with_the_planner_an_upgrade_keeps_the_live_pool_size(tmp_path: Path) -> None:
    """The planner owns the size once running: an upgrade (the one that turns it on
    included) renders the live Deployment's replicas, which Helm's `lookup` reads; with
    nothing to look up (install, `helm template`) the values' replicas. The Deployments
    pass their lookup to diptych.replicas; a probe template passes made-up ones."""
    chart = tmp_path / "diptych"
    shutil.copytree(CHART, chart)
    probe = 'include "diptych.replicas" (dict "ctx" $ "pool" "decode" "live" LIVE) | quote'
    lives = {
        "live": '(dict "spec" (dict "replicas" 7))',
        "none": "(dict)",
        "scaledToZero": '(dict "spec" (dict "replicas" 0))',
    }
    data = "".join(f"  {k}: {{{{ {probe.replace('LIVE', v)} }}}}\n" for k, v in lives.items())
    (chart / "templates" / "zz-probe.yaml").write_text(
        f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: probe\ndata:\n{data}"
    )
    for planner, want in ((True, {"live": "7", "none": "3", "scaledToZero": "0"}),
                          (False, {"live": "3", "none": "3", "scaledToZero": "3"})):  # fmt: skip
        objs = render({"decode": {"replicas": 3}, "planner": {"enabled": planner}}, chart)
        (cm,) = find(objs, "ConfigMap", "probe")
        assert cm["data"] == want, planner
    template = (CHART / "templates" / "_worker.tpl").read_text()
    assert re.search(r'lookup "apps/v1" "Deployment" \$\.Release\.Namespace \$name', template)

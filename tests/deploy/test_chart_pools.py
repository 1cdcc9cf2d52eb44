"""What a platform engineer sets per pool reaches the pods it names, and nothing else:
the RDMA device, the update strategy, the size across upgrades, the model's storage,
and the extra pod-spec fields."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
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
    assert re.search(r'lookup \$api \$kind \$\.Release\.Namespace \$name', template)
    assert '$api := ternary "leaderworkerset.x-k8s.io/v1" "apps/v1"' in template


_BYTES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: Any) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    assert m, quantity
    return int(m.group(1)) * _BYTES.get(m.group(2), 1)


def _pod_storage_limit(pod: dict[str, Any]) -> int | None:
    """The pod's ephemeral-storage limit as the kubelet computes it (resourcehelper.
    PodLimits): the app containers' limits summed, or the largest init container's,
    whichever is more; none if no container sets one. emptyDirs on disk count."""

    def limit(c: dict[str, Any]) -> int | None:
        q = c.get("resources", {}).get("limits", {}).get("ephemeral-storage")
        return None if q is None else _bytes(q)

    apps = [x for x in map(limit, pod["containers"]) if x is not None]
    inits = [x for x in map(limit, pod.get("initContainers", [])) if x is not None]
    if not apps and not inits:
        return None
    return max(sum(apps), *inits) if inits else sum(apps)


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (v,) = [v for v in pod["volumes"] if v["name"] == name]
    return dict(v)


IMAGE_MODEL = {
    "source": "image",
    "path": "Llama-3.1-8B-Instruct",
    "image": {"repository": "registry.example.com/llama", "tag": "1", "sizeLimit": "60Gi"},
}


def test_a_model_from_an_image_fits_the_pod_that_copies_it() -> None:
    """The copy lands in an emptyDir on the node's disk, which the kubelet counts against
    the pod's ephemeral-storage limit: a 1Gi limit on the copying init container made
    1Gi the pod's limit, and every pod holding a larger model was evicted."""
    objs = render({"model": IMAGE_MODEL})
    for pool in POOLS:
        pod = _pod(objs, pool)
        assert _volume(pod, "model")["emptyDir"] == {"sizeLimit": "60Gi"}, pool
        limit = _pod_storage_limit(pod)
        assert limit is None or limit >= _bytes("60Gi"), (pool, limit)
        (init,) = pod["initContainers"]  # the scheduler finds a node with room for it
        assert init["resources"]["requests"]["ephemeral-storage"] == "60Gi", pool
        assert init["command"] == ["cp", "-a", "/model/.", "/models/"], pool


def _copy(init: dict[str, Any], image_root: Path, pod_root: Path) -> None:
    """Run the init container's command here, the image's / at image_root and the pod's
    /models at pod_root."""
    argv = [
        a.replace("/models", str(pod_root)) if a.startswith("/models") else a
        for a in init["command"]
    ]
    argv = [str(image_root) + a if a.startswith("/model/") else a for a in argv]
    subprocess.run(argv, check=True, timeout=30)


def test_frontends_copy_only_the_tokenizer_of_an_image_model(tmp_path: Path) -> None:
    """A frontend loads the tokenizer, not the weights: it copies the model directory's
    other files into a small emptyDir (a .gguf, which holds its tokenizer, whole)."""
    pod = _pod(render({"model": IMAGE_MODEL}), "frontend")
    assert _volume(pod, "model")["emptyDir"] == {"sizeLimit": "1Gi"}
    (init,) = pod["initContainers"]
    assert init["resources"]["requests"]["ephemeral-storage"] == "1Gi"
    assert _pod_storage_limit(pod) in (None, _bytes("1Gi"))
    (c,) = pod["containers"]
    assert "--model=/models/Llama-3.1-8B-Instruct" in c["args"]
    model = tmp_path / "image" / "model" / "Llama-3.1-8B-Instruct"
    (model / "original").mkdir(parents=True)
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    weights = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    for name in [*names, *weights, "original/consolidated.00.pth"]:
        (model / name).write_text(name)
    _copy(init, tmp_path / "image", tmp_path / "pod")
    copied = tmp_path / "pod" / "Llama-3.1-8B-Instruct"
    assert sorted(p.name for p in copied.iterdir()) == sorted([*names, weights[1]])

    file = "smollm2/SmolLM2-1.7B-Instruct-Q8_0.gguf"
    pod = _pod(render({"model": {**IMAGE_MODEL, "path": file}}), "frontend")
    assert _volume(pod, "model")["emptyDir"] == {"sizeLimit": "60Gi"}  # the file, whole
    (init,) = pod["initContainers"]
    (tmp_path / "image" / "model" / "smollm2").mkdir()
    (tmp_path / "image" / "model" / file).write_text("gguf")
    _copy(init, tmp_path / "image", tmp_path / "pod")
    assert (tmp_path / "pod" / file).read_text() == "gguf"


def test_a_hostpath_model_stays_off_the_frontends() -> None:
    """The directory is on the GPU nodes; the frontends run elsewhere. They read the
    tokenizer from frontend.tokenizer's own source, and the chart asks for one."""
    objs = objects("hostpath-model")
    for pool in POOLS:
        assert _volume(_pod(objs, pool), "model")["hostPath"]["path"] == "/mnt/models"
    pod = _pod(objs, "frontend")
    assert not [v for v in pod["volumes"] if "hostPath" in v], pod["volumes"]
    (c,) = pod["containers"]
    (model_arg,) = [a for a in c["args"] if a.startswith("--model=")]
    assert model_arg == "--model=/models/SmolLM2-1.7B-Instruct"  # same name as the workers'
    assert _volume(pod, "model")["emptyDir"] == {"sizeLimit": "1Gi"}  # from its image

    hostpath = {"source": "hostPath", "path": "m", "hostPath": {"path": "/mnt/models"}}
    with pytest.raises(helm.HelmError, match=r"frontend\.tokenizer\.source"):
        render({"model": hostpath})
    both = render({"model": hostpath, "frontend": {"tokenizer": {"source": "hostPath"}}})
    assert _volume(_pod(both, "frontend"), "model")["hostPath"]["path"] == "/mnt/models"
    pvc = render({
        "model": hostpath,
        "frontend": {"tokenizer": {"source": "pvc", "pvc": {"claimName": "tokenizers"}}},
    })  # fmt: skip
    pod = _pod(pvc, "frontend")
    assert _volume(pod, "model")["persistentVolumeClaim"]["claimName"] == "tokenizers"
    assert "initContainers" not in pod


def _frontend_args(given: dict[str, Any]) -> list[str]:
    (front,) = [d for d in find(render(given), "Deployment") if d["metadata"]["name"].endswith(
        "-frontend")]  # fmt: skip
    args: list[str] = front["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_a_decode_pool_the_planner_may_scale_to_zero_has_frontends_that_hold() -> None:
    """planner min-decode 0: the frontends hold requests while the pool is at zero (the
    planner starts a decode worker on seeing them held); otherwise they answer 503."""
    assert not any(a.startswith("--hold-for-workers") for a in _frontend_args({}))
    zero = {"planner": {"enabled": True, "flags": {"min-decode": 0}}}
    assert "--hold-for-workers=300" in _frontend_args(zero)
    zero["frontend"] = {"holdForWorkersSeconds": 60}
    assert "--hold-for-workers=60" in _frontend_args(zero)
    off = {"planner": {"enabled": False, "flags": {"min-decode": 0}}}
    assert not any(a.startswith("--hold-for-workers") for a in _frontend_args(off))


def test_tracing_reaches_every_role_that_serves_a_request() -> None:
    """tracing.otlpEndpoint sets the standard OTLP variable (which each role's
    --otlp-endpoint defaults from) in the frontend and both pools; unset, no pod has it."""

    def endpoint(objs: list[dict[str, Any]], role: str) -> str | None:
        (c,) = _pod(objs, role)["containers"]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        return env.get("OTEL_EXPORTER_OTLP_ENDPOINT")

    url = "http://otel-collector.observability:4318"
    on = render({"tracing": {"otlpEndpoint": url}})
    off = render({})
    for role in ("frontend", *POOLS):
        assert endpoint(on, role) == url, role
        assert endpoint(off, role) is None, role
    with pytest.raises(helm.HelmError, match="otlpEndpoint"):
        render({"tracing": {"otlpEndpoint": "otel-collector:4318"}})  # no scheme


def _planner_args(objs: list[dict[str, Any]]) -> list[str]:
    (o,) = find(objs, "Deployment", "diptych-planner")
    (c,) = o["spec"]["template"]["spec"]["containers"]
    return list(c["args"])


def test_a_tensor_parallel_pool_asks_for_one_gpu_a_rank() -> None:
    """decode.tensorParallelSize: the flag, that many GPUs (set, whatever `resources`
    says: never added to it), and the planner's cost of a worker; the two pools at
    different sizes (the KV moves between the splits)."""
    objs = render({"decode": {"tensorParallelSize": 4, "remotePrefill": False,
                              "resources": {"requests": {"nvidia.com/gpu": 1}}}})  # fmt: skip
    (c,) = _pod(objs, "decode")["containers"]
    assert "--tensor-parallel-size=4" in c["args"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    (p,) = _pod(objs, "prefill")["containers"]
    assert p["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any(a.startswith("--tensor-parallel-size") for a in p["args"])
    args = _planner_args(objs)
    assert "--decode-accelerators=4" in args and "--prefill-accelerators=1" in args
    cpu = render({"cpuOnly": True, "decode": {"tensorParallelSize": 2, "remotePrefill": False}})
    (c,) = _pod(cpu, "decode")["containers"]
    assert "--tensor-parallel-size=2" in c["args"]
    assert "nvidia.com/gpu" not in {**c["resources"]["requests"], **c["resources"]["limits"]}
    split = render({"cpuOnly": True, "decode": {"tensorParallelSize": 2},
                    "prefill": {"tensorParallelSize": 4}})  # fmt: skip
    (d,), (p,) = _pod(split, "decode")["containers"], _pod(split, "prefill")["containers"]
    assert "--tensor-parallel-size=2" in d["args"] and "--tensor-parallel-size=4" in p["args"]
    args = _planner_args(split)
    assert "--decode-accelerators=2" in args and "--prefill-accelerators=4" in args
    with pytest.raises(Exception, match="needs a transfer agent a rank"):  # on GPUs: not yet
        render({"prefill": {"tensorParallelSize": 2}})
    aggregated = render({"prefill": {"enabled": False}, "decode": {"tensorParallelSize": 8}})
    (c,) = _pod(aggregated, "decode")["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_lws_makes_each_worker_a_group_of_pods() -> None:
    """lws.enabled (ci/lws.yaml): the TP 8 decode pool is a LeaderWorkerSet of two-pod
    groups, four GPUs a pod; the leader runs the worker with the group's flags and
    listens where the other pod's `diptych tp-node` looks; the planner scales the
    LeaderWorkerSet. A pool at TP 1 stays a Deployment; combinations the workers
    refuse fail the render, saying why."""
    import kubernetes_validate

    objs = render({"lws": {"enabled": True, "size": 2}, "prefill": {"enabled": False},
                   "decode": {"tensorParallelSize": 8}})  # fmt: skip
    (lws,) = find(objs, "LeaderWorkerSet", "diptych-decode")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (ranks,) = group["workerTemplate"]["spec"]["containers"]
    for c in (leader, ranks):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    group_flags = {"--tensor-parallel-size=8", "--tensor-parallel-nodes=2",
                   "--tensor-parallel-leader=$(LWS_LEADER_ADDRESS):29500"}  # fmt: skip
    assert group_flags <= set(leader["args"])
    assert {"name": "tp-store", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    assert ranks["args"] == ["tp-node", "--leader=$(LWS_LEADER_ADDRESS):29500",
                             "--node=$(LWS_WORKER_INDEX)"]  # fmt: skip
    for pod in (group["leaderTemplate"], group["workerTemplate"]):  # no schema for the CRD:
        for kube in ("1.30.0", "1.37.0"):  # its pod templates, strictly
            doc = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": "t", "namespace": "llm"}, "template": pod}  # fmt: skip
            kubernetes_validate.validate(doc, kube, strict=True)
    assert not find(objs, "Deployment", "diptych-decode")
    assert "--lws-pools=decode" in _planner_args(objs)
    (role,) = find(objs, "Role", "diptych-planner")
    rule = {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets/scale"],
            "resourceNames": ["diptych-decode"], "verbs": ["get", "patch"]}  # fmt: skip
    assert rule in role["rules"]
    tp1 = render({"lws": {"enabled": True}, "prefill": {"enabled": False}})
    assert find(tp1, "Deployment", "diptych-decode") and not find(tp1, "LeaderWorkerSet")
    with pytest.raises(Exception, match=r"does not split over lws\.size 3"):
        render({"lws": {"enabled": True, "size": 3}, "prefill": {"enabled": False},
                "decode": {"tensorParallelSize": 8}})  # fmt: skip
    with pytest.raises(Exception, match="cannot hand KV over yet"):
        render({"lws": {"enabled": True}, "decode": {"tensorParallelSize": 8}})

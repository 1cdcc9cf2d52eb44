"""The chart's LoRA values (ci/lora.yaml): the worker pods mount the adapters' volume
read-only and run with --enable-lora and its sizes (the shared engine flags), the
frontends name each declared adapter with --lora-modules under the mount, an image
volume works as the source too, and a LoRA fleet above tensor-parallel size 1 is
refused at render (the engine refuses it at start)."""

from __future__ import annotations

import pytest

from tests.deploy.chart import containers, objects, pod_specs, render


def test_workers_mount_the_adapters_and_the_frontend_names_them() -> None:
    objs = objects("lora")
    engine = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"]
                  .endswith("-engine"))["data"]["engine.args"].split("\n")  # fmt: skip
    for flag in ("--enable-lora", "--max-loras 8", "--max-lora-rank 32", "--max-cpu-loras 16"):
        assert flag in engine
    by_name = dict(containers(objs))
    for pool in ("decode", "prefill"):
        mounts = by_name[f"diptych-{pool}"]["volumeMounts"]
        assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in mounts
    volumes = {name: spec.get("volumes", []) for name, spec in pod_specs(objs)}
    claim = {"claimName": "lora-adapters", "readOnly": True}
    assert {"name": "lora-adapters", "persistentVolumeClaim": claim} in volumes["diptych-decode"]
    assert not any(v["name"] == "lora-adapters" for v in volumes["diptych-frontend"])
    args = by_name["diptych-frontend"]["args"]
    assert "--lora-modules=sql-assistant=/adapters/sql-assistant" in args
    assert "--lora-modules=support-bot=/adapters/support/bot-v2" in args


def test_off_by_default() -> None:
    objs = objects("default")
    assert not any("lora" in str(c.get("args", [])) for _, c in containers(objs))
    engine = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"]
                  .endswith("-engine"))["data"]["engine.args"]  # fmt: skip
    assert "--enable-lora" not in engine


def test_an_image_volume_source() -> None:
    image = {"reference": "registry.example/adapters:v3", "pullPolicy": "IfNotPresent"}
    objs = render({"lora": {"enabled": True, "source": "image", "image": image}})
    decode = dict(pod_specs(objs))["diptych-decode"]
    assert {"name": "lora-adapters", "image": image} in decode["volumes"]


def test_lora_above_tensor_parallel_size_one_is_refused() -> None:
    with pytest.raises(Exception, match="LoRA adapters run at tensor parallel size 1"):
        render({"cpuOnly": True, "lora": {"enabled": True, "pvc": {"claimName": "a"}},
                "decode": {"tensorParallelSize": 2}})  # fmt: skip
    with pytest.raises(Exception, match=r"lora\.pvc\.claimName is required"):
        render({"lora": {"enabled": True}})

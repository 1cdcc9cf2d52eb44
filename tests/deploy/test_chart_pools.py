"""What a platform engineer sets per pool reaches the pods it names, and nothing else:
the RDMA device, the update strategy, the size across upgrades, the model's storage,
and the extra pod-spec fields."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.deploy.chart import ROOT, find, objects, render

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

"""Render deploy/helm/diptych offline (helm-python-sdk: Helm's own Go engine, no binary)
for the tests: one value set -> its Kubernetes objects."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "diptych"
# ci/*.yaml, as chart-testing lays them out; "default" is the chart's own values
VALUE_SETS = ("default", *sorted(p.stem for p in (CHART / "ci").glob("*.yaml")))
RELEASE, NAMESPACE = "diptych", "llm"
# objects of CRDs the Kubernetes schemas do not hold (checked by our own assertions)
CRD_KINDS = {"ServiceMonitor", "HTTPRoute", "LeaderWorkerSet"}


def values(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    loaded = yaml.safe_load((CHART / "ci" / f"{name}.yaml").read_text())
    return dict(loaded or {})


@functools.cache
def _render(name: str) -> tuple[tuple[str, str], ...]:
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    out = chart.render(values(name), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return tuple(sorted(out.items()))


def manifests(name: str) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    return dict(_render(name))


def objects(name: str) -> list[dict[str, Any]]:
    """Every Kubernetes object the value set renders."""
    out: list[dict[str, Any]] = []
    for path, text in _render(name):
        if path.endswith(".txt"):
            continue
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every Deployment, StatefulSet and LeaderWorkerSet
    (its leader's as the workload's, its other pods' as "<name>-ranks")."""
    out = []
    for o in objs:
        name = o["metadata"]["name"]
        if o["kind"] in ("Deployment", "StatefulSet"):
            out.append((name, o["spec"]["template"]))
        elif o["kind"] == "LeaderWorkerSet":
            group = o["spec"]["leaderWorkerTemplate"]
            out += [(name, group["leaderTemplate"]), (f"{name}-ranks", group["workerTemplate"])]
    return out


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every pod template (`pod_templates`)."""
    return [(name, t["spec"]) for name, t in pod_templates(objs)]


def containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(workload name, container) of every container and init container."""
    return [
        (name, c)
        for name, spec in pod_specs(objs)
        for c in [*spec.get("initContainers", []), *spec["containers"]]
    ]


def render(given: dict[str, Any], chart: Path = CHART) -> list[dict[str, Any]]:
    """Every Kubernetes object that `given` (values on top of the chart's) renders, as at
    install (offline: Helm's `lookup` finds nothing)."""
    import helm_python as helm

    out = helm.Chart.load(str(chart)).render(
        given, name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if not path.endswith(".txt"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs

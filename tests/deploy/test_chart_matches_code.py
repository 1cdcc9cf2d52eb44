"""The chart cannot drift from the code: every container it renders runs a command line
the real `diptych` parser and config builders accept, with the ports its probes and
Services name; every probe path answers on a live `diptych serve` of that role; and every
metric the Grafana dashboard queries is exported there (scraped here)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.chart import ROOT, VALUE_SETS, find, objects, pod_specs, pod_templates
from tests.e2e.serving import Server, free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "diptych-dashboard.json"
ROLES = ("frontend", "decode", "prefill", "planner")
_ENV = {
    "POD_NAME": "diptych-decode-7d9f-x2x1", "POD_IP": "10.1.2.3",
    # what the LeaderWorkerSet controller puts in its pods' environment
    "LWS_LEADER_ADDRESS": "diptych-decode-0.diptych-decode.llm", "LWS_WORKER_INDEX": "1",
}  # fmt: skip


def _is_diptych(container: dict[str, Any]) -> bool:
    return "/diptych" in container["image"].split("@")[0].split(":")[0]


def _command_line(objs: list[dict[str, Any]], c: dict[str, Any], tmp: Path) -> list[str]:
    """The container's args as the process sees them: $(VAR) from its env (the downward
    API's values made up), @FILE from the ConfigMap mounted there."""
    env = dict(_ENV)
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    out = []
    for arg in [*c.get("command", []), *c["args"]]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        if arg.startswith("@"):
            path = Path(arg[1:])
            assert str(path.parent) in mounts, f"{arg} is not on a mounted volume"
            (cm,) = find(objs, "ConfigMap", _configmap_of(objs, c, mounts[str(path.parent)]))
            local = tmp / path.name
            local.write_text(cm["data"][path.name])
            arg = f"@{local}"
        flag, _, value = arg.partition("=")
        mount = mounts.get(str(Path(value).parent)) if value.startswith("/") else None
        if mount is not None and "secret" in _volume(objs, c, mount):  # a mounted Secret
            local = tmp / Path(value).name
            local.write_text("made-up-secret\n")
            arg = f"{flag}={local}"
        out.append(arg)
    return out


def _volume(objs: list[dict[str, Any]], c: dict[str, Any], name: str) -> dict[str, Any]:
    for _, spec in pod_specs(objs):
        if c in spec["containers"]:
            (v,) = [v for v in spec["volumes"] if v["name"] == name]
            return v
    raise AssertionError(f"no volume {name}")


def _configmap_of(objs: list[dict[str, Any]], c: dict[str, Any], volume: str) -> str:
    return str(_volume(objs, c, volume)["configMap"]["name"])


def _configure(role: str, args: Any) -> None:
    """Build the role's settings the way its process does (they validate the flags)."""
    from diptych import options
    from diptych.planner_options import planner_config

    build = {
        "frontend": options.frontend_config,
        "decode": options.decode_config,
        "prefill": options.prefill_config,
        "planner": planner_config,
    }
    build[role](args)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_runs_a_command_line_the_code_accepts(
    value_set: str, tmp_path: Path
) -> None:
    from diptych.cli import build_parser

    objs = objects(value_set)
    seen = set()
    leaders: set[str] = set()  # where the tp-node pods look for rank 0
    stores: set[str] = set()  # where the workers' rank 0 listens
    for workload, spec in pod_specs(objs):
        for c in spec["containers"]:
            if not _is_diptych(c):
                continue
            argv = _command_line(objs, c, tmp_path)
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{value_set}: {workload}: diptych rejects {argv}")
            role = args.command
            if role == "tp-node":  # a LeaderWorkerSet group's other pod: only its ranks
                assert c["name"].endswith("-ranks") and "ports" not in c, workload
                assert args.node == int(_ENV["LWS_WORKER_INDEX"])
                leaders.add(args.leader)
                continue
            assert role in ROLES and c["name"] == role, (workload, role)
            seen.add(role)
            _configure(role, args)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            leader = getattr(args, "tensor_parallel_leader", "") or ":0"
            bound = {"http": getattr(args, "port", None), "grpc": getattr(args, "port", None),
                     "metrics": getattr(args, "metrics_port", None),
                     "tp-store": int(leader.rpartition(":")[2])}  # fmt: skip
            if leader != ":0":
                stores.add(leader)
            for name, number in ports.items():
                assert bound[name] == number, f"{workload}: port {name} {number} vs {bound}"
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                get = c[probe]["httpGet"]
                assert get["port"] in ports, f"{workload}: {probe} on unknown port {get['port']}"
                assert get["path"] in PROBE_PATHS[role], f"{workload}: {probe} {get['path']}"
            if role in ("decode", "prefill"):
                assert args.host == "0.0.0.0" and args.advertise_host == _ENV["POD_IP"]
                assert args.worker_id == _ENV["POD_NAME"]  # unique per pod
    assert seen >= {"frontend", "decode"}, seen
    assert leaders <= stores, (leaders, stores)
    for svc in find(objs, "Service"):
        _service_targets_a_named_port(objs, svc)


def _service_targets_a_named_port(objs: list[dict[str, Any]], svc: dict[str, Any]) -> None:
    sel = svc["spec"]["selector"]
    pods = [s for _, s in pod_specs(objs)
            if sel.items() <= _labels_of(objs, s).items()]  # fmt: skip
    assert pods, f"Service {svc['metadata']['name']} selects no pod"
    names = {p["name"] for s in pods for c in s["containers"] for p in c.get("ports", [])}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def _labels_of(objs: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, str]:
    for _, template in pod_templates(objs):
        if template["spec"] is spec:
            return dict(template["metadata"]["labels"])
    return {}


# The paths the chart probes, per role; the live test below shows each one answers 200
# on a running process of that role.
PROBE_PATHS = {
    "frontend": {"/health", "/ready"},
    "decode": {"/health", "/ready"},
    "prefill": {"/health", "/ready"},
    "planner": {"/health"},
}


def test_the_probe_table_is_what_the_chart_probes() -> None:
    used: dict[str, set[str]] = {r: set() for r in ROLES}
    for value_set in VALUE_SETS:
        for _, spec in pod_specs(objects(value_set)):
            for c in spec["containers"]:
                if _is_diptych(c) and c["args"][0] != "tp-node":  # (it serves nothing)
                    role = c["args"][0]
                    used[role] |= {c[p]["httpGet"]["path"] for p in
                                   ("startupProbe", "livenessProbe", "readinessProbe")}  # fmt: skip
    assert used == PROBE_PATHS


# -- live: a real `diptych serve` (simulated engine: the same processes and metrics) -------

PROMPT = " ".join(f"word{i}" for i in range(200))  # over 128 tokens: a remote prefill


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    planner_port = free_port()
    server = Server(
        tmp_path_factory.mktemp("serve-chart"),
        "--engine", "sim", "--profile", "fixed:5ms", "--sim-mean-output-tokens", "0",
        "--planner", "--dry-run", "--planner-interval", "1",
        "--planner-port", str(planner_port),
    )  # fmt: skip
    yield server, f"http://127.0.0.1:{planner_port}"
    assert server.stop() == 0


def _role_urls(server: Server, planner: str) -> dict[str, list[str]]:
    manifest = server.manifest
    urls: dict[str, list[str]] = {"frontend": [server.url], "planner": [planner]}
    for child, details in manifest.items():
        for role in ("decode", "prefill"):
            if child.startswith(role + "-") and isinstance(details, dict):
                urls.setdefault(role, []).append(f"http://{details['metrics']}")
    return urls


def _traffic(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for stream in (False, True):
            body = {"model": "Llama-3.1-8B", "prompt": PROMPT, "max_tokens": 8,
                    "temperature": 0, "stream": stream}  # fmt: skip
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        bad = client.post("/v1/completions", json={"model": "Llama-3.1-8B", "max_tokens": -1})
        assert bad.status_code == 400


def _exported(urls: dict[str, list[str]]) -> set[str]:
    names = set()
    for role_urls in urls.values():
        for u in role_urls:
            text = httpx.get(u + "/metrics", timeout=10).text
            names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                      if line and not line.startswith("#")}  # fmt: skip
    return names


def test_every_probe_path_answers_on_its_live_role(fleet: Any) -> None:
    server, planner = fleet
    urls = _role_urls(server, planner)
    assert set(urls) == set(ROLES), urls
    for role, paths in PROBE_PATHS.items():
        for u in urls[role]:
            for path in paths:
                r = httpx.get(u + path, timeout=10)
                assert r.status_code == 200, (role, u + path, r.status_code, r.text)
    # a path no role serves is a 404, not a metrics page (a typo in a probe would show)
    worker = urls["decode"][0]
    assert httpx.get(worker + "/healthz", timeout=10).status_code == 404


def _dashboard_metrics() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(doc["panels"])
    assert exprs, "the dashboard has no queries"
    return {m for e in exprs for m in re.findall(r"\bdiptych_[a-z0-9_]+", e)}


def test_every_metric_the_dashboard_queries_is_exported(fleet: Any) -> None:
    server, planner = fleet
    urls = _role_urls(server, planner)
    _traffic(server.url)
    wanted = _dashboard_metrics()
    end = time.monotonic() + 60
    while True:  # a planner tick and the workers' load reports land within seconds
        missing = wanted - _exported(urls)
        if not missing or time.monotonic() > end:
            break
        time.sleep(1)
    assert not missing, sorted(missing)

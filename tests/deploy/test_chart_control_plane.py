"""The chart's bundled NATS and etcd run as rendered: real nats-server and etcd processes
started from the rendered configuration, with the certificates and password the chart
made, and Diptych's own clients dialling the URLs the chart gives the pods. Only the
in-cluster names are swapped for loopback ports and the mount paths for directories here.
A client without the chart's certificate, or NATS without the password, is refused.
"""

from __future__ import annotations

import base64
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.config import make_discovery
from runtime.discovery import DiscoveryOptions
from runtime.errors import BackendUnavailable, ControlPlaneError
from runtime.worker_info import WorkerInfo
from tests.deploy.chart import containers, find, objects
from tests.runtime.rt_helpers import queue, request
from tests.servers import _binary, _port_open, free_port

VALUE_SET = "everything-on"  # a 3-member etcd: peer TLS too
CLIENT_DIR = "/etc/diptych/control-plane"


def _secret(objs: list[dict[str, Any]], name: str, into: Path) -> dict[str, bytes]:
    (secret,) = find(objs, "Secret", name)
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    into.mkdir(parents=True, exist_ok=True)
    for k, v in files.items():
        (into / k).write_bytes(v)
        (into / k).chmod(0o400)
    return files


def _args(objs: list[dict[str, Any]], workload: str) -> list[str]:
    (c,) = [c for name, c in containers(objs) if name == workload and c["name"] != "model"]
    return [*c.get("command", []), *c.get("args", [])]


@dataclass
class Rendered:
    objs: list[dict[str, Any]]
    root: Path
    nats_port: int
    etcd_ports: list[int]
    probe_ports: list[int]
    decode_args: list[str]

    def url(self, flag: str) -> str:
        (value,) = [a.split("=", 1)[1] for a in self.decode_args if a.startswith(f"--{flag}=")]
        value = value.replace(CLIENT_DIR, str(self.root / "client"))
        value = value.replace("diptych-nats:4222", f"localhost:{self.nats_port}")
        etcd = ",".join(f"127.0.0.1:{p}" for p in self.etcd_ports)
        return value.replace("diptych-etcd:2379", etcd)


def _start(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait(ok: Any, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    import time

    end = time.monotonic() + 30
    while time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            break
        if ok():
            return
        time.sleep(0.1)
    tails = "\n".join(f"{log.name}:\n{log.read_text(errors='replace')[-2000:]}" for log in logs)
    pytest.fail(f"the rendered brokers did not come up:\n{tails}")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rendered]:
    objs = objects(VALUE_SET)
    root = tmp_path_factory.mktemp("chart-brokers")
    _secret(objs, "diptych-control-plane-client", root / "client")
    nats = _secret(objs, "diptych-nats-server-tls", root / "nats-tls")
    _secret(objs, "diptych-etcd-server-tls", root / "etcd-tls")
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    # NATS: the rendered nats.conf, loopback port, store and TLS paths here
    assert _args(objs, "diptych-nats")[-1] == "--config=/etc/nats/tls/nats.conf"
    nats_port, monitor = free_port(), free_port()
    conf = nats["nats.conf"].decode()
    conf = conf.replace("port: 4222", f"host: 127.0.0.1\nport: {nats_port}")
    conf = conf.replace("http_port: 8222", f"http: 127.0.0.1:{monitor}")
    conf = conf.replace("/etc/nats/tls", str(root / "nats-tls"))
    conf = conf.replace("store_dir: /data", f"store_dir: {root / 'nats-data'}")
    (root / "nats.conf").write_text(conf)
    logs.append(root / "nats.log")
    nats_argv = [_binary("nats-server", "nats-server"), "-c", str(root / "nats.conf")]
    procs.append(_start(nats_argv, logs[-1], env={"POD_NAME": "diptych-nats-0"}))

    # etcd: each member's rendered command line, with loopback ports for its three URLs
    members = int(find(objs, "StatefulSet", "diptych-etcd")[0]["spec"]["replicas"])
    ports = [(free_port(), free_port(), free_port()) for _ in range(members)]
    command = _args(objs, "diptych-etcd")
    for i in range(members):
        argv = []
        for a in command:
            a = a.replace("$(POD_NAME)", f"diptych-etcd-{i}")
            a = a.replace("/etc/etcd/tls", str(root / "etcd-tls"))
            a = a.replace("/var/run/etcd/data", str(root / f"etcd-{i}"))
            for j, (client, peer, _) in enumerate(ports):
                host = f"diptych-etcd-{j}.diptych-etcd-peers.llm.svc"
                a = a.replace(f"{host}:2379", f"127.0.0.1:{client}")
                a = a.replace(f"{host}:2380", f"127.0.0.1:{peer}")
            for k, port in zip((2379, 2380, 2381), ports[i], strict=True):
                a = a.replace(f"0.0.0.0:{k}", f"127.0.0.1:{port}")
            argv.append(a)
        argv[0] = _binary("etcd", "etcd-server")
        logs.append(root / f"etcd-{i}.log")
        procs.append(_start(argv, logs[-1]))

    def up() -> bool:
        if not _port_open(nats_port) or "Server is ready" not in logs[0].read_text():
            return False
        return all(_get(f"http://127.0.0.1:{m}/health")[0] == 200 for _, _, m in ports)

    try:
        _wait(up, procs, logs)
        yield Rendered(
            objs,
            root,
            nats_port,
            [c for c, _, _ in ports],
            [m for _, _, m in ports],
            _args(objs, "diptych-decode"),
        )
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def test_the_pods_dial_the_bundled_brokers_over_tls_with_the_charts_credentials() -> None:
    objs = objects("default")
    for name in ("diptych-decode", "diptych-prefill", "diptych-frontend", "diptych-planner"):
        args = _args(objs, name)
        etcd = [a for a in args if a.startswith("--etcd=")]
        assert etcd == [
            f"--etcd=etcds://diptych-etcd:2379?ca={CLIENT_DIR}/ca.crt"
            f"&cert={CLIENT_DIR}/tls.crt&key={CLIENT_DIR}/tls.key"
        ], name
        for a in args:
            if a.startswith("--nats="):
                assert a.startswith("--nats=tls://diptych@diptych-nats:4222?")
                assert f"password_file={CLIENT_DIR}/nats-password" in a
    for spec in [o["spec"]["template"]["spec"] for o in find(objs, "Deployment")]:
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["control-plane"]["secret"]["secretName"] == "diptych-control-plane-client"
    for broker in ("diptych-nats", "diptych-etcd"):
        (sts,) = find(objs, "StatefulSet", broker)
        vols = sts["spec"]["template"]["spec"]["volumes"]
        assert vols == [{"name": "tls", "secret": {
            "secretName": f"{broker}-server-tls", "defaultMode": 0o400}}]  # fmt: skip
        assert "checkov.io/skip1" not in sts["metadata"].get("annotations", {})
    # the CA's key is in no pod
    mounted = {v["secret"]["secretName"] for _, s in [(0, o["spec"]["template"]["spec"])
               for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
               for v in s.get("volumes", []) if "secret" in v}  # fmt: skip
    assert "diptych-control-plane-ca" not in mounted


def test_the_server_certificates_name_every_address_they_are_dialled_at() -> None:
    objs = objects(VALUE_SET)

    def names(secret: str) -> set[str]:
        (s,) = find(objs, "Secret", secret)
        pem = base64.b64decode(s["data"]["tls.crt"])
        cmd = ["openssl", "x509", "-noout", "-ext", "subjectAltName,extendedKeyUsage"]
        text = subprocess.run(cmd, input=pem, capture_output=True, check=True).stdout.decode()
        assert "TLS Web Server Authentication" in text and "TLS Web Client Authentication" in text
        return set(re.findall(r"DNS:([^,\s]+)", text))

    nats = names("diptych-nats-server-tls")
    assert {"diptych-nats", "diptych-nats.llm.svc.cluster.local"} <= nats
    etcd = names("diptych-etcd-server-tls")
    assert {"diptych-etcd", "*.diptych-etcd-peers.llm.svc"} <= etcd  # clients and members


async def test_the_queue_works_through_the_rendered_url_and_nothing_else(
    rendered: Rendered,
) -> None:
    good = rendered.url("nats")
    async with queue(good, "chart") as q:
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=5.0)
        await d.ack()
    client = rendered.root / "client"
    port = rendered.nats_port
    cert = f"ca={client}/ca.crt&cert={client}/tls.crt&key={client}/tls.key"
    refused = [
        f"tls://localhost:{port}?{cert}",  # no password
        f"tls://diptych:guess@localhost:{port}?{cert}",  # a wrong one
        f"tls://diptych@localhost:{port}?ca={client}/ca.crt"  # no client certificate
        f"&password_file={client}/nats-password",
        f"nats://localhost:{port}",  # plain
    ]
    for url in refused:
        with pytest.raises(BackendUnavailable):
            async with queue(url, "chart", publish_timeout=1.0):
                pass


async def test_discovery_works_through_the_rendered_url_and_nothing_else(
    rendered: Rendered,
) -> None:
    options = DiscoveryOptions(namespace="chart", op_timeout=3.0)
    async with make_discovery(rendered.url("etcd"), options) as d:
        await d.register(WorkerInfo("w-1", "decode", "m"))
        assert [w.worker_id for w in await d.list("decode")] == ["w-1"]
    client = rendered.root / "client"
    first = rendered.etcd_ports[0]
    for url in (
        f"etcds://127.0.0.1:{first}?ca={client}/ca.crt",  # no client certificate
        f"etcd://127.0.0.1:{first}",  # plain
    ):
        with pytest.raises(ControlPlaneError):
            async with make_discovery(url, options) as d:
                await d.list("decode")


def test_the_probes_answer_on_their_plain_port(rendered: Rendered) -> None:
    (sts,) = find(rendered.objs, "StatefulSet", "diptych-etcd")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert all(c[p]["httpGet"]["port"] == "probe" for p in ("livenessProbe", "readinessProbe"))
    metrics = [a for a in c["command"] if a.startswith("--listen-metrics-urls=")]
    assert metrics == ["--listen-metrics-urls=http://0.0.0.0:2381"]
    port = rendered.probe_ports[0]
    for path in paths:
        status, body = _get(f"http://127.0.0.1:{port}{path}")
        assert status == 200 and b'"health":"true"' in body, (path, status, body)


async def test_the_workers_grpc_runs_over_mutual_tls_with_the_rendered_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runtime.rpc import GenerateError, auth
    from runtime.rpc.client import DecodeWorkerClient
    from tests.runtime.rt_helpers import ScriptedHandler, serve

    objs = objects("default")
    for name, spec in [(o["metadata"]["name"], o["spec"]["template"]["spec"])
                       for o in find(objs, "Deployment")]:  # fmt: skip
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert env["DIPTYCH_GRPC_TLS_DIR"] == mounts["grpc-tls"] == "/etc/diptych/grpc-tls", name
    (volume,) = [v for v in spec["volumes"] if v["name"] == "grpc-tls"]
    data = _secret(objs, volume["secret"]["secretName"], tmp_path / "secret")
    files = {item["path"]: data[item["key"]] for item in volume["secret"]["items"]}
    rendered = (files["ca.pem"], files["cert.pem"], files["key.pem"])
    monkeypatch.setattr(auth, "_tls_files", lambda: rendered)
    async with serve(ScriptedHandler()) as (server, client):
        assert (await client.health()).worker_id == "w0"
        monkeypatch.setattr(auth, "_tls_files", lambda: None)  # a pod without the files
        stranger = DecodeWorkerClient(server.address)
        await stranger.connect(wait=False)
        try:
            with pytest.raises(GenerateError):
                await stranger.health(timeout=2.0)
        finally:
            await stranger.close()

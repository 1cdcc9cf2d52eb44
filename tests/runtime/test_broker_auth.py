"""The brokers with authentication and TLS: real nats-server and etcd started by the test,
with certificates the test makes (a CA, a server certificate for 127.0.0.1, a client
certificate). The prefill queue and discovery work through URLs that carry the
credentials and TLS files; without them, or with a wrong password, they are refused.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.config import make_discovery, parse_url
from runtime.discovery import DiscoveryOptions
from runtime.errors import BackendUnavailable, ControlPlaneError
from runtime.worker_info import WorkerInfo
from tests.runtime.rt_helpers import queue, request
from tests.servers import EtcdServer, NatsServer, _port_open


def _pki(d: Path) -> dict[str, Path]:
    """ca.pem, server.pem/.key (IP 127.0.0.1), client.pem/.key, all signed by the CA."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):  # fmt: skip
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
            "-out", f"{name}.pem")  # fmt: skip
    return {n: d / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _pki(tmp_path_factory.mktemp("pki"))


class SecureNats(NatsServer):
    """JetStream with a user and password, over TLS that requires a client certificate."""

    def __init__(self, name: str, data_dir: Path, pki: dict[str, Path]) -> None:
        super().__init__(name, data_dir)
        self.conf = data_dir.parent / f"{name}.conf"
        self.conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f'jetstream {{ store_dir: "{data_dir}" }}\n'
            'authorization { users = [ { user: "diptych", password: "s3cret" } ] }\n'
            f'tls {{ cert_file: "{pki["server.pem"]}", key_file: "{pki["server.key"]}", '
            f'ca_file: "{pki["ca.pem"]}", verify: true }}\n'
        )

    def argv(self) -> list[str]:
        return [super().argv()[0], "-c", str(self.conf)]


class SecureEtcd(EtcdServer):
    """etcd serving clients over TLS with client certificates required."""

    def __init__(self, name: str, data_dir: Path, pki: dict[str, Path]) -> None:
        super().__init__(name, data_dir)
        self.pki = pki

    def argv(self) -> list[str]:
        client = f"https://127.0.0.1:{self.port}"
        argv = [a.replace(f"http://127.0.0.1:{self.port}", client) for a in super().argv()]
        return [*argv, "--client-cert-auth", "--trusted-ca-file", str(self.pki["ca.pem"]),
                "--cert-file", str(self.pki["server.pem"]),
                "--key-file", str(self.pki["server.key"])]  # fmt: skip

    def ready(self) -> bool:
        return _port_open(self.port) and "elected leader" in self.log_tail(200)


def _tls(pki: dict[str, Path]) -> str:
    return f"ca={pki['ca.pem']}&cert={pki['client.pem']}&key={pki['client.key']}"


@pytest.fixture(scope="module")
def nats_tls(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[int]:
    server = SecureNats("nats-tls", tmp_path_factory.mktemp("nats-tls") / "js", pki)
    server.start()
    yield server.port
    server.stop()


async def test_the_queue_over_tls_with_a_password(nats_tls: int, pki: dict[str, Path]) -> None:
    good = f"tls://diptych:s3cret@127.0.0.1:{nats_tls}?{_tls(pki)}"
    assert "s3cret" not in str(parse_url(good))
    async with queue(good, "auth") as q:
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=5.0)
        await d.ack()
    password_file = pki["ca.pem"].parent / "nats-password"
    password_file.write_text("s3cret\n")
    via_file = f"tls://diptych@127.0.0.1:{nats_tls}?{_tls(pki)}&password_file={password_file}"
    async with queue(via_file, "auth") as q:
        assert (await q.depth()).pending == 0
    refused = [
        f"tls://diptych:wrong@127.0.0.1:{nats_tls}?{_tls(pki)}",  # a wrong password
        f"tls://127.0.0.1:{nats_tls}?{_tls(pki)}",  # none
        f"nats://diptych:s3cret@127.0.0.1:{nats_tls}",  # no TLS
        f"tls://diptych:s3cret@127.0.0.1:{nats_tls}?ca={pki['ca.pem']}",  # no client cert
    ]
    for url in refused:
        with pytest.raises(BackendUnavailable):
            async with queue(url, "auth", publish_timeout=3.0):
                pass


async def test_discovery_over_tls_with_a_client_certificate_and_a_user(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    server = SecureEtcd("etcd-tls", tmp_path / "etcd", pki)
    server.start()
    try:
        base = f"127.0.0.1:{server.port}?{_tls(pki)}"
        await _enable_auth(server.port, pki)
        options = DiscoveryOptions(namespace="auth", op_timeout=3.0)
        async with make_discovery(f"etcds://root:rootpw@{base}", options) as d:
            await d.register(WorkerInfo("w-1", "decode", "m"))
            assert [w.worker_id for w in await d.list("decode")] == ["w-1"]
        for url in (f"etcds://root:wrong@{base}", f"etcds://{base}",
                    f"etcd://root:rootpw@127.0.0.1:{server.port}"):  # fmt: skip
            with pytest.raises(ControlPlaneError):
                async with make_discovery(url, options) as d:
                    await d.list("decode")
    finally:
        server.stop()


async def _enable_auth(port: int, pki: dict[str, Path]) -> None:
    """A root user with a password, then authentication on (what etcdctl would do)."""
    import aetcd.rpc as rpc

    creds = grpc.ssl_channel_credentials(
        pki["ca.pem"].read_bytes(), pki["client.key"].read_bytes(), pki["client.pem"].read_bytes()
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        stub = rpc.AuthStub(channel)
        await stub.UserAdd(rpc.AuthUserAddRequest(name="root", password="rootpw"))
        await stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await stub.AuthEnable(rpc.AuthEnableRequest())

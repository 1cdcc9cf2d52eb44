"""The brokers with authentication and TLS: real nats-server and etcd started by the test,
with certificates the test makes (a CA, a server certificate for 127.0.0.1, a client
certificate). The prefill queue and discovery work through URLs that carry the
credentials and TLS files; without them, or with a wrong password, they are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.config import make_discovery, parse_url
from runtime.discovery import DiscoveryOptions
from runtime.errors import BackendUnavailable, ControlPlaneError
from runtime.worker_info import WorkerInfo
from tests.runtime.rt_helpers import queue, request
from tests.secure_servers import SecureEtcd, SecureNats, make_pki, tls_query


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def nats_tls(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[int]:
    server = SecureNats("nats-tls", tmp_path_factory.mktemp("nats-tls") / "js", pki)
    server.start()
    yield server.port
    server.stop()


async def test_the_queue_over_tls_with_a_password(nats_tls: int, pki: dict[str, Path]) -> None:
    good = f"tls://diptych:s3cret@127.0.0.1:{nats_tls}?{tls_query(pki)}"
    assert "s3cret" not in str(parse_url(good))
    async with queue(good, "auth") as q:
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=5.0)
        await d.ack()
    password_file = pki["ca.pem"].parent / "nats-password"
    password_file.write_text("s3cret\n")
    via_file = f"tls://diptych@127.0.0.1:{nats_tls}?{tls_query(pki)}&password_file={password_file}"
    async with queue(via_file, "auth") as q:
        assert (await q.depth()).pending == 0
    refused = [
        f"tls://diptych:wrong@127.0.0.1:{nats_tls}?{tls_query(pki)}",  # a wrong password
        f"tls://127.0.0.1:{nats_tls}?{tls_query(pki)}",  # none
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
        base = f"127.0.0.1:{server.port}?{tls_query(pki)}"
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

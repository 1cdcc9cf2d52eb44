"""nats-server and etcd with authentication and TLS, on certificates the test makes
(openssl): a CA, a server certificate for 127.0.0.1 and localhost, a client certificate."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.servers import EtcdServer, NatsServer, _port_open


def make_pki(d: Path) -> dict[str, Path]:
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


USER, PASSWORD = "diptych", "s3cret"


def tls_query(pki: dict[str, Path]) -> str:
    """A broker URL's options for TLS with the client certificate."""
    return f"ca={pki['ca.pem']}&cert={pki['client.pem']}&key={pki['client.key']}"


class SecureNats(NatsServer):
    """JetStream with a user and password, over TLS that requires a client certificate."""

    def __init__(self, name: str, data_dir: Path, pki: dict[str, Path]) -> None:
        super().__init__(name, data_dir)
        self.pki = pki
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

    @property
    def url(self) -> str:
        """What a Diptych process dials: the password from a file, never on its argv."""
        password_file = self.data_dir.parent / f"{self.name}.password"
        password_file.write_text(PASSWORD + "\n")
        query = f"{tls_query(self.pki)}&password_file={password_file}"
        return f"tls://{USER}@127.0.0.1:{self.port}?{query}"


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

    @property
    def url(self) -> str:
        return f"etcds://127.0.0.1:{self.port}?{tls_query(self.pki)}"

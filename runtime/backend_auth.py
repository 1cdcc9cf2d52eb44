"""Credentials and TLS for the brokers (NATS, etcd), as written in their URLs.

    nats://user:pass@host:4222           user and password
    nats://TOKEN@host:4222               a NATS token
    tls://host:4222?ca=/ca.pem           NATS over TLS, the server verified against ca.pem
    nats://host?creds=/user.creds        a NATS credentials file (JWT and NKey seed)
    nats://host?nkey=/user.nk            an NKey seed file
    etcd://user:pass@host:2379           etcd's user and password
    etcds://host:2379?ca=/ca.pem&cert=/client.pem&key=/client.key
                                         etcd over TLS with a client certificate

``cert`` and ``key`` give a client certificate for mutual TLS on either; ``ca``, ``cert``
or ``key`` also turn TLS on for a ``nats://`` or ``etcd://`` URL. A password in a URL is
seen by ``ps``: ``password_file=/path`` reads it from a file instead (what the Helm chart
mounts from a Secret). A URL prints with its password hidden.
"""

from __future__ import annotations

import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import ConfigError

_QUERY_KEYS = {
    "nats": ("ca", "cert", "key", "creds", "nkey", "password_file"),
    "etcd": ("ca", "cert", "key", "password_file"),
}


@dataclass(frozen=True)
class BackendAuth:
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = field(default=None, repr=False)  # NATS: user@ without a password
    creds_file: str | None = None  # NATS: a .creds file
    nkey_file: str | None = None  # NATS: an NKey seed

    @property
    def empty(self) -> bool:
        return self == BackendAuth()

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (verifying the server), or None without TLS."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def pem(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(ca, cert, key) file contents, for gRPC's credentials (etcd)."""
        return tuple(  # type: ignore[return-value]
            Path(p).read_bytes() if p else None
            for p in (self.ca_file, self.cert_file, self.key_file)
        )

    def suffix(self) -> str:
        """The query string that rebuilds this (no password in it)."""
        pairs = [
            (k, v)
            for k, v in (
                ("ca", self.ca_file),
                ("cert", self.cert_file),
                ("key", self.key_file),
                ("creds", self.creds_file),
                ("nkey", self.nkey_file),
            )
            if v
        ]
        return "?" + urllib.parse.urlencode(pairs) if pairs else ""


def split_auth(scheme: str, rest: str, url: str) -> tuple[str, BackendAuth]:
    """(the endpoints part of ``rest``, the credentials around it) for a broker URL whose
    scheme is ``nats``, ``tls`` (NATS over TLS), ``etcd`` or ``etcds``."""
    kind = "nats" if scheme in ("nats", "tls") else "etcd"
    rest, _, query = rest.partition("?")
    user = password = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, _, pw = userinfo.partition(":")
        user = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if pw else None
        if user is None:
            raise ConfigError(f"{redact(url)}: a password needs a user name")
    params: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in _QUERY_KEYS[kind]:
            raise ConfigError(
                f"{redact(url)}: unknown option {key!r}; {kind} takes "
                + ", ".join(_QUERY_KEYS[kind])
            )
        params[key] = value
    if "password_file" in params:
        if password is not None:
            raise ConfigError(f"{redact(url)}: give a password or password_file, not both")
        try:
            password = Path(params["password_file"]).read_text().strip()
        except OSError as e:
            raise ConfigError(f"{redact(url)}: cannot read password_file: {e}") from None
        if user is None:
            raise ConfigError(f"{redact(url)}: password_file needs a user name (user@host)")
    token = None
    if user is not None and password is None:
        if kind == "etcd":
            raise ConfigError(f"{redact(url)}: an etcd user needs a password (or password_file)")
        token, user = user, None  # nats://TOKEN@host
    for key in ("ca", "cert", "key", "creds", "nkey"):
        if key in params and not Path(params[key]).is_file():
            raise ConfigError(f"{redact(url)}: {key} file {params[key]!r} does not exist")
    if ("cert" in params) != ("key" in params):
        raise ConfigError(f"{redact(url)}: a client certificate needs both cert and key")
    tls = scheme in ("tls", "etcds") or any(k in params for k in ("ca", "cert", "key"))
    auth = BackendAuth(
        user=user,
        password=password,
        tls=tls,
        ca_file=params.get("ca"),
        cert_file=params.get("cert"),
        key_file=params.get("key"),
        token=token,
        creds_file=params.get("creds"),
        nkey_file=params.get("nkey"),
    )
    return rest, auth


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.partition("?")[0]:
        return url
    userinfo, _, tail = rest.partition("?")[0].rpartition("@")
    query = rest.partition("?")[2]
    user = userinfo.partition(":")[0]
    shown = f"{user}:***" if ":" in userinfo else "***"  # no colon: a NATS token
    return f"{scheme}://{shown}@{tail}" + (f"?{query}" if query else "")

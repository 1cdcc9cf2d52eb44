"""Backend URLs and the factories that turn them into discovery and queue clients.

Accepted URLs::

    etcd://host:port[,host:port...]      discovery on an etcd cluster (etcds://: over TLS)
    nats://host:port[,host:port...]      prefill queue on NATS JetStream (tls://: over TLS)
    embedded                             either, on this host, in the default state directory
    embedded:/path/to/state              either, on this host, in that directory

Broker URLs take credentials and TLS files (``user:pass@``, ``?ca=&cert=&key=``, NATS
``?creds=`` and ``?nkey=``): see ``runtime/backend_auth.py``.

All processes of one ``diptych serve`` must name the same state directory. The default is
``$DIPTYCH_STATE_DIR``, else ``~/.cache/diptych/state``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.backend_auth import BackendAuth, redact, split_auth
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.discovery import Discovery, DiscoveryOptions
    from runtime.queue import PrefillQueue, QueueOptions

DEFAULT_PORTS = {"etcd": 2379, "nats": 4222}
_TLS_SCHEMES = {"tls": "nats", "etcds": "etcd"}
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
ENV_DISCOVERY_URL = "DIPTYCH_DISCOVERY_URL"
ENV_QUEUE_URL = "DIPTYCH_QUEUE_URL"
ENV_NAMESPACE = "DIPTYCH_NAMESPACE"
ENV_STATE_DIR = "DIPTYCH_STATE_DIR"


def default_state_dir() -> Path:
    env = os.environ.get(ENV_STATE_DIR)
    return Path(env) if env else Path.home() / ".cache" / "diptych" / "state"


@dataclass(frozen=True)
class BackendUrl:
    scheme: str  # "etcd", "nats", "embedded" or "kubernetes"
    endpoints: tuple[tuple[str, int], ...] = ()
    state_dir: Path | None = None
    k8s_namespace: str | None = None  # kubernetes: None is the pod's own
    auth: BackendAuth = field(default_factory=BackendAuth)  # etcd, nats: credentials, TLS

    def __str__(self) -> str:
        """The URL, its password hidden."""
        if self.scheme == "embedded":
            return f"embedded:{self.state_dir}"
        if self.scheme == "kubernetes":
            return f"kubernetes://{self.k8s_namespace or ''}"
        scheme = {"nats": "tls", "etcd": "etcds"}[self.scheme] if self.auth.tls else self.scheme
        user = "***" if self.auth.token else ("" if self.auth.user is None else self.auth.user)
        if self.auth.user and self.auth.password is not None:
            user += ":***"
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{scheme}://" + (f"{user}@" if user else "") + hosts + self.auth.suffix()


def parse_url(url: str) -> BackendUrl:
    """Parse a backend URL; raises :class:`ConfigError` explaining what is accepted."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("a backend URL must be a non-empty string")
    url = url.strip()
    if url == "embedded" or url.startswith("embedded:"):
        rest = url[len("embedded:") :] if url != "embedded" else ""
        if rest.startswith("//"):
            rest = rest[2:]
        return BackendUrl(
            "embedded", state_dir=Path(rest).expanduser() if rest else default_state_dir()
        )
    scheme, sep, rest = url.partition("://")
    if scheme == "kubernetes" and sep:
        namespace = rest.strip("/")
        if namespace and not _K8S_NAME.fullmatch(namespace):
            raise ConfigError(f"{namespace!r} in {url!r} is not a Kubernetes namespace name")
        return BackendUrl("kubernetes", k8s_namespace=namespace or None)
    if not sep or (scheme not in DEFAULT_PORTS and scheme not in _TLS_SCHEMES):
        raise ConfigError(
            f"unsupported backend URL {redact(url)!r}: use etcd://host:port, "
            "nats://host:port (etcds://, tls:// over TLS), kubernetes://[namespace], "
            "'embedded' or 'embedded:/state/dir'"
        )
    hosts, auth = split_auth(scheme, rest, url)
    kind = _TLS_SCHEMES.get(scheme, scheme)
    shown = redact(url)
    endpoints = tuple(_endpoint(part, DEFAULT_PORTS[kind], shown) for part in hosts.split(","))
    return BackendUrl(kind, endpoints=endpoints, auth=auth)


def _endpoint(part: str, default_port: int, url: str) -> tuple[str, int]:
    part = part.strip().rstrip("/")
    if not part or "/" in part or "?" in part or "@" in part:
        raise ConfigError(f"bad endpoint {part!r} in {url!r}: expected host[:port]")
    if part.startswith("["):  # [ipv6]:port
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    elif part.count(":") == 1:
        host, _, port = part.partition(":")
    else:
        host, port = part, ""
    if not host:
        raise ConfigError(f"bad endpoint {part!r} in {url!r}: empty host")
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad port {port!r} in {url!r}")
    return host, int(port)


def make_discovery(url: str | BackendUrl, options: DiscoveryOptions | None = None) -> Discovery:
    """A discovery client for ``url``; call ``await d.connect()`` (or ``async with d``)."""
    from runtime.discovery import DiscoveryOptions, EmbeddedDiscovery, EtcdDiscovery

    parsed = url if isinstance(url, BackendUrl) else parse_url(url)
    options = options or DiscoveryOptions()
    if parsed.scheme == "etcd":
        return EtcdDiscovery(list(parsed.endpoints), options, parsed.auth)
    if parsed.scheme == "embedded":
        assert parsed.state_dir is not None
        return EmbeddedDiscovery(parsed.state_dir, options)
    if parsed.scheme == "kubernetes":
        from runtime.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery(options, parsed.k8s_namespace)
    raise ConfigError(
        f"{parsed} is not a discovery backend: use etcd://, kubernetes:// or embedded"
    )


def make_prefill_queue(url: str | BackendUrl, options: QueueOptions | None = None) -> PrefillQueue:
    """A prefill-queue client for ``url``; call ``await q.connect()`` (or ``async with q``)."""
    from runtime.queue import EmbeddedPrefillQueue, JetStreamPrefillQueue, QueueOptions

    parsed = url if isinstance(url, BackendUrl) else parse_url(url)
    options = options or QueueOptions()
    if parsed.scheme == "nats":
        return JetStreamPrefillQueue(list(parsed.endpoints), options, parsed.auth)
    if parsed.scheme == "embedded":
        assert parsed.state_dir is not None
        return EmbeddedPrefillQueue(parsed.state_dir, options)
    raise ConfigError(f"{parsed} is not a queue backend: use nats:// or embedded")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where a process finds the control plane; ``from_env`` reads ``DIPTYCH_*``."""

    discovery_url: str = "embedded"
    queue_url: str = "embedded"
    namespace: str = "default"

    def discovery(self, **options: Any) -> Discovery:
        """A discovery client for this namespace; ``options`` are DiscoveryOptions fields."""
        from runtime.discovery import DiscoveryOptions

        return make_discovery(
            self.discovery_url, DiscoveryOptions(namespace=self.namespace, **options)
        )

    def prefill_queue(self, **options: Any) -> PrefillQueue:
        """A prefill-queue client for this namespace; ``options`` are QueueOptions fields."""
        from runtime.queue import QueueOptions

        return make_prefill_queue(self.queue_url, QueueOptions(namespace=self.namespace, **options))

    @classmethod
    def from_env(cls) -> RuntimeConfig:
        return cls(
            discovery_url=os.environ.get(ENV_DISCOVERY_URL, "embedded"),
            queue_url=os.environ.get(ENV_QUEUE_URL, "embedded"),
            namespace=os.environ.get(ENV_NAMESPACE, "default"),
        )


async def open_control_plane(
    discovery_url: str,
    queue_url: str,
    *,
    namespace: str = "default",
    queue_options: dict[str, Any] | None = None,
) -> tuple[Discovery, PrefillQueue]:
    """Discovery and the prefill queue of one namespace, both connected. The queue
    signs its messages with the deployment secret's key, when a secret is set."""
    from runtime.discovery import DiscoveryOptions
    from runtime.queue import QueueOptions
    from runtime.secret import derived_key

    discovery = make_discovery(discovery_url, DiscoveryOptions(namespace=namespace))
    await discovery.connect()
    options = {"signing_key": derived_key("diptych prefill queue"), **(queue_options or {})}
    queue = make_prefill_queue(queue_url, QueueOptions(namespace=namespace, **options))
    try:
        await queue.connect()
    except BaseException:
        await discovery.close()
        raise
    return discovery, queue

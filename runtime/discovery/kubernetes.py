"""Discovery on the Kubernetes API, for a cluster without etcd: one Lease
(coordination.k8s.io/v1) per record, as Kubernetes' own components keep liveness.

URL ``kubernetes://`` (the pod's namespace) or ``kubernetes://NAMESPACE``. Credentials:
in a pod its service account, elsewhere ``$KUBECONFIG`` or ``~/.kube/config``. The
service account needs get, list, create, patch and delete on ``leases`` in that
namespace (the Helm chart's ``discovery: kubernetes`` grants exactly that).

A record is a Lease named after a hash of its key; the key and the value (base64) are
annotations, and a label carries a hash of the key's prefix (a role of a namespace), so
listing a role is one label-selected list. A lease handle is the set of Lease objects
written under it: a keepalive patches their ``renewTime``, and a record lives while
``renewTime + leaseDurationSeconds`` is ahead of the reader's clock, as with
Kubernetes' leader election (the nodes' clocks must agree to well under the TTL).
Watchers re-list every ``poll_interval`` (at least 0.5 s: the API server is shared; a
list of one role's Leases is small, but a fleet of hundreds of workers belongs on
etcd); expired Leases a crashed worker left behind are deleted by the next
registration.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import math
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from runtime.discovery.base import Change, Discovery, DiscoveryOptions
from runtime.errors import BackendUnavailable, ControlPlaneError, NotConnected

T = TypeVar("T")

KEY = "diptych.io/key"
RECORD = "diptych.io/record"
PREFIX = "diptych.io/prefix"
MANAGED = {"app.kubernetes.io/managed-by": "diptych-discovery"}
MIN_POLL_S = 0.5  # a list of a few Leases, twice a second per watching process
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def lease_name(key: str) -> str:
    return "diptych-" + hashlib.sha256(key.encode()).hexdigest()[:40]


def prefix_label(prefix: str) -> str:
    return hashlib.sha256(prefix.encode()).hexdigest()[:48]


def _parent(key: str) -> str:
    return key.rsplit("/", 1)[0] + "/"


class _Status(Exception):
    """An API answer the caller asked to see (`KubernetesDiscovery._call`'s `expect`)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@dataclass
class _Lease:
    ttl: float
    names: set[str] = field(default_factory=set)


class KubernetesDiscovery(Discovery):
    def __init__(
        self,
        options: DiscoveryOptions,
        k8s_namespace: str | None = None,
        *,
        api_client: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`api_client`: a configured `kubernetes.client.ApiClient` (tests); otherwise
        one from the pod's service account or the kubeconfig."""
        super().__init__(options)
        self._k8s_namespace = k8s_namespace
        self._api_client = api_client
        self._api: Any = None
        self._clock = clock

    @property
    def k8s_namespace(self) -> str:
        if self._k8s_namespace is None:
            raise NotConnected("Kubernetes discovery is not connected")
        return self._k8s_namespace

    async def connect(self) -> None:
        try:
            from kubernetes import client, config
        except ImportError as e:
            raise BackendUnavailable(
                "Kubernetes discovery needs the kubernetes client: "
                "pip install 'diptych[kubernetes]'"
            ) from e
        if self._api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call,unused-ignore]
                self._api_client = client.ApiClient()
                if self._k8s_namespace is None and _SA_NAMESPACE.exists():
                    self._k8s_namespace = _SA_NAMESPACE.read_text().strip()
            except config.ConfigException:
                try:
                    # $KUBECONFIG read now: the client library reads it once, at import
                    path = os.environ.get("KUBECONFIG") or None
                    self._api_client = config.new_client_from_config(config_file=path)  # type: ignore[no-untyped-call,unused-ignore]
                except (config.ConfigException, OSError) as e:
                    raise BackendUnavailable(
                        f"Kubernetes discovery found no credentials (not in a pod, no "
                        f"kubeconfig): {e}"
                    ) from None
        self._k8s_namespace = self._k8s_namespace or "default"
        self._api = client.CoordinationV1Api(self._api_client)
        await self._call(lambda: self._api.list_namespaced_lease(self.k8s_namespace, limit=1))

    async def _close_backend(self) -> None:
        if self._api_client is not None:
            await asyncio.to_thread(self._api_client.close)

    async def _call(self, fn: Callable[[], T], expect: tuple[int, ...] = ()) -> T:
        """Run one API call off the loop. An answer whose status is in `expect` (404: no
        such Lease, 409: it exists) raises `_Status` for the caller to act on; any other
        failure, or a lost API server, is a ControlPlaneError (callers retry)."""
        from kubernetes.client.exceptions import ApiException

        if self._api is None:
            raise NotConnected("Kubernetes discovery is not connected")
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn), self.options.op_timeout)
        except ApiException as e:
            if e.status in expect:
                raise _Status(e.status) from None
            raise ControlPlaneError(f"Kubernetes API: {e.status} {e.reason}") from None
        except (OSError, asyncio.TimeoutError) as e:
            raise ControlPlaneError(f"Kubernetes API unreachable: {e!r}") from None
        except Exception as e:  # urllib3's MaxRetryError, ProtocolError, ...
            if type(e).__module__.startswith("urllib3"):
                raise ControlPlaneError(f"Kubernetes API unreachable: {e!r}") from None
            raise

    def _now(self) -> str:
        """A MicroTime: RFC 3339 in UTC with microseconds."""
        when = dt.datetime.fromtimestamp(self._clock(), tz=dt.timezone.utc)
        return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def _ttls_left(self, lease: Any) -> float:
        """How many lease durations remain before the Lease expires (negative: expired
        that many ago; -inf: never renewed)."""
        spec = lease.spec
        if spec is None or spec.renew_time is None or not spec.lease_duration_seconds:
            return -math.inf
        left = spec.renew_time.timestamp() + spec.lease_duration_seconds - self._clock()
        return float(left / spec.lease_duration_seconds)

    def _live(self, lease: Any) -> bool:
        return self._ttls_left(lease) > 0

    async def _grant(self, ttl: float) -> Any:
        await self._purge_expired()
        return _Lease(ttl)

    async def _purge_expired(self) -> None:
        """Delete Leases whose holders stopped renewing long ago (crashed workers)."""
        selector = ",".join(f"{k}={v}" for k, v in MANAGED.items())
        found = await self._call(
            lambda: self._api.list_namespaced_lease(self.k8s_namespace, label_selector=selector)
        )
        for lease in found.items:
            if self._ttls_left(lease) < -9:  # dead for ten lease durations
                await self._delete(lease.metadata.name)

    async def _put(self, key: str, value: bytes, lease: Any) -> None:
        name = lease_name(key)
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": {**MANAGED, PREFIX: prefix_label(_parent(key))},
                "annotations": {KEY: key, RECORD: base64.b64encode(value).decode()},
            },
            "spec": {
                "holderIdentity": self.namespace,
                "leaseDurationSeconds": max(1, math.ceil(lease.ttl)),
                "renewTime": self._now(),
            },
        }
        ns = self.k8s_namespace
        try:
            await self._call(lambda: self._api.create_namespaced_lease(ns, body), (409,))
        except _Status:  # there already: replace its record and renew it
            await self._call(lambda: self._api.patch_namespaced_lease(name, ns, body))
        lease.names.add(name)

    async def _keepalive(self, lease: Any) -> bool:
        renew = {"spec": {"renewTime": self._now()}}
        ns = self.k8s_namespace
        for name in sorted(lease.names):
            try:
                await self._call(partial(self._api.patch_namespaced_lease, name, ns, renew), (404,))
            except _Status:
                return False  # deleted (revoked, or purged as expired): write afresh
        return True

    async def _read(self, key: str) -> bytes | None:
        name, ns = lease_name(key), self.k8s_namespace
        try:
            lease = await self._call(lambda: self._api.read_namespaced_lease(name, ns), (404,))
        except _Status:
            return None
        return _record(lease)[1] if self._live(lease) else None

    async def _delete(self, name: str) -> None:
        with contextlib.suppress(_Status):  # gone already
            await self._call(
                lambda: self._api.delete_namespaced_lease(name, self.k8s_namespace), (404,)
            )

    async def _revoke(self, lease: Any) -> None:
        for name in sorted(lease.names):
            await self._delete(name)
        lease.names.clear()

    async def _snapshot(self, prefix: str) -> tuple[dict[str, bytes], int]:
        selector = f"{PREFIX}={prefix_label(prefix)}"
        found = await self._call(
            lambda: self._api.list_namespaced_lease(self.k8s_namespace, label_selector=selector)
        )
        out: dict[str, bytes] = {}
        for lease in found.items:
            key, value = _record(lease)
            if key.startswith(prefix) and self._live(lease):
                out[key] = value
        return out, int(found.metadata.resource_version or 0)

    def _changes(
        self, prefix: str, revision: int, snapshot: dict[str, bytes]
    ) -> AsyncGenerator[list[Change], None]:
        return self._polled_changes(prefix, snapshot, max(self.options.poll_interval, MIN_POLL_S))


def _record(lease: Any) -> tuple[str, bytes]:
    notes = lease.metadata.annotations or {}
    try:
        return str(notes.get(KEY, "")), base64.b64decode(notes.get(RECORD, ""), validate=True)
    except ValueError:
        return str(notes.get(KEY, "")), b""  # not ours to read: parse_record ignores it

"""Discovery on etcd (through ``aetcd``): records are keys attached to a lease.

Reconnection: the gRPC channel redials by itself (backoff capped at 1 s here instead of
gRPC's default 120 s, so a restarted etcd is found within a second); keepalives retry and
watches re-list on every error (see ``base.py``). With several endpoints
(``etcd://a:2379,b:2379``) a failed call moves the client to the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import grpc
import grpc.aio

from runtime.backend_auth import BackendAuth
from runtime.discovery.base import Change, Discovery, DiscoveryOptions
from runtime.errors import BackendUnavailable, ControlPlaneError, NotConnected

log = logging.getLogger(__name__)
T = TypeVar("T")

ETCD_MIN_TTL = 2  # etcd raises shorter lease TTLs to about this anyway

_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Pings find a silently dead connection (a partition, not a restart) within ~15 s;
    # etcd accepts pings every 5 s or slower by default.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}
_CONNECTION_ERRORS = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    asyncio.TimeoutError,
)


class EtcdDiscovery(Discovery):
    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        options: DiscoveryOptions,
        auth: BackendAuth | None = None,
    ) -> None:
        self._auth = auth or BackendAuth()
        super().__init__(options)
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self._endpoints = endpoints
        self._current = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._current]
        return f"{host}:{port}"

    def _new_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._current]
        a = self._auth
        credentials = {"username": a.user, "password": a.password or ""} if a.user else {}
        if a.tls:
            ca, cert, key = a.pem()
            return _TlsClient(
                grpc.ssl_channel_credentials(ca, key, cert),
                host=host, port=port, options=dict(_CHANNEL_OPTIONS), **credentials,
            )  # fmt: skip
        return aetcd.Client(host=host, port=port, options=dict(_CHANNEL_OPTIONS), **credentials)

    async def connect(self) -> None:
        if self._client is not None:
            return
        errors = []
        for _ in self._endpoints:
            client = self._new_client()
            try:
                await asyncio.wait_for(client.get(b"/diptych/"), self.options.op_timeout)
            except (*_CONNECTION_ERRORS, aetcd.exceptions.ClientError) as e:
                errors.append(f"{self.endpoint}: {e or type(e).__name__}")
                await _close_quietly(client)
                self._current = (self._current + 1) % len(self._endpoints)
                continue
            self._client = client
            return
        raise BackendUnavailable("cannot reach etcd (" + "; ".join(errors) + ")")

    async def _close_backend(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)

    async def _call(self, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        client = self._client
        if client is None:
            raise NotConnected("EtcdDiscovery is not connected; call connect() first")
        try:
            return await asyncio.wait_for(fn(client), self.options.op_timeout)
        except _CONNECTION_ERRORS as e:
            await self._rotate(client)
            raise BackendUnavailable(f"etcd at {self.endpoint}: {e or type(e).__name__}") from e
        except aetcd.exceptions.ClientError as e:
            raise ControlPlaneError(f"etcd at {self.endpoint}: {e}") from e
        except grpc.aio.AioRpcError as e:  # from calls made on the raw stubs
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                await self._rotate(client)
                raise BackendUnavailable(f"etcd at {self.endpoint}: {e.details()}") from e
            raise ControlPlaneError(f"etcd at {self.endpoint}: {e.details()}") from e

    async def _rotate(self, failed: aetcd.Client) -> None:
        if len(self._endpoints) == 1 or self._client is not failed:
            return
        self._current = (self._current + 1) % len(self._endpoints)
        log.warning("switching to etcd endpoint %s", self.endpoint)
        self._client = self._new_client()
        await _close_quietly(failed)

    async def _grant(self, ttl: float) -> Any:
        lease = await self._call(lambda c: c.lease(max(ETCD_MIN_TTL, math.ceil(ttl))))
        return lease.id

    async def _put(self, key: str, value: bytes, lease: Any) -> None:
        await self._call(lambda c: c.put(key.encode(), value, lease=lease))

    async def _keepalive(self, lease: Any) -> bool:
        # aetcd's refresh_lease() leaves its stream open (one leaked task per keepalive);
        # this sends one request on the raw stub and closes the stream after the answer.
        async def refresh(client: aetcd.Client) -> Any:
            await client.connect()
            request = aetcd.rpc.LeaseKeepAliveRequest(ID=lease)
            call = client.leasestub.LeaseKeepAlive(iter([request]), metadata=client.metadata)
            try:
                async for reply in call:
                    return reply
                return None
            finally:
                call.cancel()

        reply = await self._call(refresh)
        if reply is None:
            raise BackendUnavailable(f"etcd at {self.endpoint} closed the keepalive stream")
        return bool(reply.TTL > 0)

    async def _read(self, key: str) -> bytes | None:
        got = await self._call(lambda c: c.get(key.encode()))
        return got.value if got is not None else None

    async def _revoke(self, lease: Any) -> None:
        await self._call(lambda c: c.revoke_lease(lease))

    async def _snapshot(self, prefix: str) -> tuple[dict[str, bytes], int]:
        got = await self._call(lambda c: c.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value for kv in got}, got.header.revision

    async def _changes(
        self, prefix: str, revision: int, snapshot: dict[str, bytes]
    ) -> AsyncGenerator[list[Change], None]:
        watch = await self._call(
            lambda c: c.watch_prefix(prefix.encode(), start_revision=revision + 1)
        )
        try:
            async for event in watch:
                key = event.kv.key.decode()
                yield [(key, event.kv.value if event.kind == "PUT" else None)]
        except aetcd.exceptions.ClientError as e:
            raise BackendUnavailable(f"etcd watch at {self.endpoint}: {e}") from e
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)
        raise BackendUnavailable(f"etcd watch at {self.endpoint} ended")


async def _close_quietly(client: aetcd.Client) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 2.0)


class _TlsClient(aetcd.Client):  # type: ignore[misc,unused-ignore]
    """aetcd's client over a TLS channel: aetcd itself dials only plain channels, so the
    channel is made here and the client's own connect (stubs, authentication, watcher)
    runs on it."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kw: Any) -> None:
        super().__init__(**kw)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set() or self._is_connecting:
            await super().connect()  # connected, or another task is: nothing is dialled
            return
        real = aetcd.rpc.insecure_channel
        target = f"{self._host}:{self._port}"
        secure = grpc.aio.secure_channel(target, self._credentials, list(self._options.items()))

        def channel(*args: Any, **kwargs: Any) -> grpc.aio.Channel:
            aetcd.rpc.insecure_channel = real  # one use: no other client ever gets it
            return secure

        # aetcd's connect dials with rpc.insecure_channel before its first await, so
        # no other coroutine runs while this stands in for it
        aetcd.rpc.insecure_channel = channel
        try:
            await super().connect()
        finally:
            aetcd.rpc.insecure_channel = real

"""Discovery: workers register under a lease; routers and planners list and watch them.

A backend provides a small key-value-with-leases interface (grant, put, keepalive, read,
revoke, snapshot, changes); everything a caller sees is built on it here, once, so the etcd
and embedded backends behave the same:

* :meth:`Discovery.register` keeps a record alive: a keepalive every ``ttl / 3``; when the
  backend reports the lease gone (expired while the process stalled, revoked by an
  operator, lost with the etcd data), the record is written again under a fresh lease,
  without restarting the worker.
* :meth:`Discovery.watch` yields the current members as joins, then joins, leaves and
  updates. After any backend error it re-lists and emits only the difference, so a
  reconnect never shows a live worker leaving and coming back.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from protocol.declare import check_name, spec
from runtime.discovery.records import (
    DiscoveryEvent,
    apply_change,
    diff_members,
    parse_record,
    parse_records,
    role_prefix,
    worker_key,
)
from runtime.discovery.registration import Registration
from runtime.errors import ConfigError, ControlPlaneError, InvalidInput, check_options
from runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoveryOptions:
    """``ttl``: seconds a record outlives its last keepalive (etcd rounds up to whole
    seconds, minimum 2). ``keepalive_interval``: default ``ttl / 3``, so two keepalives can
    fail before the lease expires. ``poll_interval``: how often the embedded backend's
    watchers look for changes; it bounds their latency."""

    namespace: str = "default"
    ttl: float = spec(10.0, lo=1.0, hi=3600.0)
    keepalive_interval: float | None = None
    retry_interval: float = spec(0.5, lo=0.0, lo_open=True)
    max_retry_interval: float = spec(2.0, lo=0.0, lo_open=True)
    poll_interval: float = spec(0.02, lo=0.0, lo_open=True)
    op_timeout: float = spec(5.0, lo=0.0, lo_open=True)

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_options(self)
        if not 0 < self.interval < self.ttl:
            raise ConfigError("keepalive_interval must be positive and shorter than ttl")

    @property
    def interval(self) -> float:
        return self.keepalive_interval if self.keepalive_interval else self.ttl / 3


Change = tuple[str, bytes | None]  # (key, new value or None when deleted)


class Discovery(abc.ABC):
    """Register, list and watch workers of one namespace."""

    def __init__(self, options: DiscoveryOptions) -> None:
        self.options = options
        self.namespace = options.namespace
        self._registrations: set[Registration] = set()

    # -- what a backend implements -------------------------------------------------------
    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def _close_backend(self) -> None: ...

    @abc.abstractmethod
    async def _grant(self, ttl: float) -> Any:
        """Create a lease; returns the backend's lease handle."""

    @abc.abstractmethod
    async def _put(self, key: str, value: bytes, lease: Any) -> None: ...

    @abc.abstractmethod
    async def _keepalive(self, lease: Any) -> bool:
        """Refresh the lease; False if it no longer exists. Raise on connection errors."""

    @abc.abstractmethod
    async def _read(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def _revoke(self, lease: Any) -> None: ...

    @abc.abstractmethod
    async def _snapshot(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """All live keys under ``prefix`` and the revision they were read at."""

    @abc.abstractmethod
    def _changes(
        self, prefix: str, revision: int, snapshot: dict[str, bytes]
    ) -> AsyncGenerator[list[Change], None]:
        """Batches of changes under ``prefix`` since ``_snapshot`` returned ``snapshot`` at
        ``revision``; raises :class:`ControlPlaneError` on lost contact."""

    async def _polled_changes(
        self, prefix: str, snapshot: dict[str, bytes], interval: float
    ) -> AsyncGenerator[list[Change], None]:
        """`_changes` for a backend without a watch: re-read `prefix` every `interval`
        seconds and yield what differs from the last read."""
        previous = snapshot
        while True:
            await asyncio.sleep(interval)
            current, _ = await self._snapshot(prefix)
            if current == previous:
                continue
            batch: list[Change] = [(k, None) for k in sorted(previous.keys() - current.keys())]
            batch += [(k, v) for k, v in sorted(current.items()) if previous.get(k) != v]
            previous = current
            yield batch

    # -- the public interface -------------------------------------------------------------
    async def close(self) -> None:
        for reg in list(self._registrations):
            await reg.close()
        await self._close_backend()

    async def __aenter__(self) -> Discovery:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(self, info: WorkerInfo) -> Registration:
        """Publish ``info`` and keep it alive until :meth:`Registration.close`."""
        if not isinstance(info, WorkerInfo):
            raise InvalidInput(f"register() takes a WorkerInfo, got {type(info).__name__}")
        reg = Registration(self, info)
        await reg._start()
        self._registrations.add(reg)
        return reg

    async def list(self, role: str) -> list[WorkerInfo]:
        data, _ = await self._snapshot(role_prefix(self.namespace, role))
        workers = parse_records(data)
        return sorted(workers.values(), key=lambda w: w.worker_id)

    async def get(self, role: str, worker_id: str) -> WorkerInfo | None:
        key = worker_key(self.namespace, role, worker_id)
        value = await self._read(key)
        return parse_record(key, value) if value is not None else None

    async def watch(self, role: str) -> AsyncIterator[DiscoveryEvent]:
        """Current members as JOIN events, then every change, until the caller stops."""
        prefix = role_prefix(self.namespace, role)
        known: dict[str, WorkerInfo] = {}
        delay = self.options.retry_interval
        while True:
            try:
                data, revision = await self._snapshot(prefix)
                current = parse_records(data)
                for event in diff_members(known, current):
                    yield event
                known = current
                delay = self.options.retry_interval
                async with contextlib.aclosing(self._changes(prefix, revision, data)) as changes:
                    async for batch in changes:
                        for key, value in batch:
                            worker = parse_record(key, value) if value is not None else None
                            for event in apply_change(known, key.rsplit("/", 1)[-1], worker):
                                yield event
            except ControlPlaneError as e:
                log.warning("discovery watch of %s lost contact (%s); resyncing", prefix, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.options.max_retry_interval)

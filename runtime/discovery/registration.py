"""Keeping one worker's discovery record alive: keepalives, re-registration, takeover."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from runtime.discovery.records import parse_record, worker_key
from runtime.errors import ControlPlaneError, InvalidInput
from runtime.tasks import cancel_and_wait
from runtime.worker_info import WorkerInfo

if TYPE_CHECKING:
    from runtime.discovery.base import Discovery

log = logging.getLogger(__name__)


class _Superseded(ControlPlaneError):
    pass


class Registration:
    """One worker's record, kept alive by a background task until :meth:`close`."""

    def __init__(self, discovery: Discovery, info: WorkerInfo) -> None:
        self._d = discovery
        self.info = info
        self.key = worker_key(discovery.namespace, info.role, info.worker_id)
        self._task_name = f"discovery-keepalive {self.key}"  # the loop's and each refresh's
        self._value = info.to_json()
        self._lease: Any = None
        self._task: asyncio.Task[None] | None = None
        self._last_ok = 0.0
        self.reregistrations = 0  # times the lease was found gone and the record rewritten
        self.superseded = False  # another incarnation registered the same worker id

    @property
    def healthy(self) -> bool:
        """Whether the last successful keepalive is recent enough that the record is live."""
        alive = time.monotonic() - self._last_ok < self._d.options.ttl
        return alive and not self.superseded

    async def _start(self) -> None:
        await self._write_fresh()
        self._task = asyncio.create_task(self._keep(), name=self._task_name)

    async def _write_fresh(self) -> None:
        self._lease = await self._d._grant(self._d.options.ttl)
        await self._d._put(self.key, self._value, self._lease)
        self._last_ok = time.monotonic()

    async def update(self, info: WorkerInfo) -> None:
        """Replace the record (same role and worker id) under the current lease."""
        if (info.role, info.worker_id) != (self.info.role, self.info.worker_id):
            raise InvalidInput("update() must keep the role and worker_id of the registration")
        self.info, self._value = info, info.to_json()
        await self._d._put(self.key, self._value, self._lease)

    async def close(self) -> None:
        """Stop the keepalive and revoke the lease: watchers see the worker leave now."""
        self._d._registrations.discard(self)
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self._lease is not None:
            lease, self._lease = self._lease, None
            try:
                await self._d._revoke(lease)
            except ControlPlaneError as e:  # the lease still expires after ttl
                log.warning("could not revoke lease of %s: %s", self.key, e)

    async def _keep(self) -> None:
        opts = self._d.options
        delay = opts.interval
        while True:
            await asyncio.sleep(delay)
            try:
                # A task of its own (wait_for's), named as the loop's so a task dump says
                # whose refresh it is.
                refresh = asyncio.create_task(self._refresh(), name=self._task_name)
                await asyncio.wait_for(refresh, timeout=opts.op_timeout)
                delay = opts.interval
            except _Superseded as e:
                log.error("%s", e)
                return
            except (ControlPlaneError, asyncio.TimeoutError) as e:
                # Retry soon: the lease survives ttl, so a short outage costs nothing.
                log.warning("keepalive of %s failed: %s", self.key, e or type(e).__name__)
                delay = min(opts.retry_interval, opts.interval)

    async def _refresh(self) -> None:
        if not await self._d._keepalive(self._lease):
            log.warning("lease of %s was lost; registering again", self.key)
            self.reregistrations += 1
            await self._write_fresh()
            return
        current = await self._d._read(self.key)
        if current != self._value:
            other = parse_record(self.key, current) if current is not None else None
            if other is not None and other.incarnation_id != self.info.incarnation_id:
                # A newer process took this worker id over; fighting it would make both flap.
                self.superseded = True
                raise _Superseded(
                    f"{self.key} now belongs to incarnation {other.incarnation_id}; "
                    f"incarnation {self.info.incarnation_id} stops keeping it alive"
                )
            log.warning("record %s was removed or changed; writing it again", self.key)
            await self._d._put(self.key, self._value, self._lease)
            self.reregistrations += 1
        self._last_ok = time.monotonic()

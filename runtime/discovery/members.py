"""The live members of one role, kept current by a discovery watch.

Roles follow each other through this: a decode worker follows the prefill workers
(whose transfer agents may write into it), a prefill worker follows the decode workers
(whose blocks it writes), the frontend follows decode workers. Callbacks run on the
event loop, in event order; an exception in one is logged and does not stop the watch.

A member that leaves may still be finishing its work: a prefill worker draining for
a scale-down still writes the KV of the prefills it holds, a draining decode worker
still waits for the KV of its requests. With `linger_s`, a departed member stays
reachable through `get`/`wait_for` (not `all`/`len`: nothing new is sent its way)
and its `on_leave` runs that much later, unless it comes back first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from runtime.discovery.base import Discovery
from runtime.discovery.records import EventKind
from runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)

Callback = Callable[[WorkerInfo], Awaitable[None] | None]


class RoleMembers:
    def __init__(
        self,
        discovery: Discovery,
        role: str,
        *,
        on_join: Callback | None = None,
        on_leave: Callback | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self.discovery = discovery
        self.role = role
        self._on_join = on_join
        self._on_leave = on_leave
        self.linger_s = linger_s
        self._members: dict[str, WorkerInfo] = {}
        # left, still reachable: worker id -> (record, the pending on_leave)
        self._departed: dict[str, tuple[WorkerInfo, asyncio.TimerHandle]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"follow {self.role}")

    async def close(self) -> None:
        for _, timer in self._departed.values():
            timer.cancel()
        self._departed.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __len__(self) -> int:
        return len(self._members)

    def get(self, worker_id: str) -> WorkerInfo | None:
        """The member, or one that left within `linger_s` (still finishing its work)."""
        info = self._members.get(worker_id)
        if info is None and worker_id in self._departed:
            info = self._departed[worker_id][0]
        return info

    def all(self) -> list[WorkerInfo]:
        return list(self._members.values())

    async def wait_for(self, worker_id: str, timeout: float) -> WorkerInfo | None:
        """The member `worker_id`, waiting up to `timeout` s for it to appear."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (info := self.get(worker_id)) is None:
            left = end - loop.time()
            if left <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return info

    async def _follow(self) -> None:
        async for event in self.discovery.watch(self.role):
            info = event.worker
            if event.kind == EventKind.LEAVE:
                self._members.pop(info.worker_id, None)
                if self.linger_s > 0:
                    self._linger(info)
                else:
                    await self._call(self._on_leave, info)
            else:
                old = self._members.get(info.worker_id)
                departed = self._departed.pop(info.worker_id, None)
                if departed is not None:
                    gone, timer = departed
                    if gone.incarnation_id == info.incarnation_id:
                        timer.cancel()  # back before its linger ran out: never left
                self._members[info.worker_id] = info
                if old is not None and old.incarnation_id != info.incarnation_id:
                    await self._call(self._on_leave, old)
                await self._call(self._on_join, info)
            self._changed.set()

    def _linger(self, info: WorkerInfo) -> None:
        loop = asyncio.get_running_loop()

        def gone() -> None:
            entry = self._departed.get(info.worker_id)
            if entry is not None and entry[0] is info:
                del self._departed[info.worker_id]
            self._leave_later(info)

        previous = self._departed.pop(info.worker_id, None)
        if previous is not None:  # an older incarnation still lingering: it goes now
            previous[1].cancel()
            self._leave_later(previous[0])
        self._departed[info.worker_id] = (info, loop.call_later(self.linger_s, gone))

    def _leave_later(self, info: WorkerInfo) -> None:
        task = asyncio.get_running_loop().create_task(self._call(self._on_leave, info))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _call(self, cb: Callback | None, info: WorkerInfo) -> None:
        if cb is None:
            return
        try:
            result = cb(info)
            if result is not None:
                await result
        except Exception:
            log.exception("%s member callback failed for %s", self.role, info.worker_id)


def transfer_peers(
    discovery: Discovery,
    role: str,
    add: Callable[[WorkerInfo], object],
    remove: Callable[[str], object],
    linger_s: float = 0.0,
) -> RoleMembers:
    """Follow `role` and keep a transfer agent's peer table in step with it: `add(record)`
    for each member with transfer metadata that joins (or changes), `remove(agent_name)`
    for each that leaves (`linger_s` later: a draining peer still writes or is written
    to). A member `add` refuses (its KV layout differs, say) is logged and left out."""

    def joined(info: WorkerInfo) -> None:
        if info.transfer is not None:
            try:
                add(info)
            except Exception as e:
                log.warning("not peering with %s %s: %s", role, info.worker_id, e)

    def left(info: WorkerInfo) -> None:
        if info.transfer is not None:
            try:
                remove(info.transfer.agent_name)
            except Exception as e:
                log.warning("dropping %s %s failed: %s", role, info.worker_id, e)

    return RoleMembers(discovery, role, on_join=joined, on_leave=left, linger_s=linger_s)

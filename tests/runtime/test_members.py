"""RoleMembers on the real embedded discovery: joins and leaves, and a departed
member that lingers (still reachable, nothing new sent its way) while it drains."""

from __future__ import annotations

import asyncio
from pathlib import Path

from runtime.discovery import DiscoveryOptions, EmbeddedDiscovery
from runtime.discovery.members import RoleMembers
from runtime.worker_info import WorkerInfo


async def _until(check: object, timeout: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.02)


async def test_a_departed_member_lingers_then_leaves(tmp_path: Path) -> None:
    left: list[str] = []
    async with EmbeddedDiscovery(tmp_path, DiscoveryOptions(ttl=5)) as d:
        members = RoleMembers(d, "prefill", on_leave=lambda i: left.append(i.worker_id),
                              linger_s=0.5)  # fmt: skip
        members.start()
        reg = await d.register(WorkerInfo("prefill-1", "prefill", "m"))
        await _until(lambda: len(members) == 1)
        await reg.close()  # leaves discovery: draining
        await _until(lambda: len(members) == 0)
        assert members.get("prefill-1") is not None  # still reachable while it drains
        assert left == [] and members.all() == []
        await _until(lambda: left == ["prefill-1"], 3.0)
        assert members.get("prefill-1") is None
        await members.close()


async def test_without_linger_a_leave_is_at_once(tmp_path: Path) -> None:
    left: list[str] = []
    async with EmbeddedDiscovery(tmp_path, DiscoveryOptions(ttl=5)) as d:
        members = RoleMembers(d, "decode", on_leave=lambda i: left.append(i.worker_id))
        members.start()
        reg = await d.register(WorkerInfo("decode-1", "decode", "m"))
        await _until(lambda: len(members) == 1)
        await reg.close()
        await _until(lambda: left == ["decode-1"])
        assert members.get("decode-1") is None
        await members.close()

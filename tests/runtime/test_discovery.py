"""Discovery on both backends: registration, listing, watching, leases, bad input."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from runtime.discovery import EventKind
from runtime.errors import InvalidInput
from tests.runtime.rt_helpers import TTL, Watcher, discovery, free_port, worker


async def test_register_list_get_roundtrip(discovery_url: str, namespace: str) -> None:
    async with discovery(discovery_url, namespace) as d:
        b, a = worker("b"), worker("a")
        regs = [await d.register(b), await d.register(a), await d.register(worker("p", "prefill"))]
        assert await d.list("decode") == [a, b]  # sorted by worker id, records intact
        assert [w.worker_id for w in await d.list("prefill")] == ["p"]
        assert await d.get("decode", "a") == a
        assert await d.get("decode", "zzz") is None
        assert (await d.get("decode", "a")).transfer.metadata == b"\x00meta\xff"  # type: ignore[union-attr]
        for reg in regs:
            await reg.close()
        assert await d.list("decode") == []


async def test_namespaces_are_isolated(discovery_url: str, namespace: str) -> None:
    async with (
        discovery(discovery_url, namespace) as d1,
        discovery(discovery_url, namespace + "x") as d2,
    ):
        await d1.register(worker("a"))
        assert await d2.list("decode") == []


async def test_watch_sees_joins_updates_and_leaves(discovery_url: str, namespace: str) -> None:
    async with discovery(discovery_url, namespace) as d:
        first = await d.register(worker("first"))
        w = Watcher(d)
        await w.wait_for(EventKind.JOIN, "first")  # members present before watching
        second = await d.register(worker("second"))
        await w.wait_for(EventKind.JOIN, "second")
        updated = worker("second", extra={"zone": "b"}, incarnation_id=second.info.incarnation_id)
        await second.update(updated)
        await w.wait_for(EventKind.UPDATE, "second")
        t0 = time.monotonic()
        await first.close()  # revokes the lease: seen at once, not after the TTL
        assert await w.wait_for(EventKind.LEAVE, "first") - t0 < 1.0
        await w.stop()
        assert w.kinds() == [
            (EventKind.JOIN, "first"), (EventKind.JOIN, "second"), (EventKind.UPDATE, "second"),
            (EventKind.LEAVE, "first"),
        ]  # fmt: skip
        assert w.events[2][1].worker.extra == {"zone": "b"}


async def test_lost_lease_is_registered_again_without_restart(
    discovery_url: str, namespace: str
) -> None:
    async with discovery(discovery_url, namespace) as d:
        reg = await d.register(worker("w"))
        await d._revoke(reg._lease)  # what an expired or operator-revoked lease looks like
        assert await d.get("decode", "w") is None
        deadline = time.monotonic() + TTL + 2
        while await d.get("decode", "w") is None:
            assert time.monotonic() < deadline, "the worker did not register again"
            await asyncio.sleep(0.05)
        assert reg.reregistrations == 1 and reg.healthy
        assert (await d.get("decode", "w")) == reg.info  # same incarnation: not a restart


async def test_newer_incarnation_takes_over_without_flapping(
    discovery_url: str, namespace: str
) -> None:
    async with (
        discovery(discovery_url, namespace) as old_proc,
        discovery(discovery_url, namespace) as new_proc,
    ):
        old = await old_proc.register(worker("w"))
        w = Watcher(new_proc)
        await w.wait_for(EventKind.JOIN, "w")
        new = await new_proc.register(worker("w"))  # the restarted process, same worker id
        await asyncio.sleep(TTL * 1.5)  # several keepalive rounds of both
        current = await new_proc.get("decode", "w")
        assert current is not None and current.incarnation_id == new.info.incarnation_id
        assert old.superseded and not old.healthy
        assert not new.superseded and new.healthy
        await w.stop()
        assert w.kinds() == [(EventKind.JOIN, "w"), (EventKind.LEAVE, "w"), (EventKind.JOIN, "w")]


async def test_bad_input_is_refused_clearly(discovery_url: str, namespace: str) -> None:
    async with discovery(discovery_url, namespace) as d:
        with pytest.raises(InvalidInput, match="WorkerInfo"):
            await d.register({"worker_id": "x"})  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="role"):
            await d.list("Decode/../x")
        with pytest.raises(InvalidInput, match="worker_id"):
            worker("has space")
        with pytest.raises(InvalidInput, match="over the"):
            await d.register(worker("big", extra={"blob": "x" * 70_000}))
        reg = await d.register(worker("a"))
        with pytest.raises(InvalidInput, match="keep the role and worker_id"):
            await reg.update(worker("b"))


async def test_malformed_records_are_ignored(
    discovery_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with discovery(discovery_url, namespace) as d:
        await d.register(worker("good"))
        lease = await d._grant(TTL)
        prefix = f"/diptych/{namespace}/decode/"
        await d._put(prefix + "garbage", b"\xff{not json", lease)
        await d._put(prefix + "liar", worker("someone-else").to_json(), lease)  # key != record
        w = Watcher(d)
        await w.wait_for(EventKind.JOIN, "good")
        with caplog.at_level(logging.WARNING):
            assert [x.worker_id for x in await d.list("decode")] == ["good"]
            await d._put(prefix + "late", b"[]", lease)  # arrives through the watch
            await d.register(worker("after"))
            await w.wait_for(EventKind.JOIN, "after")
        await w.stop()
        assert w.kinds() == [(EventKind.JOIN, "good"), (EventKind.JOIN, "after")]
        assert "ignoring malformed discovery record" in caplog.text


async def test_killed_worker_leaves_within_ttl(discovery_url: str, namespace: str, spawn) -> None:  # type: ignore[no-untyped-def]
    """A SIGKILLed worker disappears from discovery within TTL + 2 s; watchers see it."""
    async with discovery(discovery_url, namespace) as d:
        child = spawn("register", discovery_url, namespace, "doomed", str(TTL))
        await child.expect("READY")
        w = Watcher(d)
        await w.wait_for(EventKind.JOIN, "doomed")
        killed_at = time.monotonic()
        child.kill()
        left_at = await w.wait_for(EventKind.LEAVE, "doomed", timeout=TTL + 5)
        assert left_at - killed_at <= TTL + 2.0, f"left after {left_at - killed_at:.2f}s"
        assert await d.list("decode") == []
        await w.stop()


async def test_etcd_client_moves_to_a_live_endpoint(etcd_server, namespace: str) -> None:  # type: ignore[no-untyped-def]
    dead = f"127.0.0.1:{free_port()}"
    live = etcd_server.url.removeprefix("etcd://")
    async with discovery(f"etcd://{dead},{live}", namespace) as d:
        await d.register(worker("a"))
        assert [w.worker_id for w in await d.list("decode")] == ["a"]

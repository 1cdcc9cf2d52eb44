"""Process deaths and server restarts: consumers SIGKILLed mid-work, NATS and etcd restarted
under running clients."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter

from runtime.discovery import EventKind
from runtime.queue import DeadLetterReason, QueueDepth
from tests.runtime.rt_helpers import Letters, Watcher, discovery, queue, request, worker


async def test_sigkilled_consumer_holding_a_message(queue_url: str, namespace: str, spawn) -> None:  # type: ignore[no-untyped-def]
    """A consumer dies holding an un-acked message: another consumer gets it after the
    ack-wait. Another dies after completing but before acking: its message is never
    completed again. Nothing is lost, nothing is completed twice."""
    ack_wait, n = 2.0, 20
    async with queue(queue_url, namespace, ack_wait=ack_wait) as q:
        for i in range(n):
            await q.publish(request(i))
        # both start at once (their imports overlap); each takes a message of its own
        holder = spawn("hold", queue_url, namespace, str(ack_wait), "3")
        claimer = spawn("claim", queue_url, namespace, str(ack_wait), "3")
        held = await holder.expect("HOLDING")
        held_at = time.monotonic()
        claimed = await claimer.expect("CLAIMED")
        assert claimed != held
        holder.kill()
        claimer.kill()

        completed: Counter[str] = Counter({claimed: 1})
        redelivered_at = None
        # until every message is completed, the held one among them, and the claimer's
        # redelivery has been acked unseen
        end = time.monotonic() + ack_wait * 10
        while len(completed) < n or q.stats.skipped_completed < 1:
            assert time.monotonic() < end, f"completed {sorted(completed)}; {q.stats}"
            for d in await q.fetch(8, timeout=ack_wait):
                if d.request.request_id == held:
                    redelivered_at = time.monotonic()
                    assert d.num_delivered == 2
                if await d.claim_completion():
                    completed[d.request.request_id] += 1
                await d.ack()

        assert redelivered_at is not None, "the held message was lost"
        waited = redelivered_at - held_at
        assert ack_wait - 0.3 <= waited <= ack_wait + 2.0, f"redelivered after {waited:.2f}s"
        assert completed == Counter({f"req-{i}": 1 for i in range(n)})
        assert q.stats.skipped_completed == 1  # the claimer's message, acked unseen
        # nothing waits and nothing is held un-acked: no delivery can follow
        assert await q.depth() == QueueDepth(pending=0, in_flight=0)


async def test_nats_restart_under_running_clients(server_factory, namespace: str) -> None:  # type: ignore[no-untyped-def]
    nats = server_factory("nats")
    async with (
        queue(nats.url, namespace, ack_wait=2.0) as producer,
        queue(nats.url, namespace, ack_wait=2.0) as consumer,
    ):
        letters = Letters(producer, "decode-0")
        await asyncio.sleep(0.3)
        for i in range(5):
            await producer.publish(request(i))
        [in_flight] = await consumer.fetch(1, timeout=2.0)

        nats.stop()
        publishing = asyncio.create_task(producer.publish(request(5)))  # retried meanwhile
        await asyncio.sleep(1.0)
        nats.start()
        assert not (await publishing).duplicate

        await in_flight.ack()  # the consumer's state survived the restart
        seen: list[str] = []
        end = time.monotonic() + 20.0
        while len(seen) < 5:
            assert time.monotonic() < end, f"only {seen} after the restart"
            for d in await consumer.fetch(8, timeout=1.5):
                seen.append(d.request.request_id)
                await d.ack()
        assert sorted(seen) == [f"req-{i}" for i in range(1, 6)]  # stream contents survived
        assert await consumer.depth() == QueueDepth(pending=0, in_flight=0)  # and no more

        await producer.publish(request("late", deadline_in=0.05))
        await asyncio.sleep(0.1)
        assert await consumer.fetch(1, timeout=0.5) == []
        [letter] = await letters.wait(1)  # the dead-letter feed came back too
        assert letter.reason is DeadLetterReason.DEADLINE

        nats.stop()  # now lose the data: streams and consumer are declared again
        shutil.rmtree(nats.data_dir)
        nats.start()
        await producer.publish(request("after-wipe"))
        [d] = await consumer.fetch(1, timeout=5.0)
        assert d.request.request_id == "req-after-wipe"
        await d.term("cannot prefill it")
        [_, letter] = await letters.wait(2)  # the feed started over with the new stream
        assert (letter.request_id, letter.reason) == ("req-after-wipe", DeadLetterReason.TERMINATED)
        await letters.stop()


async def test_a_claim_retried_across_a_nats_restart_finds_its_own_mark(  # type: ignore[no-untyped-def]
    server_factory, namespace: str
) -> None:
    """A completion claim sent while the server is away may land once it is back (the
    client buffers it) after the call gave up: the retried claim must count it as its own,
    and another delivery's claim must still lose."""
    from runtime.errors import BackendUnavailable

    nats = server_factory("nats")
    async with queue(nats.url, namespace, publish_timeout=1.0) as q:
        await q.publish(request("r"))
        [d] = await q.fetch(1, timeout=2.0)
        nats.stop()
        try:
            await d.claim_completion()
            raise AssertionError("claimed with the server down")
        except BackendUnavailable:
            pass
        nats.start()
        assert await d.claim_completion()  # True: its own mark, whichever try made it
        [other] = [type(d)(q, d._msg)]  # type: ignore[attr-defined]  # a second delivery
        other.request = d.request
        assert not await other.claim_completion()
        await d.ack()


async def test_etcd_restart_under_running_clients(server_factory, namespace: str) -> None:  # type: ignore[no-untyped-def]
    etcd = server_factory("etcd")
    ttl = 3.0
    async with (
        discovery(etcd.url, namespace, ttl) as worker_side,
        discovery(etcd.url, namespace, ttl) as router_side,
    ):
        reg = await worker_side.register(worker("w"))
        watcher = Watcher(router_side)
        await watcher.wait_for(EventKind.JOIN, "w")

        etcd.restart(down_for=1.0)  # same data: the lease and the record survive
        other = await worker_side.register(worker("after-restart"))  # retried until etcd is up
        await watcher.wait_for(EventKind.JOIN, "after-restart")  # the watch came back
        await asyncio.sleep(ttl)
        assert reg.healthy and reg.reregistrations == 0
        assert [w.worker_id for w in await router_side.list("decode")] == ["after-restart", "w"]
        assert (EventKind.LEAVE, "w") not in watcher.kinds()

        etcd.stop()  # now lose the data: leases and records are gone
        shutil.rmtree(etcd.data_dir)
        etcd.start()
        deadline = time.monotonic() + ttl + 5
        while [w.worker_id for w in await router_side.list("decode")] != ["after-restart", "w"]:
            assert time.monotonic() < deadline, "registrations did not come back"
            await asyncio.sleep(0.2)
        assert reg.reregistrations >= 1 and other.reregistrations >= 1
        await watcher.wait_for(EventKind.JOIN, "w")
        await watcher.stop()

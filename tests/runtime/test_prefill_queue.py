"""The prefill queue's delivery contract, run against JetStream and the embedded backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from runtime.errors import InvalidInput, PayloadTooLarge
from runtime.queue import DeadLetterReason, PrefillQueue, QueueFull
from tests.runtime.rt_helpers import ACK_WAIT, Letters, inject_raw, queue, request


async def fetch_nothing_until(q: PrefillQueue, settled: Callable[[], bool], timeout: float) -> None:
    """Fetch until ``settled()``, every fetch coming back empty: a redelivery the queue
    settles on its own (acked unseen, dead-lettered) is seen as soon as it happens, not
    after a fixed window."""
    end = time.monotonic() + timeout
    while not settled():
        assert time.monotonic() < end, f"not settled within {timeout}s: {q.stats}"
        assert await q.fetch(1, timeout=0.25) == []


async def test_publish_fetch_ack_roundtrip(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        sent = request(1)
        result = await q.publish(sent)
        assert not result.duplicate
        assert (await q.depth()).pending == 1
        [d] = await q.fetch(4, timeout=2.0)
        assert d.request == sent and d.num_delivered == 1
        assert (await q.depth()).in_flight == 1
        await d.ack()
        depth = await q.depth()
        assert depth.pending == 0 and depth.in_flight == 0
        assert await q.fetch(1, timeout=0.3) == []


async def test_publish_deduplicates_by_request_id(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        first = await q.publish(request(1))
        again = await q.publish(request(1))
        assert again.duplicate and again.sequence == first.sequence
        assert len(await q.fetch(10, timeout=1.0)) == 1
        assert await q.fetch(10, timeout=0.3) == []
        assert q.stats.publish_duplicates == 1


async def test_redelivery_after_ack_wait_and_in_progress(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q, queue(queue_url, namespace) as other:
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=2.0)
        async with d.keepalive(interval=ACK_WAIT / 4):  # heartbeats hold it past the ack-wait
            assert await other.fetch(1, timeout=ACK_WAIT * 2) == []
        t0 = time.monotonic()
        [again] = await other.fetch(1, timeout=ACK_WAIT * 3)  # no more heartbeats: redelivered
        assert again.request.request_id == "req-1" and again.num_delivered == 2
        assert time.monotonic() - t0 >= ACK_WAIT * 0.5
        await again.ack()


async def test_nak_with_delay(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=2.0)
        await d.nak(delay=0.6)
        assert await q.fetch(1, timeout=0.3) == []
        [again] = await q.fetch(1, timeout=2.0)
        assert again.num_delivered == 2
        await again.ack()


async def test_max_deliveries_then_dead_letter(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, max_deliveries=2) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        await q.publish(request(1))
        for attempt in (1, 2):  # consumers that die: never settle, let the ack-wait run out
            [d] = await q.fetch(1, timeout=ACK_WAIT * 3)
            assert d.num_delivered == attempt
        # no 3rd delivery: it became a letter
        await fetch_nothing_until(q, lambda: q.stats.dead_lettered == 1, ACK_WAIT * 3)
        [letter] = await letters.wait(1)
        assert letter.request_id == "req-1" and letter.reason is DeadLetterReason.MAX_DELIVERIES
        assert letter.num_deliveries == 3 and letter.decode_worker_id == "decode-0"
        assert (await q.depth()).pending == 0
        await letters.stop()


async def test_nak_on_last_attempt_and_term_dead_letter(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, max_deliveries=2) as q:
        mine, theirs = Letters(q, "decode-0"), Letters(q, "decode-1")
        await asyncio.sleep(0.2)
        await q.publish(request(1))
        await q.publish(request(2, worker="decode-1"))
        for d in await q.fetch(2, timeout=2.0):
            if d.request.request_id == "req-1":
                await d.nak()
            else:
                await d.term("prompt needs more blocks than the prefill worker has")
        [d] = await q.fetch(1, timeout=2.0)
        assert d.request.request_id == "req-1" and d.last_attempt
        await d.nak(reason="forward pass failed")  # the last attempt: dead letter, no retry
        [a] = await mine.wait(1)
        [b] = await theirs.wait(1)
        assert (a.request_id, a.reason, a.detail) == (
            "req-1",
            DeadLetterReason.MAX_DELIVERIES,
            "forward pass failed",
        )
        assert (b.request_id, b.reason) == ("req-2", DeadLetterReason.TERMINATED)
        assert "more blocks" in b.detail
        assert await q.fetch(1, timeout=0.3) == []
        await mine.stop()
        await theirs.stop()


async def test_expired_request_is_dead_lettered(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        await q.publish(request(1, deadline_in=0.05))
        await asyncio.sleep(0.1)
        await fetch_nothing_until(q, lambda: q.stats.dead_lettered == 1, 2.0)
        [letter] = await letters.wait(1)
        assert letter.reason is DeadLetterReason.DEADLINE
        await letters.stop()


async def test_completion_is_claimed_once(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as slow, queue(queue_url, namespace) as fast:
        await slow.publish(request(1))
        [d1] = await slow.fetch(1, timeout=2.0)  # too slow: its ack-wait runs out
        [d2] = await fast.fetch(1, timeout=ACK_WAIT * 3)
        assert d1.request.request_id == d2.request.request_id == "req-1"
        assert await d2.claim_completion()
        await d2.ack()
        assert not await d1.claim_completion()  # the slow one must not notify again
        await d1.ack()
        # A consumer that claimed and died before its ack: the redelivery is acked unseen.
        await slow.publish(request(2))
        [d3] = await slow.fetch(1, timeout=2.0)
        assert await d3.claim_completion()
        await fetch_nothing_until(fast, lambda: fast.stats.skipped_completed == 1, ACK_WAIT * 3)
        assert fast.stats.skipped_completed == 1
        assert (await fast.depth()).pending == 0


async def test_completed_request_is_never_dead_lettered(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, max_deliveries=1) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        await q.publish(request(1, deadline_in=ACK_WAIT * 1.5))
        [d] = await q.fetch(1, timeout=2.0)
        assert await d.claim_completion()  # ... and the consumer dies before its ack
        # The redelivery is past max_deliveries and past the deadline, yet completed.
        await fetch_nothing_until(q, lambda: q.stats.skipped_completed == 1, ACK_WAIT * 3)
        assert q.stats.skipped_completed == 1 and q.stats.dead_lettered == 0
        await asyncio.sleep(0.3)
        assert letters.items == []
        await letters.stop()


async def test_concurrent_consumers_complete_everything_once(
    queue_url: str, namespace: str
) -> None:
    n = 60
    async with queue(queue_url, namespace) as pub:
        for i in range(n):
            await pub.publish(request(i))
        completed: list[str] = []

        async def consumer() -> None:
            async with queue(queue_url, namespace) as q:
                while True:
                    batch = await q.fetch(4, timeout=0.5)
                    if not batch:
                        return
                    for d in batch:
                        if await d.claim_completion():
                            completed.append(d.request.request_id)
                        await d.ack()

        await asyncio.gather(*(consumer() for _ in range(3)))
        assert sorted(completed) == sorted(f"req-{i}" for i in range(n))


async def test_full_queue_refuses_work(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, max_pending=3) as q:
        for i in range(3):
            await q.publish(request(i))
        with pytest.raises(QueueFull):
            await q.publish(request(99))


async def test_bad_input_gives_clear_errors(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, max_message_bytes=4096) as q:
        with pytest.raises(InvalidInput, match="RemotePrefillRequest"):
            await q.publish({"request_id": "x"})  # type: ignore[arg-type]
        with pytest.raises(PayloadTooLarge, match="max_message_bytes"):
            await q.publish(request(1, tokens=3000))
        with pytest.raises(InvalidInput, match="batch"):
            await q.fetch(0)
        with pytest.raises(InvalidInput, match="decode_worker_id"):
            await anext(q.dead_letters("no spaces allowed"))
        await q.publish(request(2))
        [d] = await q.fetch(1, timeout=2.0)
        await d.ack()
        with pytest.raises(InvalidInput, match="already settled"):
            await d.ack()


async def test_malformed_message_is_dropped_and_queue_keeps_working(
    queue_url: str, namespace: str
) -> None:
    async with queue(queue_url, namespace) as q:
        await inject_raw(q, b"\x08\x96\x01 definitely not a prefill request")
        await q.publish(request(1))
        [d] = await q.fetch(2, timeout=2.0)
        assert d.request.request_id == "req-1"
        assert q.stats.malformed == 1
        await d.ack()
        assert (await q.depth()).pending == 0

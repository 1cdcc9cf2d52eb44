"""Preferred prefill workers on the queue, against JetStream and the embedded backend: a
request offered to one worker reaches it first and no other until released; a release
after it was taken moves nothing; a redelivery goes to anyone."""

from __future__ import annotations

from runtime.queue import PrefillQueue
from tests.runtime.rt_helpers import ACK_WAIT, queue, request


async def ids(q: PrefillQueue, worker: str | None, timeout: float = 0.5) -> list[str]:
    got = await q.fetch(8, timeout=timeout, worker_id=worker)
    for d in got:
        await d.ack()
    return sorted(d.request.request_id for d in got)


async def test_preferred_worker_first_and_alone(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        await q.publish(request(1))
        await q.publish(request(2), prefer="prefill-a")
        # another worker sees only the shared request
        assert await ids(q, "prefill-b") == ["req-1"]
        assert await ids(q, "prefill-b", timeout=0.3) == []
        assert await ids(q, None, timeout=0.3) == []
        # the preferred one gets its own (first, even behind shared work)
        await q.publish(request(3))
        got = await q.fetch(1, timeout=2.0, worker_id="prefill-a")
        assert [d.request.request_id for d in got] == ["req-2"]
        await got[0].ack()
        assert await ids(q, "prefill-a") == ["req-3"]


async def test_release_hands_it_to_everyone_unless_taken(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace) as q:
        r4, r5 = request(4), request(5)
        s4 = await q.publish(r4, prefer="prefill-a")
        s5 = await q.publish(r5, prefer="prefill-a")
        assert await q.release(r4, s4.sequence, "prefill-a")  # not taken yet: moved
        assert await ids(q, "prefill-b") == ["req-4"]
        [d] = await q.fetch(1, timeout=2.0, worker_id="prefill-a")
        assert d.request.request_id == "req-5"
        assert not await q.release(r5, s5.sequence, "prefill-a")  # taken: stays
        assert await ids(q, "prefill-b", timeout=0.3) == []
        await d.ack()
        assert not await q.release(r5, s5.sequence, "prefill-a", force=True)  # done: gone
        assert await ids(q, "prefill-b", timeout=0.3) == []


async def test_force_release_of_a_taken_request(queue_url: str, namespace: str) -> None:
    """The preferred worker took it and left (died or drains): forced, it is offered to
    the others at once; completion stays once-only through the claim."""
    async with queue(queue_url, namespace) as q:
        r = request(6)
        sent = await q.publish(r, prefer="prefill-a")
        [held] = await q.fetch(1, timeout=2.0, worker_id="prefill-a")
        assert await q.release(r, sent.sequence, "prefill-a", force=True)
        [other] = await q.fetch(1, timeout=2.0, worker_id="prefill-b")
        assert other.request.request_id == "req-6"
        assert await other.claim_completion()
        assert not await held.claim_completion()
        await other.ack()
        await held.ack()


async def test_redelivery_of_a_preferred_request_goes_to_anyone(
    queue_url: str, namespace: str
) -> None:
    async with queue(queue_url, namespace) as q:
        await q.publish(request(7), prefer="prefill-a")
        [d] = await q.fetch(1, timeout=2.0, worker_id="prefill-a")
        assert d.num_delivered == 1  # ...and prefill-a dies holding it
        if queue_url.startswith("embedded"):
            [again] = await q.fetch(1, timeout=ACK_WAIT * 3, worker_id="prefill-b")
            assert again.request.request_id == "req-7" and again.num_delivered == 2
            await again.ack()
        else:
            # JetStream redelivers to the preferred worker's consumer: the decode worker
            # releases with force when that worker leaves discovery
            [again] = await q.fetch(1, timeout=ACK_WAIT * 3, worker_id="prefill-a")
            assert again.num_delivered == 2
            await again.ack()

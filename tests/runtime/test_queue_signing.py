"""Signed prefill-queue messages (runtime/queue/signing.py), on JetStream and embedded.

With a deployment key, a consumer works only on what a holder of the key published:
an unsigned message, one signed with another key and a re-publish of recorded bytes
are dropped unseen and counted, with no dead letter (whose recipient the forged
message would name); a redelivery of a genuine one is still worked on. Dead letters
are signed too: a forged one would fail a live request, so readers skip it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.queue import DeadLetter, DeadLetterReason
from runtime.queue.embedded import EmbeddedPrefillQueue
from runtime.queue.signing import (
    Kind,
    Opened,
    Rejected,
    ReplayGuard,
    open_sealed,
    seal,
)
from tests.runtime.rt_helpers import ACK_WAIT, Letters, inject_raw, queue, request

KEY = b"k" * 32
OTHER = b"o" * 32


def test_seal_opens_only_with_its_key_and_kind() -> None:
    sealed = seal(KEY, Kind.REQUEST, b"body")
    opened = open_sealed(KEY, Kind.REQUEST, sealed)
    assert opened.body == b"body" and abs(opened.signed_at - time.time()) < 5
    cases = {
        "bad_signature": lambda: open_sealed(OTHER, Kind.REQUEST, sealed),
        "wrong_kind": lambda: open_sealed(KEY, Kind.DEAD_LETTER, sealed),
        "unsigned": lambda: open_sealed(KEY, Kind.REQUEST, b"body"),
    }
    for reason, attempt in cases.items():
        with pytest.raises(Rejected) as e:
            attempt()
        assert e.value.reason == reason
    for i in range(len(sealed)):  # any flipped byte
        tampered = bytearray(sealed)
        tampered[i] ^= 1
        with pytest.raises(Rejected):
            open_sealed(KEY, Kind.REQUEST, bytes(tampered))


def test_replay_guard_tells_a_redelivery_from_a_replay() -> None:
    guard, now = ReplayGuard(), 1000.0
    a = Opened(b"", now, b"n" * 16)
    guard.check(a, position=5, deadline=now + 30, now=now)
    guard.check(a, position=5, deadline=now + 30, now=now + 1)  # redelivered: same place
    with pytest.raises(Rejected) as e:
        guard.check(a, position=9, deadline=now + 30, now=now + 2)
    assert e.value.reason == "replayed"
    with pytest.raises(Rejected) as e:
        guard.check(Opened(b"", now + 60, b"f" * 16), 10, now + 90, now)
    assert e.value.reason == "future"
    guard.check(Opened(b"", now, b"x" * 16), 11, now + 31, now + 2)
    assert len(guard) == 2
    guard.check(Opened(b"", now, b"y" * 16), 12, now + 90, now + 40)  # both past: forgotten
    assert len(guard) == 1


async def _no_work(q: object, timeout: float = 0.5) -> None:
    assert await q.fetch(4, timeout=timeout) == []  # type: ignore[attr-defined]


async def test_unsigned_foreign_and_replayed_messages_are_dropped(
    queue_url: str, namespace: str
) -> None:
    async with queue(queue_url, namespace, signing_key=KEY) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        await inject_raw(q, request(1).encode())  # what an open queue took before
        await inject_raw(q, seal(OTHER, Kind.REQUEST, request(2).encode()))
        await _no_work(q)
        assert q.stats.rejected == {"unsigned": 1, "bad_signature": 1}
        assert (await q.depth()).pending == 0  # removed, not left for another consumer

        recorded = q._encode(request(3))  # bytes a subscriber could have seen
        await inject_raw(q, recorded)
        [d] = await q.fetch(4, timeout=2.0)
        assert d.request.request_id == "req-3"
        await inject_raw(q, recorded)  # published again by whoever recorded it
        await _no_work(q)
        assert q.stats.rejected["replayed"] == 1
        await d.ack()
        await asyncio.sleep(0.3)
        assert letters.items == []  # none of it was dead-lettered to the named worker
        await letters.stop()


async def test_a_signed_message_is_redelivered_and_dead_lettered_as_before(
    queue_url: str, namespace: str
) -> None:
    async with queue(queue_url, namespace, signing_key=KEY, max_deliveries=2) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=2.0)  # a consumer that dies holding it
        [again] = await q.fetch(1, timeout=ACK_WAIT * 3)
        assert again.num_delivered == 2 and again.position == d.position
        await again.term("no")
        [letter] = await letters.wait(1)
        assert letter.request_id == "req-1" and letter.reason is DeadLetterReason.TERMINATED
        assert q.stats.rejected == {}
        await letters.stop()


async def test_forged_dead_letters_are_skipped(queue_url: str, namespace: str) -> None:
    async with queue(queue_url, namespace, signing_key=KEY) as q:
        letters = Letters(q, "decode-0")
        await asyncio.sleep(0.2)
        forged = DeadLetter("req-9", "decode-0", DeadLetterReason.TERMINATED, "forged")
        for i, data in enumerate((forged.encode(), seal(OTHER, Kind.DEAD_LETTER, forged.encode()))):
            await _inject_dead_letter(q, "decode-0", f"forged-{i}", data)
        await q.publish(request(1))
        [d] = await q.fetch(1, timeout=2.0)
        await d.term("genuine")
        [letter] = await letters.wait(1)
        await asyncio.sleep(0.3)
        assert [x.request_id for x in letters.items] == ["req-1"], letter
        assert q.stats.rejected == {"unsigned": 1, "bad_signature": 1}
        await letters.stop()


async def _inject_dead_letter(q: object, worker: str, rid: str, data: bytes) -> None:
    if isinstance(q, EmbeddedPrefillQueue):
        await q._store.write(
            lambda c, now: c.execute(
                "INSERT INTO dead (decode_worker_id, request_id, payload, at) VALUES (?, ?, ?, ?)",
                (worker, rid, data, now),
            )
        )
    else:
        js = q._js  # type: ignore[attr-defined]
        await js.publish(q._dead_prefix + worker, data, stream=q._dead_stream)  # type: ignore[attr-defined]

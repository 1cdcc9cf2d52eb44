from __future__ import annotations

import asyncio
import threading
import time

import pytest

from transfer import PeerDisconnectedError, TransferHandle, TransferState
from transfer.handle import Notification, NotificationQueue


def test_handle_completes_once() -> None:
    h = TransferHandle("write", "decode", 10)
    assert h.poll() is TransferState.PENDING and h.error is None and h.duration is None
    seen: list[TransferState] = []
    h.add_done_callback(lambda x: seen.append(x.poll()))
    assert h.set_done()
    assert not h.set_failed(PeerDisconnectedError("decode", "late"))  # too late: first wins
    assert h.poll() is TransferState.DONE and seen == [TransferState.DONE]
    assert h.duration is not None and h.duration >= 0
    h.result(0)


def test_completion_work_runs_once_before_any_waiter_wakes() -> None:
    """An agent counts a transfer in `first`; a waiter woken by the completion (here a
    done callback, or a thread blocked in result) must already see the count."""
    h = TransferHandle("read", "peer", 4)
    counted: list[int] = []
    seen: list[int] = []
    h.add_done_callback(lambda _h: seen.append(len(counted)))
    waiter = threading.Thread(target=lambda: (h.result(5), seen.append(len(counted))))
    waiter.start()
    racers = [
        threading.Thread(target=h.set_done, args=(lambda: counted.append(1),)) for _ in range(4)
    ]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    waiter.join(5)
    assert counted == [1] and seen == [1, 1]
    assert not h.set_failed(RuntimeError("late"), lambda: counted.append(2))
    assert counted == [1] and h.poll() == TransferState.DONE


async def test_handle_failure_is_raised_by_wait_and_result() -> None:
    h = TransferHandle("read", "decode", 10)
    h.set_failed(PeerDisconnectedError("decode", "gone"))
    assert h.poll() is TransferState.FAILED and isinstance(h.error, PeerDisconnectedError)
    with pytest.raises(PeerDisconnectedError):
        h.result()
    with pytest.raises(PeerDisconnectedError):
        await h.wait()


async def test_wait_timeout_leaves_the_transfer_running() -> None:
    h = TransferHandle("write", "decode", 10)
    with pytest.raises(TimeoutError):
        await h.wait(0.01)
    threading.Timer(0.05, h.set_done).start()  # completed by another thread
    await h.wait(5)
    assert h.poll() is TransferState.DONE
    with pytest.raises(TimeoutError):
        TransferHandle("write", "x", 0).result(0.01)


def _note(i: int) -> Notification:
    return Notification("p", "i" * 32, str(i).encode(), "write", 0)


async def test_notifications_from_threads_reach_async_consumers_each_once() -> None:
    q = NotificationQueue()

    async def consume(out: list[bytes]) -> None:
        async for n in q:
            out.append(n.payload)

    a: list[bytes] = []
    b: list[bytes] = []
    tasks = [asyncio.create_task(consume(a)), asyncio.create_task(consume(b))]
    await asyncio.sleep(0.01)

    def produce() -> None:
        for i in range(200):
            q.put(_note(i))
            if i % 50 == 0:
                time.sleep(0.001)
        q.close()

    threading.Thread(target=produce).start()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert sorted(a + b, key=int) == [str(i).encode() for i in range(200)]


def test_notification_queue_sync_access() -> None:
    q = NotificationQueue()
    assert q.get_nowait() == [] and q.get(timeout=0.01) is None
    q.put(_note(1))
    q.put(_note(2))
    assert len(q) == 2
    first = q.get(timeout=1)
    assert first is not None and first.payload == b"1"
    assert [n.payload for n in q.get_nowait()] == [b"2"]
    q.close()
    q.put(_note(3))  # dropped once closed
    assert q.get(timeout=0.01) is None

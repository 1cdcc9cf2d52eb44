"""The prefill queue for one host without a server: a SQLite file per namespace.

A delivery claims a row by stamping it with a token and a visibility deadline
(``now + ack_wait``) in one transaction, so two consumers never hold the same delivery.
Acks delete the row; ``in_progress`` and ``nak`` act only for the current holder, so a
consumer whose ack-wait already ran out cannot disturb the next one. Consumers poll: a read
that takes no lock, backing off from 0.5 ms to ``poll_interval`` while the queue is idle.
A preferred request carries its worker in ``target``: only that worker's fetches see it
(first) until ``release`` clears the column or its first delivery has run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from runtime.errors import NotConnected
from runtime.queue.base import Delivery, PrefillQueue
from runtime.queue.messages import DeadLetter
from runtime.queue.options import PublishResult, QueueDepth, QueueFull, QueueOptions
from runtime.sqlite_store import SqliteStore

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    payload BLOB NOT NULL,
    published_at REAL NOT NULL,
    visible_at REAL NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 0,
    holder TEXT,
    target TEXT
);
CREATE INDEX IF NOT EXISTS messages_by_visible ON messages(visible_at);
CREATE INDEX IF NOT EXISTS messages_by_published ON messages(published_at);
CREATE TABLE IF NOT EXISTS published (request_id TEXT PRIMARY KEY, seq INTEGER, at REAL);
CREATE INDEX IF NOT EXISTS published_by_at ON published(at);
CREATE TABLE IF NOT EXISTS done (request_id TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS done_by_at ON done(at);
CREATE TABLE IF NOT EXISTS dead (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    decode_worker_id TEXT NOT NULL,
    request_id TEXT NOT NULL UNIQUE,
    payload BLOB NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_by_worker ON dead(decode_worker_id, seq);
"""

_MIN_POLL = 0.0005


class _EmbeddedDelivery(Delivery):
    def __init__(self, queue: EmbeddedPrefillQueue, seq: int, holder: str, num: int) -> None:
        super().__init__(queue, num, seq)
        self._q = queue
        self._seq = seq
        self._holder = holder

    async def _ack(self) -> None:
        await self._q._store.write(lambda c, now: _delete(c, self._seq))

    async def _term(self) -> None:
        await self._q._store.write(lambda c, now: _delete(c, self._seq))

    async def _nak(self, delay: float) -> None:
        await self._q._store.write(
            lambda c, now: c.execute(
                "UPDATE messages SET holder = NULL, visible_at = ? WHERE seq = ? AND holder = ?",
                (now + delay, self._seq, self._holder),
            )
        )

    async def _progress(self) -> None:
        ack_wait = self._q.options.ack_wait
        await self._q._store.write(
            lambda c, now: c.execute(
                "UPDATE messages SET visible_at = ? WHERE seq = ? AND holder = ?",
                (now + ack_wait, self._seq, self._holder),
            )
        )


class EmbeddedPrefillQueue(PrefillQueue):
    def __init__(self, state_dir: Path, options: QueueOptions) -> None:
        super().__init__(options)
        self.state_dir = state_dir
        self._store = SqliteStore(state_dir / f"prefill-{options.namespace}.sqlite3", _SCHEMA)
        self._consumer = uuid.uuid4().hex[:12]

    async def connect(self) -> None:
        await self._store.open()
        await self._store.write(_add_target_column)

    async def close(self) -> None:
        await self._store.close()

    async def _publish(self, request_id: str, data: bytes, prefer: str | None) -> PublishResult:
        opts = self.options

        def publish(conn: sqlite3.Connection, now: float) -> PublishResult:
            conn.execute("DELETE FROM published WHERE at < ?", (now - opts.dedup_window,))
            row = conn.execute(
                "SELECT seq FROM published WHERE request_id = ?", (request_id,)
            ).fetchone()
            if row is not None:
                return PublishResult(row[0], duplicate=True)
            conn.execute("DELETE FROM messages WHERE published_at < ?", (now - opts.retention,))
            (count,) = conn.execute("SELECT COUNT(*) FROM messages").fetchone()
            if count >= opts.max_pending:
                raise QueueFull(f"the prefill queue holds {count} requests (max_pending)")
            cur = conn.execute(
                "INSERT INTO messages (request_id, payload, published_at, visible_at, target) "
                "VALUES (?, ?, ?, ?, ?)",
                (request_id, data, now, now, prefer),
            )
            assert cur.lastrowid is not None
            conn.execute(
                "INSERT INTO published (request_id, seq, at) VALUES (?, ?, ?)",
                (request_id, cur.lastrowid, now),
            )
            return PublishResult(cur.lastrowid, duplicate=False)

        return await self._store.write(publish)

    async def _release(
        self, request_id: str, data: bytes, sequence: int, prefer: str, force: bool
    ) -> bool:
        def release(conn: sqlite3.Connection, now: float) -> bool:
            cur = conn.execute(
                "UPDATE messages SET target = NULL WHERE seq = ? AND target = ? "
                "AND (deliveries = 0 OR ?)",
                (sequence, prefer, force),
            )
            return cur.rowcount == 1

        return await self._store.write(release)

    async def _fetch(
        self, batch: int, timeout: float, worker_id: str | None
    ) -> list[tuple[bytes, Delivery]]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        pause = _MIN_POLL
        visible = functools.partial(_any_visible, worker_id)
        while True:
            if await self._store.read(visible):
                claimed = await self._store.write(
                    lambda c, now: self._claim(c, now, batch, worker_id)
                )
                if claimed:
                    return claimed
            remaining = end - loop.time()
            if remaining <= 0:
                return []
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, self.options.poll_interval)

    def _claim(
        self, conn: sqlite3.Connection, now: float, batch: int, worker_id: str | None
    ) -> list[tuple[bytes, Delivery]]:
        holder = f"{self._consumer}-{uuid.uuid4().hex[:8]}"
        rows = conn.execute(
            "UPDATE messages SET holder = ?, visible_at = ?, deliveries = deliveries + 1 "
            f"WHERE seq IN (SELECT seq FROM messages WHERE visible_at <= ? AND {_FOR_WORKER} "
            "ORDER BY target IS NULL, seq LIMIT ?) RETURNING seq, payload, deliveries",
            (holder, now + self.options.ack_wait, now, worker_id, batch),
        ).fetchall()
        rows.sort()
        return [
            (bytes(payload), _EmbeddedDelivery(self, seq, holder, num))
            for seq, payload, num in rows
        ]

    async def _mark_done(self, request_id: str, claimant: str) -> bool:
        # one local transaction: it commits or raises, so a retried claim never meets a
        # mark of its own (the claimant is not needed here)
        ttl = self.options.done_ttl

        def mark(conn: sqlite3.Connection, now: float) -> bool:
            conn.execute("DELETE FROM done WHERE at < ?", (now - ttl,))
            cur = conn.execute(
                "INSERT OR IGNORE INTO done (request_id, at) VALUES (?, ?)", (request_id, now)
            )
            return cur.rowcount == 1

        return await self._store.write(mark)

    async def _is_done(self, request_id: str) -> bool:
        ttl = self.options.done_ttl
        row = await self._store.read(
            lambda c, now: c.execute(
                "SELECT 1 FROM done WHERE request_id = ? AND at >= ?", (request_id, now - ttl)
            ).fetchone()
        )
        return row is not None

    async def _put_dead_letter(self, letter: DeadLetter, data: bytes) -> None:
        retention = self.options.retention

        def put(conn: sqlite3.Connection, now: float) -> None:
            conn.execute("DELETE FROM dead WHERE at < ?", (now - retention,))
            conn.execute(
                "INSERT OR IGNORE INTO dead (decode_worker_id, request_id, payload, at) "
                "VALUES (?, ?, ?, ?)",
                (letter.decode_worker_id, letter.request_id, data, now),
            )

        await self._store.write(put)

    def dead_letters(self, decode_worker_id: str) -> AsyncIterator[DeadLetter]:
        return self._read_dead_letters(self._check_dead_letter_target(decode_worker_id))

    async def _read_dead_letters(self, worker: str) -> AsyncIterator[DeadLetter]:
        try:
            (last,) = await self._store.read(
                lambda c, now: c.execute("SELECT COALESCE(MAX(seq), 0) FROM dead").fetchone()
            )
            pause = _MIN_POLL
            while True:
                rows = await self._store.read(functools.partial(_dead_after, worker, last))
                for seq, payload in rows:
                    last = seq
                    letter = self._open_dead_letter(bytes(payload))
                    if letter is not None:
                        yield letter
                if rows:
                    pause = _MIN_POLL
                    continue
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.options.poll_interval * 5)
        except NotConnected:
            return  # the queue was closed

    async def depth(self) -> QueueDepth:
        total, in_flight = await self._store.read(
            lambda c, now: c.execute(
                "SELECT COUNT(*), COALESCE(SUM(holder IS NOT NULL AND visible_at > ?), 0) "
                "FROM messages",
                (now,),
            ).fetchone()
        )
        return QueueDepth(pending=total - in_flight, in_flight=in_flight)


# Whom a message is for: everyone, the worker it prefers, or (a redelivery) anyone.
_FOR_WORKER = "(target IS NULL OR target = ? OR deliveries > 0)"


def _any_visible(worker_id: str | None, conn: sqlite3.Connection, now: float) -> bool:
    row = conn.execute(
        f"SELECT 1 FROM messages WHERE visible_at <= ? AND {_FOR_WORKER} LIMIT 1",
        (now, worker_id),
    ).fetchone()
    return row is not None


def _add_target_column(conn: sqlite3.Connection, now: float) -> None:
    """A queue file written before preferences existed gets the column."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
    if "target" not in columns:
        with contextlib.suppress(sqlite3.OperationalError):  # another process was first
            conn.execute("ALTER TABLE messages ADD COLUMN target TEXT")


def _dead_after(
    worker: str, after: int, conn: sqlite3.Connection, now: float
) -> list[tuple[int, bytes]]:
    return conn.execute(
        "SELECT seq, payload FROM dead WHERE decode_worker_id = ? AND seq > ? ORDER BY seq",
        (worker, after),
    ).fetchall()


def _delete(conn: sqlite3.Connection, seq: int) -> None:
    conn.execute("DELETE FROM messages WHERE seq = ?", (seq,))

"""A SQLite database shared by the processes of one host: the embedded backends' storage.

Why SQLite: it gives atomic multi-process transactions on one file with no server, which is
what the embedded discovery (leases) and prefill queue (claims, acks) need. WAL mode lets
readers proceed while one writer commits; ``BEGIN IMMEDIATE`` takes the write lock up front
so two writers never deadlock upgrading a read lock.

Calls run on one dedicated thread per store, so a transaction waiting for another
process's lock (up to ``busy_timeout``) never blocks the event loop. Each process opens its
own connection; the database file must be on a local filesystem (not NFS).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from runtime.errors import BackendUnavailable, NotConnected

T = TypeVar("T")

BUSY_TIMEOUT_S = 10.0


class SqliteStore:
    def __init__(self, path: Path, schema: str) -> None:
        self.path = path
        self._schema = schema
        self._conn: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def open(self) -> None:
        if self._conn is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diptych-sqlite")
        try:
            self._conn = await self._in_thread(self._open)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise

    def _open(self) -> sqlite3.Connection:
        """Connect, switch to WAL and create the schema. Switching the journal mode
        needs the database to itself and SQLite answers "database is locked" at once,
        without waiting out busy_timeout, while another process is doing the same: two
        workers starting together on a fresh state directory met that. So a locked
        open is retried, with a short backoff, for up to BUSY_TIMEOUT_S."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.01
        while True:
            conn: sqlite3.Connection | None = None
            try:
                conn = sqlite3.connect(
                    self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
                )
                conn.execute("PRAGMA journal_mode=WAL")
                # NORMAL is durable against process crashes (what the embedded mode guards
                # against); only a power loss may drop the last transactions.
                conn.execute("PRAGMA synchronous=NORMAL")
                # Every statement of the schema is CREATE ... IF NOT EXISTS, so processes
                # starting together may all run it.
                conn.executescript(self._schema)
                _owner_only(self.path)
                return conn
            except sqlite3.Error as e:
                if conn is not None:
                    conn.close()
                locked = isinstance(e, sqlite3.OperationalError) and "locked" in str(e)
                if not locked or time.monotonic() + pause > deadline:
                    raise BackendUnavailable(f"cannot open state database {self.path}: {e}") from e
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    async def close(self) -> None:
        conn, executor = self._conn, self._executor
        self._conn = self._executor = None
        if conn is not None and executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, conn.close)
            executor.shutdown(wait=True)

    async def write(self, fn: Callable[[sqlite3.Connection, float], T]) -> T:
        """Run ``fn(conn, now)`` inside one ``BEGIN IMMEDIATE`` transaction."""
        return await self._in_thread(lambda: self._transaction(fn, immediate=True))

    async def read(self, fn: Callable[[sqlite3.Connection, float], T]) -> T:
        """Run ``fn(conn, now)`` inside one read transaction (a consistent snapshot)."""
        return await self._in_thread(lambda: self._transaction(fn, immediate=False))

    def _transaction(self, fn: Callable[[sqlite3.Connection, float], T], *, immediate: bool) -> T:
        conn = self._conn
        if conn is None:
            raise NotConnected(f"state database {self.path} is closed")
        try:
            conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                result = fn(conn, time.time())
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        except sqlite3.OperationalError as e:
            raise BackendUnavailable(f"state database {self.path}: {e}") from e

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise NotConnected(f"state database {self.path} is closed")
        # in the caller's context, as asyncio.to_thread runs it (context variables hold)
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn)


def _owner_only(db: Path) -> None:
    """The database and its WAL files readable by their owner alone: they hold queued
    prompts and worker records. (A file another user created is left as it is.)"""
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        try:
            if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
                path.chmod(0o600)
        except FileNotFoundError:
            pass

"""Opening the embedded state database while other processes open or write it.

SQLite refuses some locks at once, without waiting out the busy timeout: switching a
fresh database to WAL while another connection does the same, or a WAL snapshot that
another process's commit made stale. Two workers of one `diptych serve` starting
together on a fresh state directory died that way ("cannot open state database ...:
database is locked"), so a locked open is retried within the busy timeout.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from runtime import sqlite_store
from runtime.discovery.embedded import _SCHEMA as SCHEMA
from runtime.errors import BackendUnavailable
from runtime.sqlite_store import SqliteStore

OPENER = """
import asyncio, sys, time
from pathlib import Path
from runtime.sqlite_store import SqliteStore

async def main():
    store = SqliteStore(Path(sys.argv[1]), sys.argv[3])
    while time.time() < float(sys.argv[2]):
        pass  # everyone opens at the same instant
    await store.open()
    await store.write(lambda conn, now: conn.execute("SELECT 1").fetchone())
    await store.close()

asyncio.run(main())
"""


class _Flaky:
    """A connection whose first `fails` statements say the database is locked."""

    def __init__(self, conn: sqlite3.Connection, fails: list[str]) -> None:
        self._conn, self._fails = conn, fails

    def execute(self, sql: str) -> Any:
        if self._fails:
            raise sqlite3.OperationalError(self._fails.pop())
        return self._conn.execute(sql)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_a_locked_open_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fails = ["database is locked", "database is locked"]
    real = sqlite3.connect
    attempts: list[int] = []

    def connect(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        return _Flaky(real(*args, **kwargs), fails)

    monkeypatch.setattr(sqlite_store.sqlite3, "connect", connect)
    conn = SqliteStore(tmp_path / "db.sqlite3", SCHEMA)._open()
    assert len(attempts) == 3 and not fails
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_other_errors_are_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = sqlite3.connect
    attempts: list[int] = []

    def connect(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        return _Flaky(real(*args, **kwargs), ["disk I/O error"])

    monkeypatch.setattr(sqlite_store.sqlite3, "connect", connect)
    with pytest.raises(BackendUnavailable, match=r"cannot open state database .*disk I/O error"):
        SqliteStore(tmp_path / "db.sqlite3", SCHEMA)._open()
    assert len(attempts) == 1


def test_processes_opening_a_fresh_database_together_all_succeed(tmp_path: Path) -> None:
    path = tmp_path / "state" / "db.sqlite3"
    start = time.time() + 1.5  # after every interpreter has started
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(path), str(start), SCHEMA],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-1500:]


async def test_the_database_is_its_owners_alone(tmp_path: Path) -> None:
    """Even under a permissive umask: it holds queued prompts and worker records."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = SqliteStore(tmp_path / "state" / "db.sqlite3", SCHEMA)
        await store.open()
        await store.write(lambda c, now: None)
        await store.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    for p in (tmp_path / "state").iterdir():
        assert not p.stat().st_mode & 0o077, (p, oct(p.stat().st_mode))

"""Discovery for one host without a server: leases and records in a SQLite file.

Same semantics as etcd: a record lives while its lease is refreshed within ``ttl``;
any process's next write purges expired leases and their records, and readers never see
an expired record even before it is purged. Watchers poll every ``poll_interval`` (a
query on a few rows), which bounds how late they see a change.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from runtime.discovery.base import Change, Discovery, DiscoveryOptions
from runtime.errors import ControlPlaneError
from runtime.sqlite_store import SqliteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    lease INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS records_by_lease ON records(lease);
"""

DB_NAME = "discovery.sqlite3"


class EmbeddedDiscovery(Discovery):
    def __init__(self, state_dir: Path, options: DiscoveryOptions) -> None:
        super().__init__(options)
        self.state_dir = state_dir
        self._store = SqliteStore(state_dir / DB_NAME, _SCHEMA)

    async def connect(self) -> None:
        await self._store.open()

    async def _close_backend(self) -> None:
        await self._store.close()

    async def _grant(self, ttl: float) -> Any:
        def grant(conn: sqlite3.Connection, now: float) -> int:
            _purge(conn, now)
            cur = conn.execute(
                "INSERT INTO leases (ttl, expires_at) VALUES (?, ?)", (ttl, now + ttl)
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

        return await self._store.write(grant)

    async def _put(self, key: str, value: bytes, lease: Any) -> None:
        def put(conn: sqlite3.Connection, now: float) -> None:
            row = conn.execute(
                "SELECT 1 FROM leases WHERE id = ? AND expires_at > ?", (lease, now)
            ).fetchone()
            if row is None:
                raise ControlPlaneError(f"lease {lease} of {key} has expired")
            conn.execute(
                "INSERT INTO records (key, value, lease) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value, lease = excluded.lease",
                (key, value, lease),
            )

        await self._store.write(put)

    async def _keepalive(self, lease: Any) -> bool:
        def refresh(conn: sqlite3.Connection, now: float) -> bool:
            cur = conn.execute(
                "UPDATE leases SET expires_at = ? + ttl WHERE id = ? AND expires_at > ?",
                (now, lease, now),
            )
            _purge(conn, now)
            return cur.rowcount == 1

        return await self._store.write(refresh)

    async def _read(self, key: str) -> bytes | None:
        def read(conn: sqlite3.Connection, now: float) -> bytes | None:
            row = conn.execute(
                "SELECT r.value FROM records r JOIN leases l ON l.id = r.lease "
                "WHERE r.key = ? AND l.expires_at > ?",
                (key, now),
            ).fetchone()
            return bytes(row[0]) if row else None

        return await self._store.read(read)

    async def _revoke(self, lease: Any) -> None:
        def revoke(conn: sqlite3.Connection, now: float) -> None:
            conn.execute("DELETE FROM records WHERE lease = ?", (lease,))
            conn.execute("DELETE FROM leases WHERE id = ?", (lease,))

        await self._store.write(revoke)

    async def _snapshot(self, prefix: str) -> tuple[dict[str, bytes], int]:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)

        def scan(conn: sqlite3.Connection, now: float) -> dict[str, bytes]:
            rows = conn.execute(
                "SELECT r.key, r.value FROM records r JOIN leases l ON l.id = r.lease "
                "WHERE r.key >= ? AND r.key < ? AND l.expires_at > ?",
                (prefix, end, now),
            ).fetchall()
            return {key: bytes(value) for key, value in rows}

        return await self._store.read(scan), 0

    def _changes(
        self, prefix: str, revision: int, snapshot: dict[str, bytes]
    ) -> AsyncGenerator[list[Change], None]:
        return self._polled_changes(prefix, snapshot, self.options.poll_interval)


def _purge(conn: sqlite3.Connection, now: float) -> None:
    conn.execute(
        "DELETE FROM records WHERE lease IN (SELECT id FROM leases WHERE expires_at <= ?)", (now,)
    )
    conn.execute("DELETE FROM leases WHERE expires_at <= ?", (now,))

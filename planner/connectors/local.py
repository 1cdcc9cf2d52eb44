"""The local connector: `diptych serve`'s launcher starts and stops the workers.

The launcher serves a small control endpoint on loopback (`diptych.local_fleet`);
`scale` sets a pool's desired size there, and the launcher starts new worker
processes or drains and stops surplus ones. Level-triggered like every connector:
asking again for the size already asked is harmless.
"""

from __future__ import annotations

from typing import Any

import httpx


class LocalConnector:
    name = "local"

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        if not url:
            raise ValueError("the local connector needs the launcher's control URL")
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def scale(self, pool: str, replicas: int) -> None:
        r = await self._client.put(f"{self.url}/pools/{pool}", json={"replicas": replicas})
        if r.status_code != 200:
            raise RuntimeError(f"the launcher refused {pool}={replicas}: {_error(r)}")

    async def current(self, pool: str) -> int | None:
        """The launcher's desired size of `pool` (its workers running or starting)."""
        entry = (await self.pools()).get(pool)
        return int(entry["desired"]) if isinstance(entry, dict) and "desired" in entry else None

    async def pools(self) -> dict[str, Any]:
        """What the launcher runs: per pool, desired, running and ready workers."""
        r = await self._client.get(f"{self.url}/pools")
        r.raise_for_status()
        doc: dict[str, Any] = r.json()
        return doc

    async def close(self) -> None:
        await self._client.aclose()


def _error(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", r.text))
    except ValueError:
        return f"HTTP {r.status_code} {r.text[:200]}"

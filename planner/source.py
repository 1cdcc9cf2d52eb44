"""OBSERVE, the I/O half: one round of `/metrics` from the frontends and from every
worker discovery lists, fetched concurrently with a timeout each.

A worker that does not answer is left out of the round (it is not ready, as far as
the planner can tell); a frontend that does not answer makes the whole round fail
(`ScrapeError`): without the request rate no decision is sound, so the planner skips
the tick rather than acting on half a picture.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from planner.observation import POOLS
from planner.scrape import Labels, Snapshot
from runtime.discovery import Discovery


class ScrapeError(RuntimeError):
    """No usable round: the frontend's metrics could not be read."""


@dataclass(frozen=True)
class Round:
    frontend: Snapshot
    workers: dict[str, dict[str, Snapshot]] = field(default_factory=dict)  # pool -> id -> ...


class RoundSource(Protocol):
    async def scrape(self) -> Round: ...


def merged(snapshots: Sequence[Snapshot]) -> Snapshot:
    """Several frontends' expositions as one: samples with the same labels summed."""
    out: dict[str, dict[Labels, float]] = {}
    for snap in snapshots:
        for name, series in snap.samples.items():
            into = out.setdefault(name, {})
            for labels, v in series.items():
                into[labels] = into.get(labels, 0.0) + v
    return Snapshot(out)


def pairs(old: Round, new: Round) -> dict[str, dict[str, tuple[Snapshot, Snapshot]]]:
    """(previous, current) snapshots of each worker present in both rounds, per pool and
    worker id."""
    out: dict[str, dict[str, tuple[Snapshot, Snapshot]]] = {}
    for pool in POOLS:
        before = old.workers.get(pool, {})
        now = new.workers.get(pool, {})
        out[pool] = {w: (before[w], now[w]) for w in sorted(now) if w in before}
    return out


DNS_SCHEME = "dns+"


async def frontend_addresses(urls: Sequence[str]) -> list[str]:
    """The frontend URLs to read this tick: a `dns+http://name:port` URL stands for every
    address `name` resolves to now (a headless Service: each frontend replica once, so
    their request counts add up), the others as given."""
    out: list[str] = []
    loop = asyncio.get_running_loop()
    for url in urls:
        if not url.startswith(DNS_SCHEME):
            out.append(url)
            continue
        parts = urlsplit(url[len(DNS_SCHEME) :])
        if not parts.hostname:
            raise ScrapeError(f"{url!r} names no host")
        try:
            found = await loop.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ScrapeError(f"cannot resolve the frontends at {url}: {e}") from e
        hosts = sorted({str(info[4][0]) for info in found})
        port = f":{parts.port}" if parts.port else ""
        out += [f"{parts.scheme}://{f'[{h}]' if ':' in h else h}{port}{parts.path}" for h in hosts]
    return out


class MetricsSource:
    def __init__(
        self, discovery: Discovery, frontend_urls: Sequence[str], timeout_s: float = 2.0
    ) -> None:
        if not frontend_urls:
            raise ValueError("the planner needs at least one frontend URL to read metrics from")
        self.discovery = discovery
        self.frontend_urls = [u.rstrip("/") for u in frontend_urls]
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def close(self) -> None:
        await self._client.aclose()

    async def _get(self, url: str) -> Snapshot:
        r = await self._client.get(url)
        r.raise_for_status()
        return Snapshot.parse(r.text)

    async def scrape(self) -> Round:
        urls = await frontend_addresses(self.frontend_urls)
        fronts = await asyncio.gather(
            *(self._get(u + "/metrics") for u in urls), return_exceptions=True
        )
        failed = [(u, e) for u, e in zip(urls, fronts, strict=True)
                  if isinstance(e, BaseException)]  # fmt: skip
        if failed:
            url, err = failed[0]
            raise ScrapeError(f"frontend metrics at {url} unreadable: {err!r}")
        workers: dict[str, dict[str, Snapshot]] = {}
        for pool in POOLS:
            infos = [w for w in await self.discovery.list(pool) if w.metrics_address]
            got = await asyncio.gather(
                *(self._get(f"http://{w.metrics_address}/metrics") for w in infos),
                return_exceptions=True,
            )
            workers[pool] = {
                w.worker_id: s for w, s in zip(infos, got, strict=True) if isinstance(s, Snapshot)
            }
        return Round(merged([f for f in fronts if isinstance(f, Snapshot)]), workers)

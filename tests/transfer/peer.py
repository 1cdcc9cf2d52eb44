"""A transfer agent in its own process, driven by JSON lines on stdin/stdout.

The two-process tests start one of these per agent (inside a private network
namespace for nixl and ucx) and script it through `conftest.PeerProcess`.
Every notification is checked the moment it arrives: if its payload names
blocks and their digest, the receiver hashes those blocks of its own pool right
then, which proves the data landed before the notification.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import logging
import os
import sys
import traceback
from typing import Any

import numpy as np


def _digest(pool: np.ndarray, blocks: list[int], block_bytes: int) -> str:
    h = hashlib.sha256()
    for b in blocks:
        h.update(pool[b * block_bytes : (b + 1) * block_bytes].data)
    return h.hexdigest()


class Peer:
    def __init__(self) -> None:
        self.agent: Any = None
        self.pool: Any = None
        self.block_bytes = 0
        self.handles: list[Any] = []
        self.notes: list[dict[str, Any]] = []
        self.collector: asyncio.Task[None] | None = None

    async def op_init(
        self, name: str, backend: Any, pool_bytes: int, block_bytes: int, **kw: Any
    ) -> Any:
        from transfer import Agent

        self.agent = Agent(
            name, backend=backend if isinstance(backend, str) else tuple(backend), **kw
        )
        self.pool = self.agent.allocate(pool_bytes)
        self.block_bytes = block_bytes
        self.collector = asyncio.create_task(self._collect())
        return {"md": self.agent.metadata().decode(), "backends": self.agent.backends}

    async def _collect(self) -> None:
        pool = self.pool.numpy()
        async for n in self.agent.notifications():
            rec: dict[str, Any] = {
                "peer": n.peer,
                "kind": n.kind,
                "nbytes": n.nbytes,
                "grant": n.grant,
            }
            rec["payload"] = base64.b64encode(n.payload).decode()
            try:
                body = json.loads(n.payload)
            except ValueError:
                body = None
            if isinstance(body, dict) and "digest" in body:
                rec["verified"] = _digest(pool, body["blocks"], self.block_bytes) == body["digest"]
            self.notes.append(rec)

    async def op_add_remote(self, md: str, expect_layout: str | None = None) -> Any:
        return self.agent.add_remote(md.encode(), expect_layout=expect_layout)

    async def op_remove_remote(self, name: str) -> Any:
        return self.agent.remove_remote(name)

    async def op_backend_for(self, name: str) -> Any:
        return self.agent.backend_for(name)

    async def op_fill(self, seed: int) -> Any:
        a = self.pool.numpy()
        a[:] = np.random.default_rng(seed).integers(0, 256, a.size, dtype=np.uint8)
        return True

    async def op_digest(self, blocks: list[int]) -> Any:
        return _digest(self.pool.numpy(), blocks, self.block_bytes)

    def _descs(self, region: int, blocks: list[int]) -> Any:
        from transfer import DescList

        return DescList.blocks(region, blocks, self.block_bytes)

    async def op_write(
        self,
        peer: str,
        src: list[int],
        dst: list[int],
        note: str | None = None,
        region: int = 0,
        grant: str | None = None,
    ) -> Any:
        note_b = None if note is None else note.encode()
        local, remote = self._descs(self.pool.id, src), self._descs(region, dst)
        h = self.agent.write(local, peer, remote, notification=note_b, grant=grant)
        self.handles.append(h)
        return len(self.handles) - 1

    async def op_guard(self) -> Any:
        self.agent.guard(self.pool)
        return True

    async def op_grant(self, blocks: list[int], ttl: float = 60.0) -> Any:
        return self.agent.grant(self._descs(self.pool.id, blocks), ttl)

    async def op_revoke(self, grant: str) -> Any:
        return self.agent.revoke(grant)

    async def op_read(
        self, peer: str, src: list[int], dst: list[int], note: str | None = None
    ) -> Any:
        note_b = None if note is None else note.encode()
        h = self.agent.read(
            self._descs(self.pool.id, dst), peer, self._descs(0, src), notification=note_b
        )
        self.handles.append(h)
        return len(self.handles) - 1

    async def op_notify(self, peer: str, payload: str, grant: str | None = None) -> Any:
        self.handles.append(self.agent.notify(peer, payload.encode(), grant=grant))
        return len(self.handles) - 1

    async def op_states(self) -> Any:
        return [h.poll().value for h in self.handles]

    async def op_wait(self, ids: list[int] | None = None, timeout: float = 30.0) -> Any:
        hs = self.handles if ids is None else [self.handles[i] for i in ids]
        out = []
        for h in hs:
            try:
                await h.wait(timeout)
                out.append({"state": "done"})
            except TimeoutError:
                out.append({"state": "pending"})
            except Exception as e:
                out.append({"state": "failed", "type": type(e).__name__, "error": str(e)})
        return out

    async def op_notes(self) -> Any:
        return self.notes

    async def op_stats(self) -> Any:
        return self.agent.stats()

    async def op_close(self) -> Any:
        await self.agent.aclose()
        return True


async def serve(out: Any) -> None:
    peer = Peer()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        req = json.loads(line)
        op = req.pop("op")
        try:
            result = await getattr(peer, f"op_{op}")(**req)
            reply: dict[str, Any] = {"ok": True, "result": result}
        except Exception as e:
            reply = {
                "ok": False,
                "type": type(e).__name__,
                "error": str(e),
                "trace": traceback.format_exc(),
            }
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if op == "close":
            break
    if peer.agent is not None:
        peer.agent.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--netns", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.netns:
        from transfer.testing import enter_netns

        enter_netns(args.netns)
    # Replies get a private copy of stdout; libraries that print (NIXL logs to
    # stdout) are redirected to stderr so they cannot corrupt the protocol.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    asyncio.run(serve(out))


if __name__ == "__main__":
    main()

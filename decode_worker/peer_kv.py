"""Prefix pulls between decode workers: a worker that lacks blocks of a prompt a peer
holds (in its pool or a KV tier) has the peer write them into its pool instead of
computing them again.

    router     it chose this worker and saw another hold more of the prompt:
               `GenerateRequest.kv_peer` names that peer and how many blocks it holds
    puller     reserve fresh blocks for the blocks it lacks (engine owner "pull <id>"),
               grant the peer writes into exactly those, send it a `KvPull` (a
               transfer-layer notification: the peers authenticate each other; no port)
    holder     pin what it holds of them (a tier's blocks restored into its pool
               first), write them into the puller's blocks with a `KvPulled` notice
               (delivered after the data), unpin; a refusal is a notice alone
    puller     on the notice: cache the blocks it names under their hashes and free the
               reservation, then admit the request as usual: the prefix cache finds
               them (a remote prefill, if the rest still needs one, starts after them)

A pull that has no answer by its deadline is given up: the grant is revoked and the
request goes on without it; the reservation is freed once no write can land any more
(the holder starts no write past the deadline, and one in flight lands within
`late_write_grace`). A refusal (nothing written) frees it at once.

Both sides are decode workers of one layout; each follows the others in discovery and
adds their transfer agents as peers (`--no-kv-peer-pull` leaves them out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from decode_worker.metrics import DecodeMetrics
from protocol.declare import check_request_id
from protocol.errors import InvalidInput
from protocol.kv_layout import BlockHash, hash_blocks
from runtime.discovery.members import RoleMembers, transfer_peers
from runtime.rpc.types import GenerateRequest
from runtime.worker_info import WorkerInfo
from transfer import DescList, Notification, rank_writes
from worker.assembly import WorkerRuntime

log = logging.getLogger(__name__)

MARK = b'{"peer_kv":'  # how a notification's payload says it is one of these messages
VERSION = 1
MAX_BLOCKS = 1 << 16


def _encode(kind: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"peer_kv": kind, "v": VERSION, **body}, separators=(",", ":")).encode()


def _ints(value: object, what: str, hi: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS:
        raise InvalidInput(f"{what} must be a list of at most {MAX_BLOCKS} integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < hi for v in value):
        raise InvalidInput(f"{what} must hold integers in [0, {hi})")
    return tuple(value)


@dataclass(frozen=True)
class KvPull:
    """Write the blocks of `hashes` you hold (the leading ones, in order) into my blocks
    `dst_block_ids` (pairwise), under `grant`, before `deadline` (wall clock)."""

    request_id: str
    hashes: tuple[BlockHash, ...]
    dst_block_ids: tuple[int, ...]
    grant: str
    layout: str  # the puller's `KvLayout.format_hash`
    deadline: float

    def encode(self) -> bytes:
        return _encode("pull", {
            "request_id": self.request_id, "hashes": list(self.hashes),
            "dst_block_ids": list(self.dst_block_ids), "grant": self.grant,
            "layout": self.layout, "deadline": self.deadline,
        })  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvPull:
        hashes = _ints(d.get("hashes"), "hashes", 1 << 64)
        dst = _ints(d.get("dst_block_ids"), "dst_block_ids", 1 << 31)
        if len(dst) != len(hashes):
            raise InvalidInput(f"{len(dst)} blocks for {len(hashes)} hashes")
        grant, layout, deadline = d.get("grant"), d.get("layout"), d.get("deadline")
        if not isinstance(grant, str) or not isinstance(layout, str):
            raise InvalidInput("grant and layout must be strings")
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise InvalidInput("deadline must be a number")
        if not math.isfinite(deadline):
            raise InvalidInput("deadline must be finite")
        return cls(check_request_id(d.get("request_id")), hashes, dst, grant, layout,
                   float(deadline))  # fmt: skip


@dataclass(frozen=True)
class KvPulled:
    """The answer: the first `blocks` of the pull's blocks were written (0 and `error`:
    none was)."""

    request_id: str
    blocks: int
    error: str = ""

    def encode(self) -> bytes:
        return _encode("pulled", {"request_id": self.request_id, "blocks": self.blocks,
                                  "error": self.error})  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvPulled:
        blocks, error = d.get("blocks"), d.get("error", "")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks <= MAX_BLOCKS:
            raise InvalidInput("blocks must be an integer in range")
        if not isinstance(error, str):
            raise InvalidInput("error must be a string")
        return cls(check_request_id(d.get("request_id")), blocks, error[:512])


def decode_message(payload: bytes) -> KvPull | KvPulled:
    """One of this module's messages from a notification's payload (InvalidInput if it
    is not a well-formed one)."""
    try:
        d = json.loads(payload)
    except ValueError as e:
        raise InvalidInput(f"not JSON: {e}") from None
    if not isinstance(d, dict) or d.get("v") != VERSION:
        raise InvalidInput("not a peer KV message of this version")
    kind = d.get("peer_kv")
    if kind == "pull":
        return KvPull.from_dict(d)
    if kind == "pulled":
        return KvPulled.from_dict(d)
    raise InvalidInput(f"unknown peer KV message {kind!r}")


@dataclass
class _Pull:
    answer: asyncio.Future[KvPulled]
    grant: str
    peer: str  # the holder's agent


@dataclass
class PeerKv:
    """Both sides of prefix pulls for one decode worker (`pull`; `on_notification`
    serves peers' pulls and settles ours)."""

    rt: WorkerRuntime
    config: DecodeWorkerConfig
    metrics: DecodeMetrics
    members: RoleMembers | None = field(default=None, init=False)
    pending: dict[str, _Pull] = field(default_factory=dict, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _owners: set[str] = field(default_factory=set, init=False)  # reservations not let go of

    def start(self) -> None:
        """Follow the other decode workers and peer with their transfer agents."""
        own = self.config.worker_id

        def add(info: WorkerInfo) -> None:
            if info.worker_id != own:
                self.rt.add_peer(info)

        self.members = transfer_peers(
            self.rt.discovery, "decode", add, self.rt.agent.remove_remote,
            linger_s=self.config.drain_timeout + 5.0,
        )  # fmt: skip
        self.members.start()

    async def close(self) -> None:
        if self.members is not None:
            await self.members.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # -- the puller ---------------------------------------------------------------------

    async def pull(self, request: GenerateRequest) -> int:
        """Have `request.kv_peer` write the prompt's blocks it holds and we lack into our
        pool, cached; how many blocks landed (0: none, for whatever reason, counted).
        Cancelled (the client went away), its reservation is freed once no write can
        land in it."""
        peer = self._peer(request.kv_peer)
        rid = request.request_id
        owner = f"pull {rid}"
        if peer is None or peer.transfer is None:
            self.metrics.peer_pulls.labels("unknown_peer").inc()
            return 0
        if owner in self._owners:  # the same id's earlier pull is still being let go of
            self.metrics.peer_pulls.labels("held").inc()
            return 0
        bs = self.rt.core.layout.block_size
        ids = request.prompt_token_ids
        blocks = min(request.kv_peer_blocks, (len(ids) - 1) // bs)
        hashes = hash_blocks(
            ids[: blocks * bs], bs, salt=request.cache_salt or None, adapter=request.lora
        )
        timeout = self.config.peer_pull_timeout
        deadline = time.time() + timeout
        self._owners.add(owner)
        settled = False  # the reservation committed or freed
        try:
            landed = await self._pull(peer, rid, owner, hashes, deadline)
            settled = landed >= 0
            return max(landed, 0)
        finally:
            if not settled:  # a write may still land: free the blocks after the grace
                self._spawn(self._release_later(owner, deadline))
            else:
                self._owners.discard(owner)

    async def _pull(self, peer: WorkerInfo, rid: str, owner: str, hashes: list[BlockHash],
                    deadline: float) -> int:  # fmt: skip
        """`pull`'s exchange: blocks landed and cached, 0 when none (the reservation
        freed), -1 when no answer came (a write may be in flight: not freed here)."""
        assert peer.transfer is not None
        engine = self.rt.engine
        have, dst = await engine.reserve_peer_blocks(owner, hashes)
        want = hashes[have : have + len(dst)]
        if len(want) < self.config.min_peer_pull_blocks:
            await engine.release_peer_blocks(owner)
            self.metrics.peer_pulls.labels("held" if have else "no_room").inc()
            return 0
        timeout = self.config.peer_pull_timeout
        grant = self.rt.agent.grant(self._descs(dst), timeout + self.config.late_write_grace)
        answer: asyncio.Future[KvPulled] = asyncio.get_running_loop().create_future()
        agent_name = peer.transfer.agent_name
        self.pending[rid] = _Pull(answer, grant, agent_name)
        message = KvPull(rid, tuple(want), tuple(dst), grant, self.rt.kv_format, deadline)
        started = time.monotonic()
        result: KvPulled | None = None
        try:
            await self.rt.agent.notify(agent_name, message.encode()).wait(timeout)
            result = await asyncio.wait_for(asyncio.shield(answer), deadline - time.time())
        except Exception as e:  # no answer (a timeout, the peer gone): a write may be in flight
            log.info("prefix pull of %s from %s: no answer (%s)", rid, peer.worker_id, e)
        finally:
            self.pending.pop(rid, None)
            self.rt.agent.revoke(grant)
        if result is None:
            self.metrics.peer_pulls.labels("timeout").inc()
            return -1
        if not result.blocks:  # a refusal comes alone: nothing was written
            self.metrics.peer_pulls.labels("refused").inc()
            await engine.release_peer_blocks(owner)
            return 0
        landed = min(result.blocks, len(want))
        await engine.commit_peer_blocks(owner, want[:landed])
        self.metrics.peer_pulls.labels("ok").inc()
        self.metrics.peer_pulled_blocks.inc(landed)
        self.metrics.peer_pull_seconds.observe(time.monotonic() - started)
        return landed

    def _peer(self, worker_id: str) -> WorkerInfo | None:
        if self.members is None or not worker_id or worker_id == self.config.worker_id:
            return None
        info = self.members.get(worker_id)
        layout = info.kv_layout if info is not None else None
        return info if layout is not None and layout.format_hash == self.rt.kv_format else None

    def _descs(self, blocks: Sequence[int]) -> DescList:
        """The byte ranges of `blocks` in every tensor-parallel rank's pool."""
        block_bytes = self.rt.core.layout.block_bytes
        return DescList.concat(
            DescList.blocks(pool, list(blocks), block_bytes) for pool in self.rt.pools
        )

    async def _release_later(self, owner: str, deadline: float) -> None:
        try:
            await asyncio.sleep(max(deadline - time.time(), 0.0) + self.config.late_write_grace)
            await self.rt.engine.release_peer_blocks(owner)
        finally:
            self._owners.discard(owner)

    # -- notifications: peers' pulls, answers to ours -----------------------------------

    def on_notification(self, note: Notification) -> bool:
        """Take `note` if it is a peer KV message or a violation of a pull's grant;
        False: not ours (a prefill notice)."""
        if note.kind == "violation":
            rid = next((r for r, p in self.pending.items() if p.grant == note.grant), None)
            if rid is None:
                return False
            log.warning("%s wrote outside the grant of the prefix pull of %s", note.peer, rid)
            self._answer(rid, KvPulled(rid, 0, "violation"))
            return True
        if bytes(note.payload[: len(MARK)]) != MARK:
            return False
        try:
            message = decode_message(bytes(note.payload))
        except InvalidInput as e:
            self.metrics.peer_pulls.labels("malformed").inc()
            log.warning("malformed peer KV message from %s: %s", note.peer, e)
            return True
        if isinstance(message, KvPull):
            self._spawn(self._serve(message, note.peer))
        else:
            pull = self.pending.get(message.request_id)
            if pull is not None and note.grant == pull.grant and note.peer == pull.peer:
                self._answer(message.request_id, message)
            else:
                log.warning("ignoring a prefix pull answer for %s from %s",
                            message.request_id, note.peer)  # fmt: skip
        return True

    def _answer(self, rid: str, answer: KvPulled) -> None:
        pull = self.pending.get(rid)
        if pull is not None and not pull.answer.done():
            pull.answer.set_result(answer)

    # -- the holder ---------------------------------------------------------------------

    async def _serve(self, pull: KvPull, agent_name: str) -> None:
        """Write what we hold of `pull`'s blocks into the puller's, with the answer."""
        members = self.members.all() if self.members is not None else []
        named = [
            m for m in members if m.transfer is not None and m.transfer.agent_name == agent_name
        ]
        peer = named[0] if named else None
        margin = self.config.late_write_grace / 2
        why = ""
        if peer is None or peer.kv_layout is None or peer.transfer is None:
            why = "not a decode worker we follow"
        elif pull.layout != self.rt.kv_format or peer.kv_layout.format_hash != self.rt.kv_format:
            why = "its KV layout differs from ours"
        elif time.time() > pull.deadline - margin:
            why = "deadline passed"
        if why or peer is None or peer.kv_layout is None or peer.transfer is None:
            await self._refuse(pull, agent_name, why)
            return
        owner = f"push {agent_name} {pull.request_id}"
        if owner in self._owners:  # a duplicate of a pull being served
            return
        self._owners.add(owner)
        engine = self.rt.engine
        in_flight = False  # a write that may still read the pinned blocks
        try:
            src = await engine.pin_peer_blocks(owner, pull.hashes)
            n = len(src)
            if not n:
                await self._refuse(pull, agent_name, "none of the blocks is held here")
                return
            if time.time() > pull.deadline - margin:
                await self._refuse(pull, agent_name, "deadline passed")
                return
            writes = rank_writes(
                self.rt.core.layout, [r.id for r in self.rt.pools], src,
                peer.kv_layout, peer.transfer.kv_regions, pull.dst_block_ids[:n],
            )  # fmt: skip
            in_flight = True
            await self.rt.agent.write_all(
                agent_name, [(w.src, w.dst) for w in writes],
                KvPulled(pull.request_id, n).encode(), grant=pull.grant,
                timeout=self.config.peer_pull_timeout, retry_until=pull.deadline - margin,
            )  # fmt: skip
            in_flight = False
            self.metrics.peer_pushed_blocks.inc(n)
        except Exception as e:
            log.warning("prefix pull of %s by %s failed here: %s", pull.request_id, agent_name, e)
        finally:
            if in_flight:  # (timed out): unpin once the puller's grant has ended it
                self._spawn(self._release_later(owner, pull.deadline))
            else:
                await engine.release_peer_blocks(owner)
                self._owners.discard(owner)

    async def _refuse(self, pull: KvPull, agent_name: str, why: str) -> None:
        log.info("not serving the prefix pull of %s by %s: %s", pull.request_id, agent_name, why)
        with contextlib.suppress(Exception):
            answer = KvPulled(pull.request_id, 0, why).encode()
            await self.rt.agent.notify(agent_name, answer, grant=pull.grant).wait(
                self.config.peer_pull_timeout
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

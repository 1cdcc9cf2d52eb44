"""The transfer agent: one per worker process, the object callers use.

Every check that can be made before moving bytes is made in `write`/`read`
and raises: unknown peer, a range outside a local region or outside the
regions the peer advertised (counted in `rejected_out_of_bounds`), sides of
different sizes. What can only fail later (peer lost, refused) fails the
handle. Methods are thread-safe and none blocks the event loop: bytes move on
the backends' threads. See the package docstring for a worked example.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

from transfer import auth, shmseg
from transfer.backends import Backend, BackendOptions, create_all, resolve
from transfer.context import AgentContext, AgentMetadata, Peer, RegionInfo
from transfer.descriptors import (
    Descs,
    Prepared,
    local_side,
    make_plan,
    prepare_local,
    prepare_remote,
    remote_side,
)
from transfer.errors import (
    AgentClosedError,
    DescriptorError,
    LayoutMismatchError,
    PeerRejectedError,
    PeerRemovedError,
    PeerRestartedError,
    TransferError,
)
from transfer.handle import Notification, NotificationQueue, Op, TransferHandle
from transfer.memory import Region, RegionTable, address_of, map_memory, wrap_buffer

log = logging.getLogger(__name__)
UNKNOWN_PEER_RETRY_S = 0.2  # between tries of a write the peer refused as unknown


class Agent:
    """A transfer endpoint: memory, trusted peers, transfers, notifications.

    Args:
        name: stable worker name (its incarnation changes on every start).
        backend: "auto", one of "shm", "tcp", "nixl", "ucx", or a preference
            list such as ("shm", "tcp"). "auto" starts NIXL when it is
            installed; NIXL and UCX listen on every interface, so tests keep
            to ("shm", "tcp") or run in a private network namespace.
        layout: an opaque layout hash peers can check (`layout_hash`).
        host: bind address of the tcp and ucx listeners (default loopback only).
        port: the tcp listener's port (0: any free port; ucx: ``ucx={"port": p}``).
        advertise_host: the address published to peers, if not `host`
            (required when binding 0.0.0.0).
        shm_dir: where shared segments live.
        populate: fault every page of `allocate`d memory in up front.
        nixl, ucx: keyword options of `NixlBackend` / `UcxBackend`.
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str | Sequence[str] = "auto",
        layout: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        shm_dir: str = shmseg.DEFAULT_DIR,
        populate: bool = True,
        nixl: dict[str, Any] | None = None,
        ucx: dict[str, Any] | None = None,
    ) -> None:
        if not name or len(name) > 256:
            raise ValueError("agent name must have 1..256 characters")
        self.name = name
        self.incarnation = auth.new_incarnation()
        self.layout = layout
        self._populate = populate
        self._ctx = AgentContext(name, self.incarnation, auth.new_secret(), shm_dir=shm_dir)
        kinds, optional = resolve(backend)
        options = BackendOptions(host, port, advertise_host, nixl or {}, ucx or {})
        self._backends: dict[str, Backend] = create_all(kinds, optional, self._ctx, options)
        self._shared = "shm" in self._backends
        self._swept = self._shared
        if self._shared:
            shmseg.sweep_stale_segments(shm_dir)
        self._closed = False
        # Unlink shared segments even if the agent is never closed (runs at exit too).
        self._finalizer = weakref.finalize(self, _release_all, self._ctx.regions, shm_dir)

    # ---- identity and metadata ---------------------------------------------

    @property
    def backends(self) -> list[str]:
        """The backends this agent serves, in preference order."""
        return list(self._backends)

    def describe(self) -> AgentMetadata:
        regions = []
        for r in self._ctx.regions.all():
            fields: dict[str, Any] = {"device": r.device}
            for b in self._backends.values():
                fields.update(b.region_info(r))
            regions.append(RegionInfo(r.id, r.nbytes, **fields))
        shm = self._backends.get("shm")
        return AgentMetadata(
            name=self.name,
            incarnation=self.incarnation,
            secret=self._ctx.secret,
            backends=tuple(self._backends),
            transports={k: b.info() for k, b in self._backends.items()},
            regions=tuple(regions),
            layout=self.layout,
            host=_hostname(),
            shm_domain=getattr(shm, "domain", None),
        )

    def metadata(self) -> bytes:
        """Self-contained bytes to publish in discovery; republish after (de)registering."""
        return self.describe().to_bytes()

    # ---- memory --------------------------------------------------------------

    def allocate(self, nbytes: int, *, shared: bool = False) -> Region:
        """New zeroed memory, registered: shared memory on shm agents (so that a
        same-host peer can map it) or when `shared` (so that another process of ours
        can: `shared_path`); page-aligned anonymous memory otherwise."""
        self._check_open()
        rid = self._ctx.regions.next_id()
        if shared and not self._shared and not self._swept:
            shmseg.sweep_stale_segments(self._ctx.shm_dir)
            self._swept = True
        name = shmseg.segment_name(self.incarnation, rid) if self._shared or shared else None
        mm = map_memory(nbytes, shm_name=name, shm_dir=self._ctx.shm_dir, populate=self._populate)
        view = memoryview(mm)
        region = Region(rid, view, address_of(view), nbytes, shm_name=name, mapping=mm)
        return self._add_region(region)

    def shared_path(self, region: Region) -> str:
        """The file of an `allocate`d shared region, which our other processes on
        this host may map (its name is as secret as the agent's metadata)."""
        if region.shm_name is None:
            raise ValueError(f"region {region.id} is not shared memory")
        return os.path.join(self._ctx.shm_dir, region.shm_name)

    def register(self, obj: Any) -> Region:
        """Register caller-owned memory: a contiguous tensor, array or writable buffer.

        Peers on shm can only target memory from `allocate`; a registered buffer
        serves as a local source or destination and as a tcp/ucx/nixl target.
        """
        self._check_open()
        view, address, nbytes, device = wrap_buffer(obj)
        if device != "cpu" and not any(b.device_memory for b in self._backends.values()):
            raise DescriptorError(f"{device} memory needs the nixl backend")
        region = Region(
            self._ctx.regions.next_id(), view, address, nbytes, device=device, keepalive=obj
        )
        return self._add_region(region)

    def _add_region(self, region: Region) -> Region:
        self._ctx.regions.add(region)
        try:
            for b in self._backends.values():
                b.region_added(region)
        except BaseException:
            self._ctx.regions.remove(region.id)
            region.close(self._ctx.shm_dir)
            raise
        return region

    def deregister(self, region: Region) -> None:
        """Stop serving `region` and release it (its name, and its mapping once unused)."""
        for b in self._backends.values():
            b.region_removed(region)
        self._ctx.regions.remove(region.id)
        region.close(self._ctx.shm_dir)

    @property
    def regions(self) -> list[Region]:
        return self._ctx.regions.all()

    # ---- peers ---------------------------------------------------------------

    def add_remote(
        self, metadata: bytes | str | AgentMetadata, *, expect_layout: str | None = None
    ) -> str:
        """Trust the agent `metadata` describes; returns its name.

        Adding a new incarnation of a known name invalidates everything cached
        for the old one (connections, mappings, prepared lists) and fails its
        pending transfers with `PeerRestartedError`. Re-adding the same
        incarnation only refreshes its region list.
        """
        self._check_open()
        md = metadata if isinstance(metadata, AgentMetadata) else AgentMetadata.from_bytes(metadata)
        if md.name == self.name:
            raise ValueError("an agent cannot add itself")
        if expect_layout is not None and md.layout != expect_layout:
            raise LayoutMismatchError(
                f"{md.name!r} has layout {md.layout!r}, expected {expect_layout!r}"
            )
        old = self._ctx.peers.lookup(md.name)
        if old is not None and old.incarnation == md.incarnation:
            old.md = md
            self._backends[old.backend].peer_added(old)
            return md.name
        kind = next((k for k, b in self._backends.items() if b.reaches(md)), None)
        if kind is None:
            raise TransferError(
                f"no common backend with {md.name!r}: we serve {self.backends}, it {md.backends}"
            )
        peer = Peer(md, kind)
        self._ctx.peers.put(peer)
        if old is not None:
            self._forget(old, PeerRestartedError(md.name, "a new incarnation replaced it"))
        self._backends[kind].peer_added(peer)
        return md.name

    def remove_remote(self, name: str) -> bool:
        """Forget a peer (it left discovery); False if it was not known."""
        peer = self._ctx.peers.pop(name)
        if peer is None:
            return False
        self._forget(peer, PeerRemovedError(name, "removed"))
        return True

    def _forget(self, peer: Peer, error: PeerRemovedError | PeerRestartedError) -> None:
        for b in self._backends.values():  # incoming connections may use any backend
            b.peer_removed(peer, error)

    def remote(self, name: str) -> AgentMetadata:
        return self._ctx.peers.get(name).md

    def backend_for(self, name: str) -> str:
        """The backend chosen to reach peer `name`."""
        return self._ctx.peers.get(name).backend

    # ---- descriptors ---------------------------------------------------------

    def prepare(self, descs: Descs) -> Prepared:
        """Check a local list once, for reuse in many transfers."""
        return prepare_local(self._ctx, descs)

    def prepare_remote(self, peer: str, descs: Descs) -> Prepared:
        """Check a list of `peer`'s ranges against its advertised regions, once."""
        return prepare_remote(self._ctx, self._ctx.peers.get(peer), descs)

    # ---- transfers -----------------------------------------------------------

    def write(
        self,
        local: Prepared | Descs,
        peer: str,
        remote: Prepared | Descs,
        *,
        notification: bytes | None = None,
        grant: str | None = None,
    ) -> TransferHandle:
        """Copy the bytes of `local` into `peer`'s `remote` ranges; the peer gets
        `notification` (if given) once every byte has landed. `grant`: the peer's
        write grant, which a write into a region it guards needs."""
        return self._post("write", local, peer, remote, notification, grant)

    async def write_all(
        self,
        peer: str,
        writes: Sequence[tuple[Descs, Descs]],
        notification: bytes,
        *,
        grant: str | None,
        timeout: float,
        retry_until: float,
    ) -> None:
        """Several (local, remote) writes into `peer`, then `notification`: with the
        one write when there is one (delivered after its data), else on its own once
        every write has landed. Raises what a write or the notification fails with;
        retried while the peer does not know us yet ("unknown-peer"), until the wall
        clock passes `retry_until`: an agent just started (a scale-up) can be handed
        work before the peer has seen it in discovery and added it."""
        while True:
            try:
                note = notification if len(writes) == 1 else None
                handles = [self.write(src, peer, dst, grant=grant, notification=note)
                           for src, dst in writes]  # fmt: skip
                waits = (h.wait(timeout) for h in handles)
                for result in await asyncio.gather(*waits, return_exceptions=True):
                    if isinstance(result, BaseException):
                        raise result
                if len(writes) != 1:
                    await self.notify(peer, notification, grant=grant).wait(timeout)
                return
            except PeerRejectedError as e:
                if e.reason != "unknown-peer" or time.time() + UNKNOWN_PEER_RETRY_S > retry_until:
                    raise
                log.info("%s has not added us yet; retrying the write", peer)
                await asyncio.sleep(UNKNOWN_PEER_RETRY_S)

    def read(
        self,
        local: Prepared | Descs,
        peer: str,
        remote: Prepared | Descs,
        *,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Copy `peer`'s `remote` ranges into `local`; the peer gets `notification`
        (if given) once we have the bytes."""
        return self._post("read", local, peer, remote, notification, None)

    def notify(self, peer: str, payload: bytes, *, grant: str | None = None) -> TransferHandle:
        """Send a notification without data (e.g. a failure notice), under `grant` if
        given: then only the grant's holder (or its first user) can send it."""
        self._check_open()
        p = self._ctx.peers.get(peer)
        op = Op("notify", p, None, bytes(payload), TransferHandle("notify", peer, 0), self._ctx,
                grant=_grant_id(grant))  # fmt: skip
        self._ctx.stats.inc("notifies_posted")
        self._backends[p.backend].submit(op)
        return op.handle

    def _post(
        self,
        kind: str,
        local: Any,
        peer: str,
        remote: Any,
        notification: bytes | None,
        grant: str | None,
    ) -> TransferHandle:
        self._check_open()
        p = self._ctx.peers.get(peer)
        plan = make_plan(local_side(self._ctx, local), remote_side(self._ctx, p, remote))
        note = None if notification is None else bytes(notification)
        handle = TransferHandle(kind, peer, plan.nbytes)
        op = Op(kind, p, plan, note, handle, self._ctx, grant=_grant_id(grant))
        backend = self._backends[p.backend]
        backend.check(op)
        self._ctx.stats.inc(f"{kind}s_posted")
        backend.submit(op)
        return op.handle

    # ---- write grants (transfer/context.py) -------------------------------------

    def guard(self, region: Region) -> None:
        """From now on peers write into `region` only under a grant from `grant`."""
        self._ctx.grants.guard(region.id)

    def grant(self, descs: Descs, ttl_s: float) -> str:
        """A write grant over these local ranges for `ttl_s` seconds: hand its id to
        the one peer that should write them."""
        return self._ctx.grants.issue(prepare_local(self._ctx, descs).descs.array, ttl_s)

    def revoke(self, grant: str) -> bool:
        """End a grant (its reservation was settled); False if it had ended already."""
        return self._ctx.grants.revoke(grant)

    # ---- notifications and counters -------------------------------------------

    def notifications(self) -> NotificationQueue:
        """``async for note in agent.notifications()``; ends when the agent closes."""
        return self._ctx.notifications

    def get_notifications(self) -> list[Notification]:
        """Every notification received and not yet taken (never blocks)."""
        return self._ctx.notifications.get_nowait()

    def stats(self) -> dict[str, int]:
        return self._ctx.stats.snapshot()

    # ---- lifecycle -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(f"agent {self.name!r} is closed")

    def close(self) -> None:
        """Fail pending transfers, stop every thread, release every region."""
        if self._closed:
            return
        self._closed = True
        for b in self._backends.values():
            try:
                b.close()
            except Exception:
                log.exception("%s: closing backend %s failed", self.name, b.kind)
        self._ctx.notifications.close()
        self._finalizer()

    async def aclose(self) -> None:
        import asyncio

        await asyncio.to_thread(self.close)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<Agent {self.name} {self.incarnation[:8]} {'/'.join(self._backends)}>"


def _grant_id(grant: str | None) -> str | None:
    if grant is not None and (not isinstance(grant, str) or not 1 <= len(grant) <= 64):
        raise ValueError("a grant is the id string Agent.grant returned")
    return grant


def _release_all(regions: RegionTable, shm_dir: str) -> None:
    for r in regions.all():
        r.close(shm_dir)


def _hostname() -> str:
    import socket

    return socket.gethostname()

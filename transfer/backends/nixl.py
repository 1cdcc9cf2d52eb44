"""nixl: the NIXL library (UCX plugin) for one-sided WRITE/READ with notification.

The production path on RDMA / NVLink clusters, and the only backend that
moves device (GPU) memory. Each of our agents owns one NIXL agent named
``<name>/<incarnation>``; regions are registered with it, and its metadata
(base64) plus each region's base address travel in ours. `add_remote` loads
the peer's NIXL metadata; a new incarnation has a new NIXL name, so nothing
cached for the old one can be reused by mistake.

A WRITE is one `initialize_xfer` over the plan's segments, with the caller's
notification sealed in a signed envelope (`transfer.envelope`). NIXL delivers
the notification after the data. A single thread ("nixl-progress") posts
transfers, polls their state and collects incoming notifications, so the
(non thread-safe) NIXL agent is only touched under one lock.

Bounds and trust on this one-sided path: the initiator checks every range
against the regions the peer advertised, and NIXL itself refuses descriptors
outside the peer's registrations. The receiver cannot refuse bytes, but it
delivers a notification only if the envelope verifies with the secret of a
peer it added, in the incarnation it added, with a fresh sequence number and
extents inside its regions; anything else is dropped and counted.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import threading
import time
from typing import Any

import numpy as np

from transfer import envelope
from transfer.backends.base import Backend
from transfer.backends.nixl_descs import device_of, nixl_error, xfer_rows
from transfer.context import AgentContext, AgentMetadata, Peer
from transfer.errors import (
    AgentClosedError,
    BackendUnavailableError,
    DescriptorError,
    PeerDisconnectedError,
    PeerError,
)
from transfer.handle import Op
from transfer.memory import Region

log = logging.getLogger(__name__)
_FAST = 50e-6  # poll period (s) right after any activity, doubling while nothing happens
_BUSY_NOTIF_S = 1e-3  # while transfers are in flight, notifications are polled this often


class NixlBackend(Backend):
    kind = "nixl"
    device_memory = True
    two_sided = False

    def __init__(
        self,
        ctx: AgentContext,
        *,
        plugins: tuple[str, ...] = ("UCX",),
        num_threads: int = 0,
        progress_thread: bool = False,
        idle_poll: float = 1e-3,
    ) -> None:
        super().__init__(ctx)
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise BackendUnavailableError(f"nixl does not import: {e}") from None
        if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs INFO lines to stdout by default
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.agent_name = f"{ctx.name}/{ctx.incarnation}"
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=list(plugins),
            num_threads=num_threads,
        )
        self._nixl: Any = nixl_agent(self.agent_name, config)
        if not self._nixl.backends:
            raise BackendUnavailableError(f"NIXL started without any of the plugins {plugins}")
        self._lock = threading.Lock()
        self._regs: dict[int, Any] = {}
        self._posts: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._active: list[tuple[Op, Any]] = []
        self._idle_poll = idle_poll
        self._seq = 0
        self._gate = envelope.Gate(ctx)
        self._closed = False
        self._thread = threading.Thread(
            target=self._progress_loop, name="nixl-progress", daemon=True
        )
        self._thread.start()

    # ---- metadata and memory -----------------------------------------------

    def info(self) -> dict[str, Any]:
        with self._lock:
            md = self._nixl.get_agent_metadata()
        return {"agent": self.agent_name, "metadata": base64.b64encode(md).decode()}

    def region_info(self, region: Region) -> dict[str, Any]:
        return {"address": region.address}

    def region_added(self, region: Region) -> None:
        mem, dev = device_of(region.device)
        with self._lock:
            self._regs[region.id] = self._nixl.register_memory(
                [(region.address, region.nbytes, dev, "")], mem
            )

    def region_removed(self, region: Region) -> None:
        with self._lock:
            reg = self._regs.pop(region.id, None)
            if reg is not None:
                self._nixl.deregister_memory(reg)

    def reaches(self, md: AgentMetadata) -> bool:
        return "nixl" in md.transports

    # ---- peers -------------------------------------------------------------

    def peer_added(self, peer: Peer) -> None:
        info = peer.md.transports["nixl"]
        try:
            md = base64.b64decode(info["metadata"])
        except (KeyError, TypeError, ValueError):
            raise DescriptorError(f"{peer.name!r} has no usable NIXL metadata") from None
        with self._lock:
            if "nixl" in peer.state:  # same incarnation, new regions: reload
                self._nixl.remove_remote_agent(peer.state["nixl"])
            peer.state["nixl"] = self._nixl.add_remote_agent(md)

    def peer_removed(self, peer: Peer, error: PeerError) -> None:
        name = peer.state.pop("nixl", None)
        if name is None:
            return
        with self._lock:
            try:
                self._nixl.remove_remote_agent(name)
            except Exception as e:  # already disconnected
                log.debug("remove_remote_agent(%s): %s", name, e)
        self._fail_where(lambda op: op.peer is peer, error)

    # ---- initiator side ----------------------------------------------------

    def check(self, op: Op) -> None:
        if op.plan is not None and len(op.plan):
            xfer_rows(self.ctx, op)  # refuse mixed memory types now, not on the progress thread

    def submit(self, op: Op) -> None:
        if self._closed:
            op.fail(AgentClosedError("agent closed"))
            return
        self._posts.put(op)

    def _seal(self, op: Op) -> bytes:
        self._seq += 1
        env = envelope.Envelope(
            self.ctx.name,
            self.ctx.incarnation,
            op.kind,
            self._seq,
            op.nbytes,
            _written(op),
            op.notification or b"",
            op.grant or "",
        )
        return envelope.seal(self.ctx.secret, env)

    def _post(self, op: Op) -> None:
        remote = op.peer.state.get("nixl")
        if remote is None:
            op.fail(PeerDisconnectedError(op.peer.name, "no longer added"))
            return
        try:
            with self._lock:
                if op.kind == "notify":
                    self._nixl.send_notif(remote, self._seal(op))
                    op.succeed()
                    return
                (lmem, larr), (rmem, rarr) = xfer_rows(self.ctx, op)
                local = self._nixl.get_xfer_descs(larr, lmem)
                far = self._nixl.get_xfer_descs(rarr, rmem)
                note = self._seal(op) if op.notification is not None else b""
                handle = self._nixl.initialize_xfer(op.kind.upper(), local, far, remote, note)
                state = self._nixl.transfer(handle)
        except Exception as e:
            op.fail(nixl_error(op, e))
            return
        if state == "ERR":
            handle.release()
            op.fail(PeerDisconnectedError(op.peer.name, f"NIXL failed to post the {op.kind}"))
        else:
            self._active.append((op, handle))

    def _poll_active(self) -> None:
        still: list[tuple[Op, Any]] = []
        for op, handle in self._active:
            try:
                with self._lock:
                    state = self._nixl.check_xfer_state(handle)
            except Exception as e:
                state, err = "ERR", str(e)
            else:
                err = "NIXL reported an error"
            if state == "PROC":
                still.append((op, handle))
                continue
            try:
                with self._lock:
                    handle.release()
            except Exception as e:
                log.debug("releasing a NIXL handle: %s", e)
            if state == "DONE":
                op.succeed()
            else:
                op.fail(PeerDisconnectedError(op.peer.name, f"{op.kind} failed: {err}"))
        self._active = still

    def _fail_where(self, pred: Any, error: BaseException) -> None:
        # Ops are owned by the progress thread; failing a handle twice is harmless.
        for op, _ in list(self._active):
            if pred(op):
                op.fail(error)

    # ---- receiver side -----------------------------------------------------

    def _on_notif(self, nixl_sender: str, data: bytes) -> None:
        admitted = self._gate.admit(nixl_sender, data)
        if admitted is None:
            return
        peer, env = admitted
        if env.kind == "write":
            self.ctx.stats.inc("bytes_received", env.nbytes)
        elif env.kind == "read":
            self.ctx.stats.inc("bytes_served", env.nbytes)
        self.ctx.deliver(peer, env.kind, env.payload, env.nbytes, env.grant or None)

    # ---- progress ----------------------------------------------------------

    def _progress_loop(self) -> None:
        """Post, poll and collect. Without NIXL's own progress thread (which spins
        a core even when idle), UCX advances only when we poll: so spin on the
        transfers in flight (yielding the CPU, and looking for notifications only
        every `_BUSY_NOTIF_S`); otherwise poll 50 us after any activity, backing
        off by doubling to `idle_poll`. Fast polling while a peer streams a big
        WRITE into us costs that peer throughput (its copy competes with our
        polling: 4,096 scattered 16 KiB writes ran ~15 % slower at a steady 50 us),
        and a burst of small transfers keeps the period short."""
        next_notifs = 0.0
        period = _FAST
        while True:
            posted = self._post_queued()
            if posted is None:
                return
            now = time.monotonic()
            active = bool(posted or self._active)
            if self._active:
                self._poll_active()
            if not self._active or now >= next_notifs:
                next_notifs = now + _BUSY_NOTIF_S
                with self._lock:
                    notifs = self._nixl.get_new_notifs()
                for sender, msgs in notifs.items():
                    for m in msgs:
                        self._on_notif(sender, bytes(m))
                    active = True
            if self._active:
                os.sched_yield()
                continue
            period = _FAST if active else min(2 * period, self._idle_poll)
            try:  # sleep, but wake at once for a new post
                item = self._posts.get(timeout=period)
            except queue.Empty:
                continue
            if item is None:
                return
            period = _FAST
            self._post(item)

    def _post_queued(self) -> int | None:
        """Post every queued op; how many, or None once closing."""
        n = 0
        while True:
            try:
                item = self._posts.get_nowait()
            except queue.Empty:
                return n
            if item is None:
                return None
            self._post(item)
            n += 1

    def close(self) -> None:
        self._closed = True
        self._posts.put(None)
        self._thread.join(timeout=5)
        err = AgentClosedError("agent closed")
        for op, handle in self._active:
            op.fail(err)
            try:
                handle.release()
            except Exception as e:
                log.debug("releasing a NIXL handle at close: %s", e)
        self._active = []
        while True:
            try:
                item = self._posts.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.fail(err)
        with self._lock:
            for reg in self._regs.values():
                try:
                    self._nixl.deregister_memory(reg)
                except Exception as e:
                    log.debug("deregister at close: %s", e)
            self._regs.clear()
        self._nixl = None


def _written(op: Op) -> np.ndarray:
    """What the envelope names of the remote side: every range under a grant (the
    receiver checks them against it), else each region's extent."""
    if op.plan is None:
        return np.zeros((0, 3), np.int64)
    if op.grant is not None:
        return envelope.ranges(op.plan.remote)
    return envelope.extents(op.plan.remote)

"""shm: same-host transfers as plain memory copies into the peer's segments.

The receiver's regions live in POSIX shared memory (`Agent.allocate`), named in
its metadata. A writer maps a segment on first use (checking its real size
against the metadata), copies each contiguous segment of the plan with one
`memcpy` straight into the peer's KV blocks, then sends a WRITE frame marked
"placed" (ranges and notification, no data) over an authenticated Unix socket.
The write handle completes once that frame is sent: as with NIXL's one-sided
WRITE, DONE means the bytes are in the peer's memory (where nothing can take
them back) and the notification is on its way, so the caller may reuse its
source blocks at once. The receiver checks the ranges, counts the bytes and queues
the notification, without a reply: waiting for one would cost the writer two
thread wake-ups per write for nothing it could undo. A refusal at that point
(never expected: the writer made the same checks) is NACKed, counted on both
sides (`rejected_after_placement` here) and logged. A receiver that is gone
fails the send, and so the handle.
READ is the mirror image: copy out of the peer's segment, then a READ_DONE.

Authorisation on a one-sided path: the receiver cannot stop a process that
holds a mapping from storing into it, so it guards what it *accepts*:

* segment names (128 random bits) are revealed only in the metadata, and the
  files are 0600, so only same-user processes handed the metadata can map them;
* only a peer we added, proving its secret, can open the control socket, and
  only its notifications are delivered: bytes nobody announced are never
  turned into live KV cache;
* the writer checks every range against the advertised regions and the real
  segment size before copying (`rejected_out_of_bounds` on the writer side),
  and the receiver checks them again when the WRITE arrives (counted and
  NACKed on the receiver side).

Peers share the same boot, /dev/shm mount and network namespace (the abstract
socket lives in it): `AgentMetadata.shm_domain` must match.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from typing import Any

import numpy as np

from transfer import shmseg
from transfer.backends.stream import StreamBackend
from transfer.context import AgentContext, AgentMetadata, Peer, local_shm_domain
from transfer.errors import OutOfBoundsError, PeerError, ProtocolError
from transfer.handle import Op
from transfer.link import FLAG_PLACED, Frame, Kind, PeerLink, ServerConn, encode
from transfer.memory import Region, copy_ranges


class _Mapped:
    """A peer's segments mapped into this process, and their base addresses."""

    def __init__(self) -> None:
        self.maps: dict[int, mmap.mmap] = {}
        self.bases = np.zeros(0, dtype=np.int64)

    def close(self) -> None:
        for m in self.maps.values():
            with contextlib.suppress(BufferError):  # an in-flight copy still pins it
                m.close()
        self.maps.clear()


class ShmBackend(StreamBackend):
    kind = "shm"

    def __init__(self, ctx: AgentContext) -> None:
        self.domain = local_shm_domain(ctx.shm_dir)
        ns = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
        self._sock_name = f"diptych.{ns}.{os.getpid()}.{ctx.incarnation}.ctl"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self._sock_name)  # abstract: nothing to clean up after a crash
        listener.listen(128)
        super().__init__(ctx, listener)

    def info(self) -> dict[str, Any]:
        return {"socket": self._sock_name}

    def region_info(self, region: Region) -> dict[str, Any]:
        return {"shm": region.shm_name} if region.shm_name else {}

    def reaches(self, md: AgentMetadata) -> bool:
        return "shm" in md.transports and md.shm_domain == self.domain

    def check(self, op: Op) -> None:
        assert op.plan is not None
        for rid in np.unique(op.plan.remote[:, 0]).tolist():
            if op.peer.md.region(rid).shm is None:
                raise OutOfBoundsError(
                    f"region {rid} of {op.peer.name!r} is not in shared memory; "
                    "allocate it with Agent.allocate() on an shm agent"
                )

    def _connect(self, peer: Peer) -> socket.socket:
        name = peer.md.transports["shm"].get("socket")
        if not isinstance(name, str):
            raise OSError("no shm socket in metadata")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + name)
        except OSError:
            sock.close()
            raise
        return sock

    # ---- connecting side ---------------------------------------------------

    def _remote_addresses(self, peer: Peer, descs: np.ndarray) -> np.ndarray:
        mapped = peer.state.get("shm")
        if not isinstance(mapped, _Mapped):
            mapped = peer.state["shm"] = _Mapped()
        for rid in np.unique(descs[:, 0]).tolist():
            if rid not in mapped.maps:
                info = peer.md.region(rid)
                assert info.shm is not None
                try:
                    m = shmseg.attach(info.shm, info.nbytes, directory=self.ctx.shm_dir)
                except (OSError, ValueError) as e:
                    raise PeerError(peer.name, f"cannot map its region {rid}: {e}") from None
                mapped.maps[rid] = m
                bases = np.zeros(max(len(mapped.bases), rid + 1), dtype=np.int64)
                bases[: len(mapped.bases)] = mapped.bases
                bases[rid] = np.frombuffer(m, dtype=np.uint8).ctypes.data
                mapped.bases = bases
        addrs: np.ndarray = mapped.bases[descs[:, 0]] + descs[:, 1]
        return addrs

    def _pin(self, op: Op, peer: Peer, descs: np.ndarray) -> None:
        mapped = peer.state["shm"]
        assert isinstance(mapped, _Mapped) and op.plan is not None
        op.pins.extend(memoryview(mapped.maps[r]) for r in np.unique(descs[:, 0]).tolist())
        op.pins.extend(self.ctx.regions.pin(op.plan.local[:, 0]))

    def _send_write(self, link: PeerLink, op: Op) -> None:
        plan = op.plan
        assert plan is not None
        dst = self._remote_addresses(op.peer, plan.remote)
        self._pin(op, op.peer, plan.remote)
        src = self.ctx.regions.addresses(plan.local)
        # everything but the copy is done first: a big copy evicts the caches, and
        # Python code run after it pays for that
        fs = link.socket
        op.xfer_id = link.next_id()  # untracked: no reply is expected
        frame = encode(
            Kind.WRITE,
            op.xfer_id,
            flags=FLAG_PLACED,
            info=op.info,
            descs=plan.remote,
            blob=op.notification,
        )
        copy_ranges(dst, src, plan.local[:, 2])
        fs.send(frame)
        op.succeed()  # placed: see the module docstring

    def _send_read(self, link: PeerLink, op: Op) -> None:
        plan = op.plan
        assert plan is not None
        src = self._remote_addresses(op.peer, plan.remote)
        self._pin(op, op.peer, plan.remote)
        copy_ranges(self.ctx.regions.addresses(plan.local), src, plan.local[:, 2])
        xid = link.begin(op)
        link.socket.send(encode(Kind.READ_DONE, xid, descs=plan.remote, blob=op.notification))

    # ---- accepting side ----------------------------------------------------

    def _on_write(self, conn: ServerConn, frame: Frame) -> None:
        if not frame.flags & FLAG_PLACED or frame.data_len:
            raise ProtocolError("shm WRITE must be 'placed' and carry no data")
        if self._admit(conn, frame):
            self.ctx.stats.inc("bytes_received", int(frame.descs[:, 2].sum()))
            self._deliver(conn, frame, "write")  # no ACK: see the module docstring

    # ---- lifecycle ---------------------------------------------------------

    def peer_removed(self, peer: Peer, error: PeerError) -> None:
        super().peer_removed(peer, error)
        mapped = peer.state.pop("shm", None)
        if isinstance(mapped, _Mapped):
            mapped.close()

"""Our descriptors in NIXL's terms, and NIXL's errors in ours.

A plan side becomes an (n, 3) uint64 array of (address, length, device id)
rows with one memory type ("DRAM" or "VRAM"); remote addresses come from the
region base addresses the peer published in its metadata.
"""

from __future__ import annotations

import numpy as np

from transfer.context import AgentContext, AgentMetadata
from transfer.errors import (
    DescriptorError,
    OutOfBoundsError,
    PeerDisconnectedError,
    PeerError,
    TransferError,
)
from transfer.handle import Op


def device_of(device: str) -> tuple[str, int]:
    """(NIXL memory type, device id) of a region's device string."""
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.partition(":")[2] or 0)


def _remote_bases(md: AgentMetadata, rows: np.ndarray) -> np.ndarray:
    bases = np.zeros(len(md.sizes), dtype=np.int64)
    for r in md.regions:
        if r.address is None:
            raise DescriptorError(f"{md.name!r} did not publish the address of region {r.id}")
        bases[r.id] = r.address
    out: np.ndarray = bases[rows[:, 0]]
    return out


def xfer_rows(ctx: AgentContext, op: Op) -> list[tuple[str, np.ndarray]]:
    """(memory type, (n, 3) uint64 address/length/device rows) for each side of `op`."""
    assert op.plan is not None
    local, remote = op.plan.local, op.plan.remote
    sides = []
    for rows, devices, addresses in (
        (
            local,
            [ctx.regions.get(r).device for r in np.unique(local[:, 0]).tolist()],
            ctx.regions.addresses(local),
        ),
        (
            remote,
            [op.peer.md.region(r).device for r in np.unique(remote[:, 0]).tolist()],
            _remote_bases(op.peer.md, remote) + remote[:, 1],
        ),
    ):
        kinds = {device_of(d) for d in devices}
        if len(kinds) != 1:
            raise DescriptorError("one side of a nixl transfer mixes memory types or devices")
        mem, dev = kinds.pop()
        arr = np.empty((len(rows), 3), dtype=np.uint64)
        arr[:, 0], arr[:, 1], arr[:, 2] = addresses, rows[:, 2], dev
        sides.append((mem, arr))
    return sides


def nixl_error(op: Op, e: Exception) -> TransferError:
    """Our error for an exception NIXL raised while posting `op`."""
    kind = type(e).__name__
    if "RemoteDisconnect" in kind:
        return PeerDisconnectedError(op.peer.name, f"NIXL: {op.kind} to a disconnected peer")
    if "NotFound" in kind:  # no registration of the peer covers the remote ranges
        return OutOfBoundsError(
            f"NIXL refused the {op.kind}: {op.peer.name!r} registered no such memory"
        )
    return PeerError(op.peer.name, f"NIXL refused the {op.kind}: {kind} {e}")

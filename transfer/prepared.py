"""Checked descriptor lists, and the checks every transfer goes through.

`Agent.prepare` / `Agent.prepare_remote` run the checks once and return a
`Prepared` list that transfers reuse as is (NIXL's prepared lists, in our
words). A remote list is bound to the peer incarnation it was checked against:
after that peer restarts, using it raises `PeerRestartedError` instead of
writing into a layout that may have changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer.context import AgentContext, Peer
from transfer.descriptors import DescList, bounds_violation
from transfer.errors import DescriptorError, OutOfBoundsError, PeerRestartedError

Descs = DescList | Sequence[tuple[Any, int, int]]


@dataclass(frozen=True)
class Prepared:
    """A checked descriptor list; `peer` is None for a local one."""

    descs: DescList
    peer: str | None
    incarnation: str


def _as_descs(descs: Descs) -> DescList:
    return descs if isinstance(descs, DescList) else DescList(descs)


def _check(ctx: AgentContext, d: DescList, sizes: np.ndarray, whose: str) -> None:
    reason = bounds_violation(d.array, sizes)
    if reason is not None:
        ctx.stats.inc("rejected_out_of_bounds")
        raise OutOfBoundsError(f"{whose} {reason}")


def prepare_local(ctx: AgentContext, descs: Descs) -> Prepared:
    d = _as_descs(descs)
    _check(ctx, d, ctx.regions.sizes, "local")
    return Prepared(d, None, ctx.incarnation)


def prepare_remote(ctx: AgentContext, peer: Peer, descs: Descs) -> Prepared:
    d = _as_descs(descs)
    _check(ctx, d, peer.md.sizes, f"{peer.name!r}'s")
    return Prepared(d, peer.name, peer.incarnation)


def local_side(ctx: AgentContext, descs: Prepared | Descs) -> DescList:
    """The checked local list of a transfer."""
    if not isinstance(descs, Prepared):
        return prepare_local(ctx, descs).descs
    if descs.peer is not None or descs.incarnation != ctx.incarnation:
        raise DescriptorError("this prepared list is not a local list of this agent")
    return descs.descs


def remote_side(ctx: AgentContext, peer: Peer, descs: Prepared | Descs) -> DescList:
    """The checked list of `peer`'s ranges of a transfer."""
    if not isinstance(descs, Prepared):
        return prepare_remote(ctx, peer, descs).descs
    if descs.peer != peer.name:
        raise DescriptorError(f"prepared for {descs.peer!r}, used for {peer.name!r}")
    if descs.incarnation != peer.incarnation:
        raise PeerRestartedError(peer.name, "prepared for an older incarnation; prepare again")
    return descs.descs

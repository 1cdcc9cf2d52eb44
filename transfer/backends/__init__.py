"""Backends and how an agent picks them.

=======  ==========================  ==================================  ============
kind     reaches                     data path                           extra deps
=======  ==========================  ==================================  ============
shm      same host (shm domain)      memcpy into the peer's segment      none
tcp      any host                    sendmsg / recvmsg_into, pipelined   none
nixl     any host NIXL reaches       NIXL one-sided WRITE/READ (UCX)     nixl
ucx      any host UCX reaches        ucxx tag send -> recv into place    ucxx
=======  ==========================  ==================================  ============

``backend="auto"`` runs nixl (if it imports and starts), shm and tcp side by
side, and picks per peer the first one both agents serve: nixl, else shm for a
peer in the same shm domain, else tcp. A list such as ``("shm", "tcp")`` sets
the preference order explicitly.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transfer.backends.base import Backend
from transfer.context import AgentContext
from transfer.errors import BackendUnavailableError

KINDS = ("nixl", "ucx", "shm", "tcp")
AUTO = ("nixl", "shm", "tcp")
log = logging.getLogger(__name__)

__all__ = ["AUTO", "KINDS", "Backend", "BackendOptions", "create", "resolve"]


@dataclass
class BackendOptions:
    host: str = "127.0.0.1"  # tcp/ucx control listener bind address
    port: int = 0  # tcp listener port (0: ephemeral)
    advertise_host: str | None = None  # address published to peers, if not `host`
    nixl: dict[str, Any] = field(default_factory=dict)  # NixlBackend keyword arguments
    ucx: dict[str, Any] = field(default_factory=dict)  # UcxBackend keyword arguments


def resolve(spec: str | Sequence[str]) -> tuple[list[str], bool]:
    """(kinds in preference order, whether unavailable ones may be skipped)."""
    if isinstance(spec, str):
        if spec == "auto":
            return list(AUTO), True
        spec = [spec]
    kinds = list(spec)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"backend must be 'auto' or distinct kinds of {KINDS}, got {spec!r}")
    return kinds, False


def available(kind: str) -> bool:
    """Whether the library of `kind` is installed (not whether it starts)."""
    module = {"nixl": "nixl", "ucx": "ucxx"}.get(kind)
    return module is None or importlib.util.find_spec(module) is not None


def create(kind: str, ctx: AgentContext, options: BackendOptions) -> Backend:
    if not available(kind):
        package = {
            "nixl": "nixl (pip install nixl-cu12 && pip install --no-deps nixl)",
            "ucx": "ucxx-cu12",
        }
        raise BackendUnavailableError(f"backend {kind!r} needs {package[kind]}")
    if kind == "tcp":
        from transfer.backends.tcp import TcpBackend

        return TcpBackend(ctx, options.host, options.port, options.advertise_host)
    if kind == "shm":
        from transfer.backends.shm import ShmBackend

        return ShmBackend(ctx)
    if kind == "nixl":
        from transfer.backends.nixl import NixlBackend

        return NixlBackend(ctx, **options.nixl)
    from transfer.backends.ucx import UcxBackend

    return UcxBackend(ctx, options.host, options.advertise_host, **options.ucx)


def create_all(
    kinds: list[str], optional: bool, ctx: AgentContext, options: BackendOptions
) -> dict[str, Backend]:
    """Start every backend of `kinds`; with `optional`, skip those that cannot start."""
    out: dict[str, Backend] = {}
    try:
        for kind in kinds:
            try:
                out[kind] = create(kind, ctx, options)
            except Exception as e:
                if not optional or kind == "tcp":
                    raise
                # Installed but unable to start deserves attention; absent is expected.
                level = logging.WARNING if available(kind) else logging.INFO
                log.log(level, "%s: backend %s skipped: %s", ctx.name, kind, e)
    except BaseException:
        for b in out.values():
            b.close()
        raise
    if not out:
        raise BackendUnavailableError(f"none of {kinds} could start")
    return out

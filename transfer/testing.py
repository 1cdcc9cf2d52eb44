"""Test and benchmark support: run peers inside a private network namespace.

NIXL and UCX open listeners on every interface. Tests and benchmarks must
only talk over loopback, so their peer processes join a private network
namespace holding nothing but ``lo``::

    with NetNamespace() as ns:               # a holder process owns the namespace
        subprocess.Popen([sys.executable, "peer.py", "--netns", ns.path])

    # in peer.py, first thing, before any thread or socket exists:
    enter_netns(args.netns)

Creating and joining a network namespace needs CAP_SYS_ADMIN (root, as on the
CI machines); `NetNamespace` raises `NetNamespaceError` with the reason when
that is missing. Only Linux is supported.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1

_HOLDER = """
import sys
from transfer.testing import _unshare_and_hold
_unshare_and_hold()
"""


class NetNamespaceError(RuntimeError):
    """A private network namespace cannot be created or joined here."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def bring_loopback_up() -> None:
    """Set ``lo`` up in the current network namespace (a new one starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def enter_netns(path: str) -> None:
    """Move the calling thread (call it before starting threads) into `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetNamespaceError(f"setns({path}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _unshare_and_hold() -> None:
    """Body of the holder process: new namespace, lo up, wait for stdin EOF."""
    if _libc().unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        print(f"error unshare(CLONE_NEWNET): {os.strerror(err)}", flush=True)
        sys.exit(1)
    try:
        bring_loopback_up()
    except OSError as e:
        print(f"error bringing lo up: {e}", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    sys.stdin.read()  # the namespace lives until our parent closes the pipe


class NetNamespace:
    """A private network namespace kept alive by a holder process."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise NetNamespaceError("network namespaces need Linux")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise NetNamespaceError(
                f"{line or 'holder died'}; run as root (CAP_SYS_ADMIN) to isolate NIXL/UCX tests"
            )
        self.path = f"/proc/{self._proc.pid}/ns/net"

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""POSIX shared-memory segments: unique names, creation, mapping, crash cleanup.

A segment is a file in a tmpfs directory (``/dev/shm`` by default) named::

    diptych.<pid-namespace>.<pid>.<process-start-time>.<incarnation>.<region-id>

* The incarnation (128 random bits, new for every agent start) makes names
  unique and unguessable; names are revealed only in the agent's metadata.
* Files are created ``0600`` with ``O_EXCL``: only the same user can map them.
* The owner unlinks its segments on `Agent.close`, from a finalizer at
  interpreter exit, and (for SIGKILL or a power cut) the next agent started on
  the host calls `sweep_stale_segments`, which unlinks every segment whose
  owner process (same pid namespace, same pid, same start time) is gone.

Mapped pages stay valid in every process that mapped them until it unmaps,
even after the name is unlinked, so a peer never faults because its target
died: it just writes into memory nobody will read, and its notification is
refused (see `transfer.backends.shm`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re

DEFAULT_DIR = "/dev/shm"
PREFIX = "diptych."
_NAME_RE = re.compile(r"^diptych\.(\d+)\.(\d+)\.(\d+)\.([0-9a-f]{32})\.(\d+)$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])


def segment_name(incarnation: str, region_id: int) -> str:
    pid = os.getpid()
    start = process_start_time(pid) or 0
    return f"{PREFIX}{_pid_namespace()}.{pid}.{start}.{incarnation}.{region_id}"


def create(
    name: str, nbytes: int, *, directory: str = DEFAULT_DIR, populate: bool = True
) -> mmap.mmap:
    """Create and map a new segment of `nbytes`; fails if the name exists."""
    if nbytes <= 0:
        raise ValueError(f"segment size must be positive, got {nbytes}")
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, nbytes, flags=flags)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def attach(name: str, nbytes: int, *, directory: str = DEFAULT_DIR) -> mmap.mmap:
    """Map a peer's segment; its real size must equal the advertised `nbytes`.

    The mapping is populated up front: otherwise every first touch of a 4 KiB page
    during a write takes a page fault, which costs more than the copy itself.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"not a diptych segment name: {name!r}")
    fd = os.open(os.path.join(directory, name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment {name} has {size} bytes, metadata says {nbytes}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(fd, size, flags=flags)
    finally:
        os.close(fd)


def unlink(name: str, *, directory: str = DEFAULT_DIR) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))


def sweep_stale_segments(directory: str = DEFAULT_DIR) -> list[str]:
    """Unlink segments whose owner process is gone; returns the names removed.

    Only segments created in this pid namespace are judged: a pid from another
    namespace (another container sharing the directory) says nothing here.
    """
    removed: list[str] = []
    ns = _pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or int(m.group(1)) != ns:
            continue
        pid, start = int(m.group(2)), int(m.group(3))
        if process_start_time(pid) != start:
            unlink(name, directory=directory)
            removed.append(name)
    return removed

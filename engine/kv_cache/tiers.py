"""KV tiers under the paged cache: a host-memory LRU and a disk LRU of whole blocks.

A block the prefix cache evicts from the device pool is not lost: its bytes (every
layer's K and V of the block, as the pool holds them: quantized KV as its codes and
scales) go to the host tier, and what the host tier evicts goes to the disk tier. Both
are keyed by the block's chained hash, the prefix cache's own key, within a namespace
that names the model and the layout, so no block is read back for another model, an
adapter or a layout it was not written under.

    device pool --evict--> host tier (RAM, `--kv-host-memory` GiB, LRU)
                               --evict--> disk tier (`--kv-disk-dir`, `--kv-disk-gib`, LRU)

A prefix that misses the device pool is looked up here block by block (`lookup`): a
host hit is a reference to the block's bytes; a disk hit is read, checked (magic,
namespace, length, CRC-32) and promoted to the host tier; a file that fails its check
is deleted and the prefix stops there (the rest is computed, never served stale). The
engine writes the bytes into fresh device blocks when it allocates them
(engine/kv_cache/manager.py), before any step reads them.

Disk files are written by one background thread (the step never waits on a write):
`<dir>/<namespace>/<hash>.kv`, written under a temporary name and renamed, so a crash
leaves no partial block under a block's name. The tier survives a restart: at start it
indexes the files already in its namespace, oldest first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from protocol.kv_layout import BlockHash, KvLayout

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.weights.source import ModelSource

log = logging.getLogger(__name__)

MAGIC = b"DKV1"
_HEADER = struct.Struct("<4s16sQI")  # magic, namespace (16 bytes), payload bytes, CRC-32
SUFFIX = ".kv"


@dataclass
class TierStats:
    """What the tiers did since start (the engine's snapshot and metrics read it)."""

    offloaded: int = 0  # blocks the device pool evicted into the host tier
    disk_hits: int = 0  # blocks read back from disk (checked, then promoted to host)
    disk_writes: int = 0
    disk_rejected: int = 0  # files that failed their check: deleted, recomputed
    dropped: int = 0  # blocks evicted from the lowest tier to nothing
    restored: int = 0  # blocks written back into the device pool
    restore_s: float = 0.0  # seconds spent writing them back
    disk_read_s: float = 0.0  # seconds spent reading `disk_hits` blocks (and checking them)
    host_blocks: int = 0  # blocks each tier holds now (`KvTiers.snapshot`)
    disk_blocks: int = 0
    block_bytes: int = 0
    block_size: int = 0  # tokens a block holds
    prefill_s_per_token: float = 0.0  # the engine's measured prefill speed (0: not yet)

    def restore_cost(self, tier: int) -> float | None:
        """Restoring a block from `tier` (1 host, 2 disk: read, then copied) against
        computing it, as measured here (what routers price a hit in that tier at);
        None until both have been measured."""
        compute = self.prefill_s_per_token * self.block_size
        if not compute or not self.restored or (tier == 2 and not self.disk_hits):
            return None
        seconds = self.restore_s / self.restored
        if tier == 2:
            seconds += self.disk_read_s / self.disk_hits
        return seconds / compute


def tier_namespace(source: ModelSource, layout: KvLayout, config: EngineConfig) -> bytes:
    """16 bytes that name what a block's bytes depend on beyond its tokens: the model's
    files (names, sizes, modification times), the weights' quantization, the compute
    dtype and the KV layout. A disk tier's blocks are read back only under the same."""
    path = source.path
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf")
    )  # fmt: skip
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    what = json.dumps(
        [source.name, stamp, config.quantization, config.dtype, layout.to_dict()],
        sort_keys=True, default=str,
    )  # fmt: skip
    return hashlib.sha256(what.encode()).digest()[:16]


def _alive(pid: str) -> bool:
    """Whether process `pid` (a temporary file's writer) still runs here."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class DiskTier:
    """Content-addressed block files in `root / namespace`, at most `capacity` bytes;
    the hashes of the blocks it lets go of (evicted, or refused) appended to `gone`.

    Workers of one model on one host may share the directory (`diptych serve`'s
    decode workers do): a file is the same bytes whoever wrote it, so a block one
    worker wrote is found by the others (a miss looks at the file system before it
    says no), a writer's temporary files carry its pid (another's start removes only
    those of writers no longer alive), and a file another worker evicted is a plain
    miss."""

    def __init__(self, root: Path, namespace: bytes, capacity: int, stats: TierStats,
                 gone: deque[BlockHash]) -> None:  # fmt: skip
        self.gone = gone
        self.dir = root / namespace.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.capacity = capacity
        self.stats = stats
        self.used = 0
        self._files: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> bytes, LRU first
        self._lock = threading.Lock()
        for partial in self.dir.glob("*.tmp"):  # a write a crash cut short
            if not _alive(partial.suffixes[-2][1:] if len(partial.suffixes) > 1 else ""):
                partial.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                h = int(path.stem, 16)
            except ValueError:
                continue
            size = path.stat().st_size
            self._files[h] = size
            self.used += size
        self._writes: queue.Queue[tuple[BlockHash, torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)  # fmt: skip
        self._writer.start()

    def _path(self, h: BlockHash) -> Path:
        return self.dir / f"{h:016x}{SUFFIX}"

    def __contains__(self, h: BlockHash) -> bool:
        with self._lock:
            if h in self._files:
                return True
        try:  # written by another worker sharing the directory since this one started
            size = self._path(h).stat().st_size
        except OSError:
            return False
        with self._lock:
            if h not in self._files:
                self._files[h] = size
                self.used += size
        return True

    def __len__(self) -> int:
        return len(self._files)

    def put(self, h: BlockHash, row: torch.Tensor) -> None:
        """Queue the block's bytes (a uint8 tensor no one writes to) for the writer."""
        self._writes.put((h, row))

    def flush(self) -> None:
        """Wait until every queued block is on disk (tests; a clean stop)."""
        self._writes.join()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as e:
                log.warning("KV disk tier: a block write failed: %s", e)
            finally:
                self._writes.task_done()

    def _write(self, h: BlockHash, row: torch.Tensor) -> None:
        payload = row.numpy().data
        header = _HEADER.pack(MAGIC, self.namespace, len(payload), zlib.crc32(payload))
        path = self._path(h)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # (another writer's is its own)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        size = len(header) + len(payload)
        with self._lock:
            old = self._files.pop(h, None)
            self.used += size - (old or 0)
            self._files[h] = size
            self.stats.disk_writes += 1
            while self.used > self.capacity and self._files:
                old, old_size = self._files.popitem(last=False)
                self.used -= old_size
                self.stats.dropped += 1
                self.gone.append(old)
                self._path(old).unlink(missing_ok=True)

    def get(self, h: BlockHash, nbytes: int) -> torch.Tensor | None:
        """The block's `nbytes` (read straight into a tensor), checked; None if absent
        or bad (a bad file is deleted: the block is computed again, never served)."""
        if h not in self:  # (a file another worker wrote is adopted)
            return None
        with self._lock:
            if h in self._files:
                self._files.move_to_end(h)
        began = time.perf_counter()
        row = torch.empty(nbytes, dtype=torch.uint8)
        payload = row.numpy().data
        try:
            with open(self._path(h), "rb") as f:
                head = f.read(_HEADER.size)
                got = f.readinto(payload)
                longer = f.read(1)
        except FileNotFoundError:  # another worker sharing the directory evicted it
            self.gone.append(h)
            self._forget(h)
            return None
        except OSError:
            head, got, longer = b"", 0, b""
        ok = len(head) == _HEADER.size and got == nbytes and not longer
        if ok:
            magic, namespace, length, crc = _HEADER.unpack(head)
            ok = (magic, namespace, length) == (MAGIC, self.namespace, nbytes)
            ok = ok and zlib.crc32(payload) == crc
        if not ok:
            self.stats.disk_rejected += 1
            self.gone.append(h)
            self._forget(h)
            return None
        self.stats.disk_read_s += time.perf_counter() - began
        return row

    def _forget(self, h: BlockHash) -> None:
        with self._lock:
            size = self._files.pop(h, None)
            if size is not None:
                self.used -= size
        self._path(h).unlink(missing_ok=True)

    def close(self) -> None:
        """Write what is queued, then stop the writer (once)."""
        if self._writer.is_alive():
            self._writes.put(None)
            self._writer.join(timeout=60)


class KvTiers:
    """The host tier (and the disk tier below it) of one engine's KV pool.

    `read(block_ids)` gives each device block's bytes ([block_bytes] uint8 on the host,
    a copy); `write(block_ids, rows)` puts such bytes back into device blocks."""

    def __init__(
        self,
        block_bytes: int,
        host_capacity: int,
        read: Callable[[list[int]], list[torch.Tensor]],
        write: Callable[[list[int], list[torch.Tensor]], None],
        disk: tuple[Path, int] | None = None,
        namespace: bytes = b"\x00" * 16,
    ) -> None:
        self.block_bytes = block_bytes
        self.host_capacity = host_capacity // block_bytes  # blocks
        self._read, self._write = read, write
        self.stats = TierStats()
        self._host: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()  # LRU first
        self._gone: deque[BlockHash] = deque()  # let go of by every tier (`drain_gone`)
        # ("host" | "disk", hash): where blocks went, in order, for KV events (`drain_moves`;
        # kept only once `record_moves` is set: an engine that publishes no events)
        self._moves: list[tuple[str, BlockHash]] = []
        self.record_moves = False
        self.disk = None if disk is None or disk[1] < block_bytes else DiskTier(
            disk[0], namespace, disk[1], self.stats, self._gone
        )  # fmt: skip
        # disk reads started when a request arrives (`prefetch`), so that its lookup,
        # a step or more later, finds the bytes read off the engine thread
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self._fetching: dict[BlockHash, Future[torch.Tensor | None]] = {}

    # -- the device pool evicts -----------------------------------------------------

    def offload(self, blocks: list[tuple[int, BlockHash]]) -> None:
        """(block id, hash) of cached blocks the pool is about to hand out again (or an
        idle session's, `KVCacheManager.offload`): their bytes kept, copied now before
        anything can write over them; a block the host tier holds already is not copied
        again (the same hash is the same bytes)."""
        new = []
        for block_id, h in blocks:
            if h in self._host:  # its bytes are kept already (a restored or copied block)
                self._host.move_to_end(h)
            else:
                new.append((block_id, h))
        if new:
            rows = self._read([b for b, _ in new])
            for row, (_, h) in zip(rows, new, strict=True):
                self._host_put(h, row)
                self.stats.offloaded += 1
        if self.record_moves:
            self._moves.extend(("host", h) for _, h in blocks if h in self._host)

    def _host_put(self, h: BlockHash, row: torch.Tensor) -> None:
        if h in self._host:
            self._host.move_to_end(h)
            return
        if self.host_capacity == 0:
            self._to_disk(h, row)
            return
        self._host[h] = row
        while len(self._host) > self.host_capacity:
            old, old_row = self._host.popitem(last=False)
            self._to_disk(old, old_row)

    def _to_disk(self, h: BlockHash, row: torch.Tensor) -> None:
        if self.disk is None:
            self.stats.dropped += 1
            self._gone.append(h)
            return
        if h not in self.disk:
            self.disk.put(h, row)
        if self.record_moves:
            self._moves.append(("disk", h))

    # -- a prefix misses the device pool --------------------------------------------

    def prefetch(self, hashes: list[BlockHash]) -> None:
        """Start reading the blocks of `hashes` that only the disk tier holds (a request
        arrived whose prefix they may be), on the reader thread."""
        self._sweep()
        if self.disk is None:
            return
        for h in hashes:
            if h not in self._host and h not in self._fetching and h in self.disk:
                self._fetching[h] = self._reader.submit(self.disk.get, h, self.block_bytes)

    def _sweep(self) -> None:
        """Reads that finished and no lookup took yet: into the host tier."""
        for h in [h for h, f in self._fetching.items() if f.done()]:
            row = self._fetching.pop(h).result()
            if row is not None:
                self._promote(h, row)

    def lookup(self, h: BlockHash) -> torch.Tensor | None:
        """The bytes of block `h` from the host tier, or from disk (checked, promoted to
        the host tier: a read `prefetch` started, waited for, else read now); None if no
        tier holds it intact."""
        row = self._host.get(h)
        if row is not None:
            self._host.move_to_end(h)
            return row
        if self.disk is None:
            return None
        fetching = self._fetching.pop(h, None)
        row = fetching.result() if fetching is not None else self.disk.get(h, self.block_bytes)
        if row is not None:
            self._promote(h, row)
        return row

    def holds(self, h: BlockHash) -> bool:
        """Whether a tier holds block `h` (a disk file is checked only when read)."""
        return h in self._host or h in self._fetching or (self.disk is not None and h in self.disk)

    def _promote(self, h: BlockHash, row: torch.Tensor) -> None:
        """A block read back from disk, into the host tier."""
        self.stats.disk_hits += 1
        self._host_put(h, row)
        if self.record_moves and h in self._host:
            self._moves.append(("host", h))

    def restore(self, block_ids: list[int], rows: list[torch.Tensor]) -> None:
        """Write tier bytes into fresh device blocks (before any step reads them)."""
        if not block_ids:
            return
        began = time.perf_counter()
        self._write(block_ids, rows)
        self.stats.restored += len(block_ids)
        self.stats.restore_s += time.perf_counter() - began

    # -- upkeep ---------------------------------------------------------------------

    def snapshot(self) -> TierStats:
        """A copy of the counts, with what each tier holds now (for other threads)."""
        return dataclasses.replace(
            self.stats, host_blocks=len(self._host), block_bytes=self.block_bytes,
            disk_blocks=0 if self.disk is None else len(self.disk),
        )  # fmt: skip

    def drain_moves(self) -> list[tuple[str, BlockHash]]:
        """("host" | "disk", hash) of the blocks that went into a tier since the last
        call, in order (a block in the pool too is nearest there: the caller drops it)."""
        out, self._moves = self._moves, []
        return out

    def drain_gone(self) -> list[BlockHash]:
        """Hashes no tier holds any more since the last call (the disk tier's writer
        adds to them from its thread: a deque, taken from one end)."""
        out = []
        while self._gone:
            out.append(self._gone.popleft())
        return out

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

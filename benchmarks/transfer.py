#!/usr/bin/env python
"""Transfer benchmark: GB/s of each backend beside the raw primitive it is built on.

    python benchmarks/transfer.py                          # every backend, 10 iterations
    python benchmarks/transfer.py --backends shm,tcp --iters 20
    python benchmarks/transfer.py --quick                  # smoke run, a few seconds

Two shapes, both 64 MiB: one 64 MiB descriptor, and 4,096 blocks of 16 KiB
scattered in random order over 128 MiB pools on both sides (nothing coalesces).

For each backend one sender process and one receiver process host both our
agent and the raw baseline, which works on the very same pool memory; the
sender alternates them transfer by transfer, so both see the same machine and
the same pages (these machines are shared and noisy).
Figures are medians over ``--iters`` timed transfers after ``--warmup``
untimed ones, one transfer in flight at a time:

- shm: ``Agent.write`` into the peer's shared pool, from post until the ACK
  that follows the receiver's check; raw: libc ``memcpy`` of the same ranges
  from the sender's pool into the receiver's segment, mapped by the sender.
- tcp: ``Agent.write`` over loopback, post until ACK; raw: ``sendall`` of
  each range from the sender and ``recv_into`` straight into place on the
  receiver, until a 1-byte ack comes back.
- nixl: ``Agent.write`` (NIXL WRITE + signed notification), post until DONE;
  raw: NIXL's ``initialize_xfer`` + ``transfer`` of the same descriptors with
  a plain notification (``--no-notify``: neither sends one), until DONE.
- ucx: ``Agent.write`` (tcp control, ucxx tag messages received in place),
  post until ACK; raw: a 4-byte note on a side socket names the ranges, the
  receiver posts one ``tag_recv`` per range in place while the sender posts
  one ``tag_send`` per range, until a completion message comes back.

The raw tcp baseline of the scattered shape sends range by range; ours
gathers up to 1,024 ranges per ``sendmsg``/``recvmsg_into``, which is why it
can beat it. Compare ours with the 1-descriptor raw figure for the limit.

Both sides build their descriptor lists (addresses, views) inside the timed
part of every transfer, as a prefill worker does for each request. Workers of
nixl and ucx run in a private network namespace (root needed; ``--no-netns``
runs them in the host namespace).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import platform
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from transfer import (  # noqa: E402
    Agent,
    AgentMetadata,
    DescList,
    Region,
    shmseg,
)
from transfer.testing import NetNamespace, NetNamespaceError, enter_netns  # noqa: E402

MiB = 1 << 20
TARGET = {"shm": 0.80, "tcp": 0.80, "nixl": 0.90, "ucx": 0.90}
RAW = {"shm": "memcpy", "tcp": "sendall/recv_into", "nixl": "NIXL WRITE", "ucx": "ucxx tag send"}
Shape = tuple[str, np.ndarray, np.ndarray, int]  # name, source units, destination units, unit bytes


LATENCY = "4 KiB, 1 descriptor"


def shapes(size: int, block: int) -> list[Shape]:
    """The bandwidth shapes, then a 4 KiB transfer whose time is the fixed cost."""
    rng = np.random.default_rng(1234)
    n = size // block
    one = (f"{size // MiB} MiB, 1 descriptor", np.array([0]), np.array([1]), size)
    src, dst = rng.choice(2 * n, n, replace=False), rng.choice(2 * n, n, replace=False)
    tiny = (LATENCY, np.array([3]), np.array([5]), 4096)
    return [one, (f"{n:,} x {block >> 10} KiB scattered", src, dst, block), tiny]


def _ranges(view: memoryview, units: np.ndarray, unit: int) -> list[memoryview]:
    return [view[u * unit : (u + 1) * unit] for u in units.tolist()]


# ---- raw baselines, on the very pool memory our agents use -------------------------
# The receiver side of each runs in a thread; the sender side is `once(shape)`.


class RawMemcpy:
    """memcpy from our pool into the peer's shared segment, mapped here: the same
    bytes our shm write moves, without the layer."""

    def __init__(self, pool: Region, peer_md: AgentMetadata, shm_dir: str) -> None:
        self.memcpy = ctypes.CDLL(None).memcpy
        self.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        info = peer_md.region(0)
        assert info.shm is not None
        self.dst = shmseg.attach(info.shm, info.nbytes, directory=shm_dir)
        self.src_base = pool.address
        self.dst_base = int(np.frombuffer(self.dst, dtype=np.uint8).ctypes.data)

    def once(self, shape: Shape) -> float:
        _, src, dst, unit = shape
        t0 = time.perf_counter()
        dsts, srcs = self.dst_base + dst * unit, self.src_base + src * unit
        for dp, sp in zip(dsts.tolist(), srcs.tolist()):
            self.memcpy(dp, sp, unit)
        return time.perf_counter() - t0


class RawSocket:
    def __init__(self, pool: Region, shapes_: list[Shape], role: str) -> None:
        self.view, self.shapes = pool.view(), shapes_
        self.contact: dict[str, Any] = {}
        if role == "recv":
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.contact = {"port": self.listener.getsockname()[1]}
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while head := conn.recv(4, socket.MSG_WAITALL):
            _, _, dst, unit = self.shapes[struct.unpack("<I", head)[0]]
            for part in _ranges(self.view, dst, unit):
                got = 0
                while got < unit:
                    got += conn.recv_into(part[got:])
            conn.sendall(b"k")

    def connect(self, contact: dict[str, Any]) -> None:
        if "port" in contact:
            self.sock = socket.create_connection(("127.0.0.1", contact["port"]))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once(self, shape: Shape) -> float:
        _, src, _, unit = shape
        t0 = time.perf_counter()
        self.sock.sendall(struct.pack("<I", self.shapes.index(shape)))
        for part in _ranges(self.view, src, unit):
            self.sock.sendall(part)
        self.sock.recv(1)
        return time.perf_counter() - t0


class RawNixl:
    """A second NIXL agent in the process, registering the same pool."""

    def __init__(self, pool: Region, role: str, notify: bool) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"raw-{role}", nixl_agent_config(enable_prog_thread=False))
        self.base, self.notify = pool.address, notify
        self.agent.register_memory([(self.base, pool.nbytes, 0, "")], "DRAM")
        md = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.contact = {"md": md, "base": self.base}
        if role == "recv":  # a target progresses its worker, as ours does every millisecond
            threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while True:
            self.agent.get_new_notifs()
            time.sleep(1e-3)

    def connect(self, contact: dict[str, Any]) -> None:
        self.remote = self.agent.add_remote_agent(base64.b64decode(contact["md"]))
        self.remote_base = contact["base"]

    def once(self, shape: Shape) -> float:
        _, src, dst, unit = shape

        def descs(base: int, units: np.ndarray) -> Any:
            rows = np.stack([base + units * unit, np.full(len(units), unit), 0 * units], 1)
            return self.agent.get_xfer_descs(rows.astype(np.uint64), "DRAM")

        note = b"x" if self.notify else b""
        t0 = time.perf_counter()
        local, remote = descs(self.base, src), descs(self.remote_base, dst)
        h = self.agent.initialize_xfer("WRITE", local, remote, self.remote, note)
        state = self.agent.transfer(h)
        while state == "PROC":
            os.sched_yield()
            state = self.agent.check_xfer_state(h)
        elapsed = time.perf_counter() - t0
        h.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL write failed: {state}")
        return elapsed


class RawUcx:
    """One tag message per range into receives posted in place. A side tcp socket
    tells the receiver which ranges come next; it posts its receives while the
    sender already posts its sends (as ours does), and reports completion."""

    def __init__(self, pool: Region, shapes_: list[Shape], role: str) -> None:
        from transfer.backends.ucx_engine import DEFAULT_CONFIG, _import_ucxx

        api = self.api = _import_ucxx()
        from ucxx._lib.arr import Array

        self.Array, self.shapes, self.view = Array, shapes_, pool.view()
        features = (api.Feature.TAG, api.Feature.WAKEUP)
        self.worker = api.UCXWorker(api.UCXContext(dict(DEFAULT_CONFIG), feature_flags=features))
        self.worker.init_blocking_progress_mode()
        self.flag = np.zeros(1, dtype=np.uint8)
        self.data, self.ctl = api.UCXXTag(1), api.UCXXTag(2)
        self.contact: dict[str, Any] = {"address": self.worker.address.tobytes().hex()}
        if role == "recv":
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.contact["port"] = self.listener.getsockname()[1]

    def connect(self, contact: dict[str, Any]) -> None:
        address = self.api.UCXAddress.create_from_buffer(bytes.fromhex(contact["address"]))
        self.ep = self.worker.create_endpoint_from_worker_address(address, False)
        if "port" in contact:
            self.side = socket.create_connection(("127.0.0.1", contact["port"]))
        else:
            threading.Thread(target=self._serve, daemon=True).start()

    def _wait(self, reqs: list[Any]) -> None:
        for r in reqs:
            while not r.completed:
                self.worker.progress()
                os.sched_yield()  # spin politely: the peer may need this core to copy
            r.check_error()

    def _serve(self) -> None:
        side, _ = self.listener.accept()
        while head := side.recv(4, socket.MSG_WAITALL):
            _, _, dst, unit = self.shapes[struct.unpack("<I", head)[0]]
            views = _ranges(self.view, dst, unit)
            self._wait([self.worker.tag_recv(self.Array(v), self.data) for v in views])
            self._wait([self.ep.tag_send(self.Array(self.flag), self.ctl)])  # done

    def once(self, shape: Shape) -> float:
        _, src, _, unit = shape
        t0 = time.perf_counter()
        self.side.sendall(struct.pack("<I", self.shapes.index(shape)))
        views = _ranges(self.view, src, unit)
        reqs = [self.ep.tag_send(self.Array(v), self.data) for v in views]
        done = self.worker.tag_recv(self.Array(self.flag), self.ctl)
        self._wait(reqs)
        self._wait([done])
        return time.perf_counter() - t0


# ---- workers -------------------------------------------------------------------------

_OUT = sys.stdout  # a worker's private copy of stdout (see run_worker)


def _say(obj: Any) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def _hear() -> Any:
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def _digest(view: memoryview, units: np.ndarray, unit: int) -> str:
    h = hashlib.sha256()
    for part in _ranges(view, units, unit):
        h.update(part)
    return h.hexdigest()


def run_worker(args: argparse.Namespace) -> None:
    global _OUT
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries that print (NIXL logs to stdout) must not corrupt our lines
    if args.netns:
        enter_netns(args.netns)
    kind, role, size = args.kind, args.role, args.size
    cases = shapes(size, args.block)
    agent = Agent(f"bench-{role}", backend=kind)
    pool = agent.allocate(2 * size)
    if role == "send":
        pool.numpy()[:] = np.random.default_rng(1).integers(0, 256, 2 * size, dtype=np.uint8)
    raw: Any = None
    if kind == "tcp":
        raw = RawSocket(pool, cases, role)
    elif kind == "nixl":
        raw = RawNixl(pool, role, notify=not args.no_notify)
    elif kind == "ucx":
        raw = RawUcx(pool, cases, role)
    _say({"md": agent.metadata().decode(), "raw": getattr(raw, "contact", None)})
    peer = _hear()
    agent.add_remote(peer["md"])
    if kind == "shm" and role == "send":
        raw = RawMemcpy(pool, agent.remote("bench-recv"), shmseg.DEFAULT_DIR)
    elif raw is not None:
        raw.connect(peer["raw"])
    if role == "recv":
        check = _hear()  # the sender's digest of the scattered shape, which ours wrote last
        _, _, dst, unit = cases[1]
        _say({"verified": _digest(pool.view(), dst, unit) == check["digest"]})
        _hear()
        agent.close()
        return
    note = None if args.no_notify else b"kv-ready"
    results: dict[str, dict[str, float]] = {}
    for shape in cases:
        name, src, dst, unit = shape
        t_raw, t_ours = [], []
        for i in range(args.warmup + args.iters):
            raw_s = raw.once(shape)
            t0 = time.perf_counter()
            local, remote = DescList.blocks(pool, src, unit), DescList.blocks(0, dst, unit)
            agent.write(local, "bench-recv", remote, notification=note).result(60)
            ours_s = time.perf_counter() - t0
            if i >= args.warmup:
                t_raw.append(raw_s)
                t_ours.append(ours_s)
        results[name] = {"raw_s": float(np.median(t_raw)), "ours_s": float(np.median(t_ours))}
    _, src, _, unit = cases[1]
    _say(
        {
            "results": results,
            "via": agent.backend_for("bench-recv"),
            "digest": _digest(pool.view(), src, unit),
        }
    )
    _hear()
    agent.close()


# ---- driver --------------------------------------------------------------------------


class Pair:
    """A receiver and a sender worker for one backend."""

    def __init__(self, kind: str, args: argparse.Namespace, netns: str | None) -> None:
        cmd = [sys.executable, __file__, "--worker", "--kind", kind, "--size", str(args.size)]
        cmd += [
            "--block",
            str(args.block),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
        ]
        cmd += ["--no-notify"] if args.no_notify else []
        cmd += ["--netns", netns] if netns else []
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARN"}
        err = None if args.verbose else subprocess.DEVNULL
        self.recv, self.send = (
            subprocess.Popen(
                [*cmd, "--role", r],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
            for r in ("recv", "send")
        )

    @staticmethod
    def _line(p: subprocess.Popen[str], timeout: float = 900.0) -> Any:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("a benchmark worker failed (rerun with --verbose)")
        return json.loads(line)

    @staticmethod
    def _tell(p: subprocess.Popen[str], obj: Any) -> None:
        assert p.stdin is not None
        p.stdin.write(json.dumps(obj) + "\n")
        p.stdin.flush()

    def run(self) -> dict[str, Any]:
        try:
            hello_r, hello_s = self._line(self.recv), self._line(self.send)
            self._tell(self.recv, hello_s)
            self._tell(self.send, hello_r)
            out = self._line(self.send)
            self._tell(self.recv, {"digest": out["digest"]})
            out["verified"] = self._line(self.recv)["verified"]
            for p in (self.recv, self.send):
                self._tell(p, {})
                p.wait(timeout=60)
            return dict(out)
        finally:
            for p in (self.recv, self.send):
                if p.poll() is None:
                    p.kill()
                    p.wait()


def cpu_pressure() -> str:
    """Share of the last 10 s in which some task waited for a CPU (Linux PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().split()[1].split("=")[1] + " %"
    except (OSError, IndexError):
        return "n/a"


def report(rows: list[dict[str, Any]], args: argparse.Namespace, pressure: str) -> str:
    lines = [
        f"{os.cpu_count()} CPUs ({platform.machine()}), Linux {platform.release()}, "
        f"Python {platform.python_version()}; median of {args.iters} after {args.warmup} "
        f"warm-up; {'no notifications' if args.no_notify else 'with a notification'}; "
        f"CPU pressure (some, avg10) {pressure}",
        "",
        "| backend | shape | raw baseline | raw GB/s | ours GB/s | ours / raw | target |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["shape"] == LATENCY:
            continue
        raw, ours = args.size / r["raw_s"] / 1e9, args.size / r["ours_s"] / 1e9
        ratio = ours / raw
        verdict = "met" if ratio >= TARGET[r["kind"]] else "missed"
        lines.append(
            f"| {r['kind']} | {r['shape']} | {RAW[r['kind']]} | {raw:.2f} | {ours:.2f} "
            f"| {ratio:.0%} | {TARGET[r['kind']]:.0%} {verdict} |"
        )
    lines += ["", f"Fixed cost per transfer ({LATENCY}, round trip, median):", ""]
    lines += ["| backend | raw µs | ours µs |", "|---|---:|---:|"]
    for r in rows:
        if r["shape"] == LATENCY:
            lines.append(f"| {r['kind']} | {r['raw_s'] * 1e6:.0f} | {r['ours_s'] * 1e6:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backends", default="shm,tcp,nixl,ucx")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", type=int, default=64 * MiB, help=argparse.SUPPRESS)
    p.add_argument("--block", type=int, default=16 << 10, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="8 MiB and 3 iterations: a smoke run")
    p.add_argument("--no-notify", action="store_true", help="transfers without notifications")
    p.add_argument(
        "--no-netns", action="store_true", help="run nixl/ucx workers in the host namespace"
    )
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    for hidden in ("--kind", "--role", "--netns"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.quick:
        args.size, args.iters, args.warmup = 8 * MiB, 3, 1
    kinds = [k.strip() for k in args.backends.split(",") if k.strip()]
    ns = None
    if not args.no_netns and {"nixl", "ucx"} & set(kinds):
        try:
            ns = NetNamespace()
        except NetNamespaceError as e:
            sys.exit(f"nixl/ucx workers need a private network namespace: {e} (or --no-netns)")
    rows = []
    pressure_before = cpu_pressure()
    try:
        for kind in kinds:
            netns = ns.path if ns is not None and kind in ("nixl", "ucx") else None
            out = Pair(kind, args, netns).run()
            if not out["verified"]:
                sys.exit(f"{kind}: the receiver's bytes differ from the sender's")
            for shape, r in out["results"].items():
                rows.append({"kind": kind, "shape": shape, "via": out["via"], **r})
                raw_ms, ours_ms = r["raw_s"] * 1e3, r["ours_s"] * 1e3
                print(
                    f"  {kind:5s} {shape:26s} raw {raw_ms:8.3f} ms  ours {ours_ms:8.3f} ms",
                    file=sys.stderr,
                )
    finally:
        if ns is not None:
            ns.close()
    print(report(rows, args, f"{pressure_before} before, {cpu_pressure()} after"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

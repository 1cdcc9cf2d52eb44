"""`diptych serve`: frontend + decode workers + prefill workers as local processes.

Each role runs in its own process (`python -m diptych.roles <config.json>`, its typed
config written by `diptych.role_config`), in its own
session so a terminal's Ctrl-C reaches only the launcher, which then stops the
frontend first (no new requests), then the workers, each with SIGTERM and a grace
period, SIGKILL after it. Children's output is forwarded with a `[role]` prefix.
The embedded control plane lives in a state directory (a fresh temporary one
unless given), removed on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from diptych.role_config import RoleConfig, dumps
from diptych.roles import READY

# Lines of a child's output kept to explain its death.
TAIL_LINES = 12


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    config_path: str
    ready: threading.Event = field(default_factory=threading.Event)
    details: dict[str, object] = field(default_factory=dict)  # its DIPTYCH_READY line's
    restarts: list[float] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    eof: threading.Event = field(default_factory=threading.Event)

    def death_report(self) -> str:
        """Why this child is gone: its exit status, the last lines it printed, a hint."""
        code = self.proc.returncode
        self.eof.wait(2.0)  # the forwarder may still be reading its last lines
        status = f"exited with code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                status = f"was killed by {signal.Signals(-code).name}"
        lines = [ln.rstrip() for ln in self.tail if ln.strip()]
        text = "".join(f"\n    {ln}" for ln in lines[-8:]) or "\n    (it printed nothing)"
        return f"{self.name} {status}; its last lines:{text}\n  hint: {_hint(code, lines)}"


def _hint(code: int | None, lines: list[str]) -> str:
    text = "\n".join(lines).lower()
    if code == -signal.SIGILL or any(
        word in text for word in ("illegal instruction", "mkldnn", "onednn", "avx", "cpu ops")
    ):
        return (
            "this looks like a CPU kernel problem; retry with DIPTYCH_CPU_ISA=generic (or "
            "DIPTYCH_CPU_KERNELS=0 for the torch path) and report it with `lscpu` and this log"
        )
    if "address already in use" in text:
        return "a port is taken; choose others (--port, --metrics-port) or stop the other server"
    return "run with -v for the whole log, or start the role alone (diptych decode|prefill ...)"


class LaunchError(RuntimeError):
    pass


def private_dir(path: str) -> None:
    """Make `path` (and its parents) a directory only its owner may enter: created 0700,
    or tightened to 0700 when it exists with group or other bits and is ours."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        os.chmod(path, 0o700)


class Launcher:
    def __init__(self, *, state_dir: str | None, quiet: bool = False) -> None:
        self._own_state = state_dir is None
        self.state_dir = state_dir or tempfile.mkdtemp(prefix="diptych-")
        # The state holds queued prompts, configs with API keys, the manifest: owner only,
        # and so is everything the launcher and its children create (they inherit the mask)
        os.umask(0o077)
        private_dir(self.state_dir)
        self.children: list[Child] = []
        self.quiet = quiet
        self.extra_manifest: dict[str, object] = {}  # more top-level entries of serve.json
        self._lock = threading.Lock()

    @property
    def control_plane_url(self) -> str:
        return f"embedded:{self.state_dir}"

    def spawn(self, name: str, role: str, config: RoleConfig, *, verbose: bool = False) -> Child:
        """Start `role` with its typed `config` (written next to the state, for restarts)."""
        path = os.path.join(self.state_dir, f"{name}.config.json")
        # owner-only: a frontend's config may hold its API keys
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.chmod(path, 0o600)  # an existing file keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(dumps(role, config, verbose=verbose))
        return self._start(name, path)

    def _start(self, name: str, config_path: str) -> Child:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diptych.roles", config_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        child = Child(name, proc, config_path)
        self.children.append(child)
        threading.Thread(target=self._forward, args=(child,), daemon=True).start()
        return child

    def _forward(self, child: Child) -> None:
        stream: IO[str] | None = child.proc.stdout
        assert stream is not None
        for line in stream:
            if line.startswith(READY):
                parts = line.split(" ", 2)
                child.details = json.loads(parts[2]) if len(parts) > 2 else {}
                child.ready.set()
                continue
            child.tail.append(line)
            if not self.quiet:
                with self._lock:
                    sys.stderr.write(f"[{child.name}] {line}")
                    sys.stderr.flush()
        child.eof.set()

    def wait_ready(
        self, child: Child, timeout: float, stopping: Callable[[], bool] = lambda: False
    ) -> dict[str, object]:
        end = time.monotonic() + timeout
        while not child.ready.wait(0.2):
            if stopping():
                raise LaunchError("interrupted")
            if child.proc.poll() is not None:
                raise LaunchError(f"{child.name} did not start: {child.death_report()}")
            if time.monotonic() > end:
                raise LaunchError(f"{child.name} was not ready within {timeout:.0f} s")
        return child.details

    def respawn(self, child: Child, max_per_minute: int = 5) -> Child:
        """Start a dead child again with the same config, unless it keeps dying."""
        now = time.monotonic()
        recent = [t for t in child.restarts if now - t < 60] + [now]
        if len(recent) > max_per_minute:
            raise LaunchError(f"{child.name} died {len(recent)} times within a minute")
        self.children.remove(child)
        fresh = self._start(child.name, child.config_path)
        fresh.restarts = recent
        return fresh

    def write_manifest(self) -> str:
        """`serve.json` in the state directory: every child's pid and endpoints."""
        path = os.path.join(self.state_dir, "serve.json")
        doc: dict[str, object] = {c.name: {"pid": c.proc.pid, **c.details} for c in self.children}
        doc.update(self.extra_manifest)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
        return path

    def shutdown(self, grace: float = 15.0) -> None:
        """Frontend first, then the rest: SIGTERM, wait up to `grace` s, SIGKILL."""
        order = sorted(self.children, key=lambda c: not c.name.startswith("frontend"))
        for group in (order[:1], order[1:]):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            for c in group:
                try:
                    c.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
        if self._own_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)

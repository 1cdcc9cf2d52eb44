"""The worker pools of `diptych serve`, grown and shrunk while it runs.

`LocalFleet` keeps a desired size per pool; `reconcile`, called by the launcher's
supervising loop, starts workers up to it (`prefill-3`, `decode-2`, new names, never
reused while the old one drains) and stops the surplus gracefully: SIGTERM, upon
which the worker leaves discovery, takes no new work and finishes what it holds
(`--drain-timeout`), then exits; only a worker still there `kill_after` s later is
killed. A worker that exits while retiring is forgotten, not restarted.

`ControlServer` is the planner's local connector's other end, an HTTP endpoint on
loopback (the address is in `serve.json` and handed to the planner child):

    GET /pools                   every pool: desired, running, ready, workers
    PUT /pools/<pool>            {"replicas": N}: the pool's new desired size

It runs in its own thread and only sets the desired sizes (under a lock); starting
and stopping processes stays on the launcher's thread.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypedDict

from diptych.launcher import Child, Launcher
from diptych.role_config import RoleConfig

log = logging.getLogger(__name__)

MAX_REPLICAS = 256


class WorkerStatus(TypedDict):
    name: str
    pid: int
    state: str  # starting, ready or retiring
    alive: bool


class PoolStatus(TypedDict):
    """One pool as `GET /pools` shows it."""

    desired: int
    running: int
    ready: int
    workers: list[WorkerStatus]


def pool_of(child: Child) -> str:
    return child.name.rsplit("-", 1)[0]


class LocalFleet:
    def __init__(
        self,
        launcher: Launcher,
        config_of: dict[str, Callable[[str], RoleConfig]],
        *,
        drain_timeout: float,
        verbose: bool = False,
        say: Callable[[str], None] = print,
    ) -> None:
        """`config_of[pool](worker_id)` is the role config of a new worker of `pool`."""
        self.launcher = launcher
        self.config_of = config_of
        self.kill_after = drain_timeout + 15.0
        self.verbose = verbose
        self.say = say
        self._lock = threading.Lock()
        self._desired = {pool: 0 for pool in config_of}
        self._next = {pool: 0 for pool in config_of}
        self._retiring: dict[int, float] = {}  # pid -> when to kill it

    # -- what the control thread calls -----------------------------------------------
    def set_desired(self, pool: str, replicas: int) -> None:
        if pool not in self._desired:
            raise ValueError(f"unknown pool {pool!r}; the pools are {sorted(self._desired)}")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ValueError(f"replicas must be an integer, got {replicas!r}")
        if not 0 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"{pool} replicas must be in [0, {MAX_REPLICAS}], got {replicas}")
        with self._lock:
            self._desired[pool] = replicas

    def status(self) -> dict[str, PoolStatus]:
        with self._lock:
            desired = dict(self._desired)
            retiring = set(self._retiring)
        out: dict[str, PoolStatus] = {}
        for pool in desired:
            workers: list[WorkerStatus] = []
            for c in self.members(pool):
                alive = c.proc.poll() is None
                state = "retiring" if c.proc.pid in retiring else "starting"
                if c.proc.pid not in retiring and c.ready.is_set():
                    state = "ready"
                workers.append({"name": c.name, "pid": c.proc.pid, "state": state, "alive": alive})
            active = [w for w in workers if w["state"] != "retiring" and w["alive"]]
            out[pool] = {
                "desired": desired[pool],
                "running": len(active),
                "ready": sum(w["state"] == "ready" for w in active),
                "workers": workers,
            }
        return out

    # -- what the launcher's thread calls --------------------------------------------
    def members(self, pool: str) -> list[Child]:
        return [c for c in list(self.launcher.children) if pool_of(c) == pool]

    def adopt(self, pool: str, count: int) -> None:
        """The launcher started `count` workers of `pool` (named `pool-0`...) itself."""
        with self._lock:
            self._desired[pool] = count
            self._next[pool] = max(self._next[pool], count)

    def is_retiring(self, child: Child) -> bool:
        with self._lock:
            return child.proc.pid in self._retiring

    def reconcile(self, now: float | None = None) -> bool:
        """Start or stop workers toward the desired sizes, and finish retirements;
        True when the membership changed."""
        now = time.monotonic() if now is None else now
        changed = self._finish_retirements(now)
        with self._lock:
            desired = dict(self._desired)
            retiring = set(self._retiring)
        for pool, want in desired.items():
            active = [
                c for c in self.members(pool)
                if c.proc.pid not in retiring and c.proc.poll() is None
            ]  # fmt: skip
            if len(active) < want:
                for _ in range(want - len(active)):
                    self._spawn(pool)
                changed = True
            elif len(active) > want:
                # the ones still starting go first, then the newest
                victims = sorted(active, key=lambda c: (c.ready.is_set(), _index(c)))
                for c in victims[: len(active) - want]:
                    self._retire(c, now)
                changed = True
        return changed

    def _spawn(self, pool: str) -> Child:
        with self._lock:
            index = self._next[pool]
            self._next[pool] += 1
        name = f"{pool}-{index}"
        config = self.config_of[pool](name)
        self.say(f"diptych serve: starting {name} (scale-up)")
        return self.launcher.spawn(name, pool, config, verbose=self.verbose)  # role = pool

    def _retire(self, child: Child, now: float) -> None:
        self.say(f"diptych serve: draining {child.name} (scale-down)")
        with self._lock:
            self._retiring[child.proc.pid] = now + self.kill_after
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)

    def _finish_retirements(self, now: float) -> bool:
        changed = False
        with self._lock:
            retiring = dict(self._retiring)
        for c in list(self.launcher.children):
            deadline = retiring.get(c.proc.pid)
            if deadline is None:
                continue
            if c.proc.poll() is None and now > deadline:
                self.say(f"diptych serve: {c.name} did not drain in time; killing it")
                c.proc.kill()
            if c.proc.poll() is not None:
                self.launcher.children.remove(c)
                with self._lock:
                    self._retiring.pop(c.proc.pid, None)
                code = c.proc.returncode
                self.say(f"diptych serve: {c.name} drained and stopped (exit code {code})")
                changed = True
        return changed


def _index(child: Child) -> int:
    tail = child.name.rsplit("-", 1)[-1]
    return -int(tail) if tail.isdigit() else 0


class ControlServer:
    """The HTTP endpoint the planner's local connector calls (see the module doc)."""

    def __init__(self, fleet: LocalFleet, host: str = "127.0.0.1", port: int = 0) -> None:
        self.fleet = fleet
        handler = _handler(fleet)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fleet-control", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def send_json(handler: BaseHTTPRequestHandler, code: int, doc: object) -> None:
    """Answer the request `handler` holds with `doc` as JSON."""
    body = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _handler(fleet: LocalFleet) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            log.debug("fleet control: %s", format % args)

        def _reply(self, code: int, doc: object) -> None:
            send_json(self, code, doc)

        def _pool(self) -> str | None:
            parts = self.path.rstrip("/").split("/")
            if len(parts) == 3 and parts[1] == "pools":
                return parts[2]
            return None

        def do_GET(self) -> None:
            status = fleet.status()
            if self.path.rstrip("/") == "/pools":
                self._reply(200, status)
                return
            pool = self._pool()
            if pool in status:
                self._reply(200, status[pool])
                return
            self._reply(404, {"error": f"no such resource {self.path}"})

        def do_PUT(self) -> None:
            pool = self._pool()
            if pool is None:
                self._reply(404, {"error": f"no such resource {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                doc = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(doc, dict) or "replicas" not in doc:
                    raise ValueError('expected {"replicas": N}')
                fleet.set_desired(pool, doc["replicas"])
            except (ValueError, json.JSONDecodeError) as e:
                self._reply(400, {"error": str(e)})
                return
            self._reply(200, fleet.status()[pool])

    return Handler

"""Run one role in this process until SIGINT/SIGTERM, then shut it down cleanly.

A role prints one line `DIPTYCH_READY <role> <json>` on stdout once it serves; the
launcher of `diptych serve` waits for it. The launcher starts each child as
`python -m diptych.roles <config.json>`, the role's typed config as
`diptych.role_config` writes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, NoReturn, TypeVar, cast

from decode_worker.config import DecodeWorkerConfig
from diptych.role_config import RoleConfig
from frontend.config import FrontendConfig
from planner.config import PlannerConfig
from prefill_worker.config import PrefillWorkerConfig
from runtime import event_loop
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)

READY = "DIPTYCH_READY"
C = TypeVar("C")
# a role's start: what it announces once it serves (its addresses, ...)
Start = Callable[[], Awaitable[Mapping[str, object]]]


STARTUP = logging.getLogger("diptych.startup")


def show_startup(prefix: str = "") -> None:
    """Print the start-up stages (`diptych.startup`: kernels built or cached, weights,
    KV pool, ready) as plain lines on stderr whatever the log level: a cold start takes
    minutes, and silence meanwhile looks like a hang. `diptych serve` shows its
    children's lines under their names."""
    if STARTUP.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    STARTUP.addHandler(handler)
    STARTUP.setLevel(logging.INFO)
    STARTUP.propagate = False


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def announce(role: str, **details: object) -> None:
    print(f"{READY} {role} {json.dumps(details)}", flush=True)


async def run_until_signalled(
    role: str,
    start: Start,
    stop: Callable[[], Awaitable[None]],
    done: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Start, announce readiness, then stop on SIGINT/SIGTERM or when `done` returns
    (a server that handled the signal itself)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        details = await start()
    except (ConfigError, FileNotFoundError):  # the user's settings (a model, a file that
        await stop()  # is not there): the command prints it in one line, no traceback
        raise
    except Exception:
        log.exception("%s failed to start", role)
        await stop()
        raise
    age = process_age_s()
    if age is not None:
        STARTUP.info("%s ready %.1f s after its process started", role, age)
    announce(role, **details)
    waits: set[asyncio.Future[object]] = {asyncio.ensure_future(stopping.wait())}
    if done is not None:
        waits.add(asyncio.ensure_future(done()))
    finished, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    log.info("%s shutting down", role)
    await stop()
    for w in finished:  # `done` ended with an error (a worker's engine died): exit 1
        if not w.cancelled() and w.exception() is not None:
            raise cast(BaseException, w.exception())


def run_decode(config: DecodeWorkerConfig) -> int:
    from decode_worker.worker import DecodeWorker

    worker = DecodeWorker(config)

    async def start() -> dict[str, object]:
        info = await worker.start()
        return {
            **_worker_details(info, worker.core.runner.kernel_summary()),
            "grpc": info.grpc_address,
            "kv_tokens": worker.core.layout.num_blocks * worker.core.layout.block_size,
            "max_batch": worker.config.engine.max_num_seqs,
        }

    return _run("decode", start, worker.stop, lambda: worker.rt.engine.died())


def run_prefill(config: PrefillWorkerConfig) -> int:
    from prefill_worker.worker import PrefillWorker

    worker = PrefillWorker(config)

    async def start() -> dict[str, object]:
        info = await worker.start()
        return _worker_details(info, worker.core.runner.kernel_summary())

    return _run("prefill", start, worker.stop, lambda: worker.rt.engine.died())


def _worker_details(info: WorkerInfo, kernels: str) -> dict[str, object]:
    """What every worker role announces: its id, metrics address and kernels."""
    return {"worker_id": info.worker_id, "metrics": info.metrics_address, "kernels": kernels}


def run_frontend(config: FrontendConfig) -> int:
    from frontend.server import FrontendServer

    server = FrontendServer(config)

    async def start() -> dict[str, str]:
        address = await server.start()
        model = server.app.state.frontend.model_name
        return {"url": f"{server.scheme}://{address}", "model": model}

    return _run("frontend", start, server.stop, server.wait)


def run_planner(config: PlannerConfig) -> int:
    from diptych.planner_process import PlannerProcess

    process = PlannerProcess(config)
    return _run("planner", process.start, process.stop)


def run_role(role: str, config: RoleConfig) -> int:
    runners: dict[str, Callable[[RoleConfig], int]] = {
        "decode": _taking(DecodeWorkerConfig, run_decode),
        "prefill": _taking(PrefillWorkerConfig, run_prefill),
        "frontend": _taking(FrontendConfig, run_frontend),
        "planner": _taking(PlannerConfig, run_planner),
    }
    try:
        return runners[role](config)
    except (ConfigError, FileNotFoundError) as e:  # settings the role cannot start with
        print(f"diptych {role}: {e}", file=sys.stderr)  # (raised before its start)
        return 1


def _taking(cls: type[C], run: Callable[[C], int]) -> Callable[[RoleConfig], int]:
    """`run`, which runs a role of config `cls`, for any role's config: another is a
    TypeError."""

    def checked(config: RoleConfig) -> int:
        if not isinstance(config, cls):
            raise TypeError(f"this role runs with a {cls.__name__}, not a {type(config).__name__}")
        return run(config)

    return checked


def main(argv: list[str]) -> int:
    from diptych.role_config import loads

    if len(argv) != 1:
        print("usage: python -m diptych.roles <role config .json>", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        role, config, verbose = loads(f.read())
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    show_startup()
    return run_role(role, config)


def _run(
    role: str,
    start: Start,
    stop: Callable[[], Awaitable[None]],
    done: Callable[[], Awaitable[None]] | None = None,
) -> int:
    try:
        event_loop.run(run_until_signalled(role, start, stop, done))
    except Exception as e:
        print(f"diptych {role}: {e}", file=sys.stderr)
        return 1
    return 0


def exit_now(code: int) -> NoReturn:
    """End a role's process once its stop has closed everything it holds (the KV pool's
    segments unlinked, the queue's store closed, the sockets shut): its logs and output
    flushed, without the interpreter's teardown of torch and the model, about a second
    of every stop, spent one role after the other when `diptych serve` stops."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))

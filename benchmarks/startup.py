"""How long a server takes to start and to stop: `diptych serve` on its defaults (the
default model, 1 prefill + 1 decode worker, the embedded control plane), from this tree
and from ``--baseline`` (another checkout, e.g. a git worktree of an older commit), in
alternated rounds, after one warm-up start each (the C++ build and the tokenizer cache
are warm: what is timed is a process tree's own start, the one a planner's scale-up and
every restart pay).

    python benchmarks/startup.py --baseline /path/to/worktree [--rounds 3] [--write-docs]

Also, in this process: opening the default GGUF's metadata and tensor table with
`gguf.GGUFReader` and with `engine/weights/gguf_file.py`, and one `LLM()` (import
excluded) of the default model in fp32.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402

HEADING = "### Starting and stopping a server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_once(tree: Path) -> tuple[float, float]:
    """(seconds to "Diptych is serving", seconds from SIGINT to the tree's exit)."""
    python = tree / ".venv" / "bin" / "python"
    exe = str(python) if python.exists() else sys.executable
    with tempfile.TemporaryDirectory() as state:
        cmd = [exe, "-m", "diptych.cli", "serve", "--port", str(_free_port()),
               "--state-dir", state]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONPATH": str(tree)},
        )  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("Diptych is serving"):
                break
        else:
            raise RuntimeError(f"{tree}: diptych serve exited with {proc.wait()}")
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        proc.stdout.read()
        code = proc.wait(120)
        stopped = time.perf_counter() - t1
    if code != 0:
        raise RuntimeError(f"{tree}: diptych serve stopped with {code}")
    return started, stopped


def in_process() -> dict[str, float]:
    import gguf

    from engine.weights import resolve_model
    from engine.weights.gguf_file import GGUFFile

    path = resolve_model(None).path
    out: dict[str, float] = {}
    for name, open_ in (("gguf.GGUFReader", gguf.GGUFReader), ("gguf_file.GGUFFile", GGUFFile)):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            open_(path)
            best = min(best, time.perf_counter() - t)
        out[f"open the default GGUF: {name}"] = best
    from engine import LLM

    t = time.perf_counter()
    LLM(dtype="float32", kv_cache_memory_bytes=1 << 28)
    out["LLM() of the default model, fp32 (import excluded)"] = time.perf_counter() - t
    return out


def render(timings: dict[str, list[tuple[float, float]]], local: dict[str, float]) -> str:
    cmd = "python benchmarks/startup.py " + shlex.join(sys.argv[1:])
    rows = []
    for name, xs in timings.items():
        starts, stops = [a for a, _ in xs], [b for _, b in xs]
        rows.append(f"| {name} | {len(xs)} | {statistics.median(starts):.1f} "
                    f"({min(starts):.1f}-{max(starts):.1f}) | {statistics.median(stops):.1f} "
                    f"({min(stops):.1f}-{max(stops):.1f}) |")  # fmt: skip
    lines = [
        f"Measured on {cpu_name()} ({os.cpu_count()} CPUs; {cpu_isa()}), `diptych serve` "
        "on its defaults (the default model, 1 prefill + 1 decode worker, the embedded "
        "control plane) from this tree and a baseline checkout, alternated, each after "
        "one warm-up start (C++ build and tokenizer cache warm).",
        "",
        "```",
        cmd.strip(),
        "```",
        "",
        "| tree | starts | ready s, median (range) | stop s, median (range) |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "| in one process, this tree | s |",
        "|---|---:|",
        *[f"| {k} | {v:.2f} |" for k, v in local.items()],
        "",
        "A start is the workers' model loads (the GGUF's metadata now read by "
        "`engine/weights/gguf_file.py`, not `gguf.GGUFReader`, and no `torch._dynamo` import "
        "at model build) with the frontend starting beside them, not after; a stop, each "
        "role's own stop and then its process's exit, which skips the interpreter's "
        "teardown of torch. A planner's scale-up and every restart pay the start.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="another checkout to compare with")
    ap.add_argument("--baseline-name", default="baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    trees = {"this tree": ROOT}
    if args.baseline:
        trees[args.baseline_name] = Path(args.baseline).resolve()
    for tree in trees.values():
        serve_once(tree)  # warm-up
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            timings[name].append(serve_once(tree))
            print(name, timings[name][-1], flush=True)
    text = render(timings, in_process())
    print(text)
    if args.write_docs:
        from benchmarks.docs_section import write_subsection

        write_subsection(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

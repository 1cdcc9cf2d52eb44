"""A 30 MB prompt at the edge: how fast the frontend refuses it, and what /health does
meanwhile.

    python benchmarks/edge_abuse.py [--baseline /path/to/worktree-before] [--repeat 5] \\
        [--write-docs]

`diptych serve` (the default model, its defaults) from this tree, and from ``--baseline``
if given (a checkout from before prompts were bounded by characters: there each request
is tokenized in full, so it runs once per endpoint). A client posts a 30 MB prompt
("word " six million times, under the 32 MiB body limit) to /v1/completions,
/v1/chat/completions and /tokenize, ``--repeat`` times each, the JSON body encoded before
the clock starts and sent with one sendall (what is timed is the server's reading and
answering, not a client's encoding and framing), while another process polls /health
every 10 ms. Reported: the time to each 400, and
/health's p50, p99 and worst over the whole run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.control_plane_security import serve  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402

HEADING = "### A 30 MB prompt at the edge"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize")


def _bodies(model: str) -> dict[str, bytes]:
    huge = "word " * 6_000_000
    bodies = {
        "/v1/completions": {"model": model, "prompt": huge, "max_tokens": 4},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": huge}]},
        "/tokenize": {"prompt": huge},
    }
    return {path: json.dumps(b).encode() for path, b in bodies.items()}


def _poll_health(url: str, stop: Any, out: Any) -> None:
    """/health every 10 ms until ``stop`` is set; the latencies (s) go to ``out``. A
    process of its own, so the poller shares no interpreter lock with the big client."""
    got = []
    with httpx.Client(timeout=300) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health")
            got.append(time.perf_counter() - t0)
            time.sleep(0.01)
    out.put(got)


def _post(url: str, path: str, body: bytes) -> tuple[int, float]:
    """(status, seconds) of one POST, sent from a prepared buffer with one sendall: what is
    timed is the server's reading and answering, not a client's framing of 30 MB."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, port), timeout=600) as sock:
        t0 = time.perf_counter()
        sock.sendall(head + body)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        took = time.perf_counter() - t0
    return int(answer.split(b" ", 2)[1]), took


def measure(tree: Path, repeat: int) -> dict[str, object]:
    with serve(tree) as (url, _state):
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bodies = _bodies(model)
        ctx = multiprocessing.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        poller = ctx.Process(target=_poll_health, args=(url, stop, out))
        poller.start()
        time.sleep(2.0)  # the poller is polling before the first big request
        took: dict[str, list[float]] = {p: [] for p in ENDPOINTS}
        answers: dict[str, set[int]] = {p: set() for p in ENDPOINTS}
        try:
            for _ in range(repeat):
                for path in ENDPOINTS:
                    status, seconds = _post(url, path, bodies[path])
                    took[path].append(seconds)
                    answers[path].add(status)  # a tree before the bound: 200s
        finally:
            stop.set()
            health: list[float] = sorted(out.get(timeout=600))
            poller.join()
    return {
        "took": took,
        "answers": answers,
        "health": (
            statistics.median(health),
            health[min(len(health) - 1, int(0.99 * len(health)))],
            health[-1],
            len(health),
        ),
    }


def render(results: dict[str, dict[str, object]], repeat: dict[str, int]) -> str:
    cmd = "python benchmarks/edge_abuse.py " + " ".join(sys.argv[1:])
    rows = []
    for name, got in results.items():
        took: dict[str, list[float]] = got["took"]  # type: ignore[assignment]
        answers: dict[str, set[int]] = got["answers"]  # type: ignore[assignment]
        p50, p99, worst, n = got["health"]  # type: ignore[misc]
        cells = []
        for path in ENDPOINTS:
            xs = took[path]
            codes = "/".join(map(str, sorted(answers[path])))
            cells.append(f"{statistics.median(xs) * 1e3:.0f} ({max(xs) * 1e3:.0f}), {codes}")
        rows.append(
            f"| {name} | {repeat[name]} | " + " | ".join(cells)
            + f" | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} / {worst * 1e3:.0f} ({n}) |"
        )  # fmt: skip
    lines = [
        f"Measured on {cpu_name()} ({os.cpu_count()} CPUs; {cpu_isa()}), `diptych serve` "
        "with the default model and defaults (max_model_len 8192), a 30 MB prompt "
        '("word " × 6,000,000) posted with its JSON body encoded before the clock starts '
        "and sent with one sendall, /health polled every 10 ms by another process.",
        "",
        "```",
        cmd.strip(),
        "```",
        "",
        "| tree | per endpoint | completions ms p50 (worst), status | chat ms p50 (worst), "
        "status | /tokenize ms p50 (worst), status | /health ms p50 / p99 / worst (polls) |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "This tree refuses each body from the raw length of its prompt's (or messages') "
        "string literals before validating it (`frontend/body_scan.py`, "
        "`frontend/protocol.py::refuse_oversized_body`); a baseline from before the "
        "character bound (94da688^, in a git worktree, run in the same invocation) "
        "tokenizes all 30 MB first, and its /tokenize answers the six million tokens. "
        "The worst /health poll is the one in flight while the server reads a body.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a checkout from before the character bound")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    results = {"this tree": measure(ROOT, args.repeat)}
    repeat = {"this tree": args.repeat}
    if args.baseline:
        results["baseline"] = measure(Path(args.baseline).resolve(), 1)
        repeat["baseline"] = 1
    text = render(results, repeat)
    print(text)
    if args.write_docs:
        from benchmarks.docs_section import write_subsection

        write_subsection(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

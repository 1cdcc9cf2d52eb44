"""What closing the control plane costs: signed queue messages, write grants, call tokens
and answer proofs.

    python benchmarks/control_plane_security.py --baseline /path/to/worktree-before \\
        [--rounds 2] [--concurrency 8] [--prompt-len 256] [--gen-len 32] [--write-docs]

Two parts, in one run:

* **Per request, exactly**: the time of each check a remote prefill now makes on its
  critical path (seal and open a queue message of the prompt's size with the replay
  guard, issue and check a write grant over its blocks, make and check a gRPC call
  token, make and check the worker's answer proof), best of many repetitions.
* **End to end**: `diptych serve` (1 prefill + 1 decode worker, shm, the default model
  in bf16, a deployment secret set) from this tree and from ``--baseline`` (a checkout
  of the commit before, where none of it existed, or ``no-secret``: this tree without
  the secret), in rounds A B, B A, A B..., each serving
  ``--concurrency`` clients that stream completions of distinct random prompts (every
  one prefilled remotely) back to back. TTFT and TPOT p50 per tree, over all rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402

SECRET = "benchmark-deployment-secret"


def _best_us(fn: Callable[[], object], n: int = 2000) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def micro(prompt_len: int, block_size: int = 16) -> dict[str, float]:
    import numpy as np

    from protocol.sampling import SamplingParams
    from runtime.queue.messages import RemotePrefillRequest
    from runtime.queue.signing import Kind, ReplayGuard, open_sealed, seal
    from runtime.rpc.auth import TokenCheck, answer_proof, call_token
    from transfer.context import GrantTable

    key = b"k" * 32
    blocks = -(-prompt_len // block_size)
    req = RemotePrefillRequest(
        request_id="r", prompt_token_ids=tuple(range(prompt_len)),
        sampling=SamplingParams(), decode_worker_id="d", decode_incarnation_id="i",
        transfer_agent="a", dst_block_ids=tuple(range(blocks)), num_cached_tokens=0,
        deadline=time.time() + 60, kv_layout_hash="h",
    ).encode()  # fmt: skip
    guard = ReplayGuard()
    position = iter(range(10**9))

    def queue_message() -> None:
        opened = open_sealed(key, Kind.REQUEST, seal(key, Kind.REQUEST, req))
        guard.check(opened, next(position), time.time() + 60, time.time())

    table = GrantTable()
    rows = np.array([(0, b * 4096, 4096) for b in range(blocks)], dtype=np.int64)

    def grant() -> None:
        gid = table.issue(rows, 60.0)
        assert table.check(gid, ("p", "i"), rows) is None
        table.revoke(gid)

    check = TokenCheck(key)

    def token() -> None:
        assert check.accepts("/m", call_token(key, "/m"))

    def proof() -> None:  # the worker makes it, the client checks it
        made = answer_proof(key, "/m", "decode-0", "n" * 32)
        assert hmac.compare_digest(made, answer_proof(key, "/m", "decode-0", "n" * 32))

    return {
        "queue message (seal, open, replay guard)": _best_us(queue_message),
        f"write grant over {blocks} blocks (issue, check, revoke)": _best_us(grant),
        "gRPC call token (make, check)": _best_us(token),
        "gRPC answer proof (make, check)": _best_us(proof),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(tree: Path, secret: bool = True) -> Iterator[tuple[str, Path]]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
        env.pop("DIPTYCH_CLUSTER_SECRET", None)
        if secret:
            env["DIPTYCH_CLUSTER_SECRET"] = SECRET
        proc = subprocess.Popen(
            [sys.executable, "-m", "diptych.cli", "serve", "--port", str(port),
             "--state-dir", state, "--min-remote-prefill-tokens", "16"],
            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        ready = threading.Event()
        log: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.append(line)
                if line.startswith("Diptych is serving"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            if not ready.wait(300):
                raise RuntimeError("serve did not start:\n" + "".join(log[-30:]))
            yield f"http://127.0.0.1:{port}", Path(state)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def stream(url: str, model: str, prompt: list[int], gen: int) -> tuple[float, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    n += 1
                    first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - t0, (end - first) / max(n - 1, 1)


def round_of(
    tree: Path, args: argparse.Namespace, seed: int, secret: bool = True
) -> tuple[list[tuple[float, float]], float]:
    """(TTFT, TPOT) of each request, and the share of them prefilled remotely."""
    rng = random.Random(seed)
    with serve(tree, secret) as (url, state):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def prompt() -> list[int]:
            return [rng.randrange(100, 49000) for _ in range(args.prompt_len)]

        stream(url, model, prompt(), 4)  # warm
        prompts = [[prompt() for _ in range(args.per_client)] for _ in range(args.concurrency)]
        out: list[tuple[float, float]] = []
        lock = threading.Lock()

        def client(mine: list[list[int]]) -> None:
            for p in mine:
                got = stream(url, model, p, args.gen_len)
                with lock:
                    out.append(got)

        threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        from benchmarks.servers import scrape

        address = json.loads((state / "serve.json").read_text())["decode-0"]["metrics"]
        m = scrape(f"http://{address}")
        remote = m.get('diptych_worker_requests_total{prefill="remote"}', 0.0)
        local = m.get('diptych_worker_requests_total{prefill="local"}', 0.0)
    return out, remote / max(remote + local, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--baseline", required=True,
        help="a checkout of the commit before, or no-secret: this tree without a deployment "
        "secret (no signing, grants, tokens or proofs: the checks alone, on the same code)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    costs = micro(args.prompt_len)
    no_secret = args.baseline == "no-secret"
    base = ROOT if no_secret else Path(args.baseline).resolve()
    trees = {"this tree": ROOT, "baseline": base}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
    remote: dict[str, list[float]] = {k: [] for k in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:  # each tree goes first in every other round
            got, share = round_of(tree, args, r, secret=not (no_secret and name == "baseline"))
            samples[name] += got
            remote[name].append(share)
            print(f"round {r + 1}: {name} done", flush=True)
    text = render(costs, samples, remote, args)
    print(text)
    if args.write_docs:
        from benchmarks.docs_section import write_subsection

        write_subsection(HEADING, text)
    return 0


HEADING = "### What closing the control plane costs"


def render(
    costs: dict[str, float],
    samples: dict[str, list[tuple[float, float]]],
    remote: dict[str, list[float]],
    ns: argparse.Namespace,
) -> str:
    med = statistics.median
    base = samples["baseline"]
    rows = []
    for name, got in samples.items():
        ttft, tpot = med(x for x, _ in got) * 1e3, med(y for _, y in got) * 1e3
        b_ttft, b_tpot = med(x for x, _ in base) * 1e3, med(y for _, y in base) * 1e3
        share = min(remote[name])
        rows.append(f"| {name} | {len(got)} | {share:.0%} | {ttft:.0f} ({ttft / b_ttft - 1:+.1%}) "
                    f"| {tpot:.1f} ({tpot / b_tpot - 1:+.1%}) |")  # fmt: skip
    cmd = "python benchmarks/control_plane_security.py " + " ".join(sys.argv[1:])
    against = (
        "this tree without a deployment secret (every check off, the same code)"
        if ns.baseline == "no-secret"
        else f"the tree at {ns.baseline}"
    )
    lines = [
        f"Measured on {cpu_name()} ({os.cpu_count()} CPUs; {cpu_isa()}), `diptych serve` "
        f"with a deployment secret against {against}, 1 prefill + 1 decode worker over "
        f"shm, the default model in bf16, {ns.concurrency} clients streaming completions "
        f"of distinct {ns.prompt_len}-token prompts ({ns.gen_len} tokens each), "
        f"{ns.rounds} alternated rounds per tree (the share prefilled remotely is the "
        "decode worker's count, the lowest of the rounds, warm-up included).",
        "",
        "```",
        cmd.strip(),
        "```",
        "",
        "| per request, on the critical path | µs |",
        "|---|---:|",
        *(f"| {k} | {v:.1f} |" for k, v in costs.items()),
        "",
        "| tree | requests | prefilled remotely | TTFT p50 ms (vs baseline) "
        "| TPOT p50 ms (vs baseline) |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Run `diptych serve <flags>`, send greedy completions, print the texts as JSON.

    python -m tests.e2e.scenario [--netns PATH] [--etcd URL --nats URL] -- <serve flags>

With --netns the whole process tree runs in that network namespace (NIXL and UCX
listen on every interface; tests keep them off real networks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

PROMPTS = [
    "The capital of France is",
    "Write a short note about rivers. Rivers carry water from mountains to the sea, shape "
    "valleys, feed farms and cities, and have guided trade routes for thousands of years. "
    "Rivers also",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\n# Now a function that returns the first n prime numbers:\ndef",
    "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, "
    "fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty,",
]


def run(flags: list[str], max_tokens: int = 16) -> dict[str, object]:
    from tests.e2e.serving import Server

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), *flags)
        try:
            model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            texts = []
            for p in PROMPTS:
                r = httpx.post(
                    server.url + "/v1/completions",
                    json={"model": model, "prompt": p, "max_tokens": max_tokens,
                          "temperature": 0, "ignore_eos": True},
                    timeout=120,
                )  # fmt: skip
                r.raise_for_status()
                texts.append(r.json()["choices"][0]["text"])
            metrics = server.metrics("decode-0")
        finally:
            code = server.stop()
    remote = metrics.get('diptych_worker_requests_total{prefill="remote"}', 0.0)
    return {"texts": texts, "remote": remote, "exit": code}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--netns", default=None)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.netns:
        from transfer.testing import bring_loopback_up, enter_netns

        enter_netns(args.netns)
        bring_loopback_up()
    flags = [f for f in args.flags if f != "--"]
    print(json.dumps(run(flags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

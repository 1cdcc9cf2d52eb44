"""KV blocks of ``n=4`` against four separate requests, read from the decode worker's pool.

A real ``diptych serve`` (aggregated, fp32); the decode worker's
``diptych_worker_kv_used_blocks`` (blocks held by requests) is sampled every few
milliseconds while each pattern runs, and read before and after:

* one request with ``n=4``;
* four separate requests for the same prompt, sent together (four client threads).

Each pattern gets its own prompt, so neither finds the other's blocks cached. Each runs
twice: on an idle server, and beside a background load (two long streams decoding), as
a busy server sees it. On an idle server four separate requests mostly share too: the
first one's prefill step runs alone and the other three arrive during it and find its
blocks cached. On a busy one they arrive during a decode step and are admitted together
in the next, so each computes and holds the whole prompt; ``n=4`` sends the other three
choices only after the first choice's prompt is cached, whatever the load. With a
background load the table counts the pattern's blocks as the peak minus the background's
blocks at the pattern's end (an upper bound of the background during it).

    python benchmarks/n_choices.py [--prompt-tokens 480] [--max-tokens 64] [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.docs_section import write_subsection
from benchmarks.machine import cpu_isa, cpu_name
from benchmarks.servers import ServerProcess, diptych_server, scrape


class Peak:
    """The highest value of the decode worker's held-block gauge while running."""

    def __init__(self, metrics_url: str) -> None:
        self.url = metrics_url
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> float:
        return scrape(self.url)["diptych_worker_kv_used_blocks"]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _prompt(tag: str, tokens: int) -> str:
    words = " ".join(f"{tag}{i}" for i in range(tokens // 3))
    return f"Pattern {tag}. {words}. Continue:"


def _complete(url: str, model: str, prompt: str, n: int, seed: int, max_tokens: int) -> None:
    body = {
        "model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens,
        "temperature": 1.0, "seed": seed, "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()


class Background:
    """Long streams that keep the engine decoding while a pattern runs."""

    def __init__(self, url: str, model: str, count: int) -> None:
        self.stop = threading.Event()
        body = {
            "model": model, "prompt": "Tell a long story.", "max_tokens": 4000,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip

        def run() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for _ in r.iter_lines():
                    if self.stop.is_set():
                        return

        self.threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        time.sleep(2.0)  # decoding by now
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def measure(server: ServerProcess, prompt_tokens: int, max_tokens: int) -> list[str]:
    manifest = server.manifest()
    metrics = "http://" + manifest["decode-0"]["metrics"]
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    _complete(server.url, model, "warm up", 1, 0, 4)
    rows = []
    patterns = ("n=4, one request", "four separate requests, sent together")
    for load in (0, 2):
        for name in patterns:
            tag = f"{'ab'[patterns.index(name)]}{load}"
            with Background(server.url, model, load):
                rows.append(_pattern(server.url, model, metrics, name, tag, load,
                                     prompt_tokens, max_tokens))  # fmt: skip
            time.sleep(0.5)
    return rows


def _pattern(
    url: str, model: str, metrics: str, name: str, tag: str, load: int,
    prompt_tokens: int, max_tokens: int,
) -> str:  # fmt: skip
    peak = Peak(metrics)
    before = peak.used()
    prompt = _prompt(tag, prompt_tokens)
    with peak:
        if name.startswith("n=4"):
            _complete(url, model, prompt, 4, 1, max_tokens)
        else:
            threads = [
                threading.Thread(target=_complete, args=(url, model, prompt, 1, s, max_tokens))
                for s in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    time.sleep(0.2)
    after = peak.used()  # the background's blocks now (0 without one)
    held = peak.peak - after
    where = "idle" if not load else f"{load} streams decoding"
    count = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["count"]
    return f"| {name} | {where} | {count} | {held:.0f} | {before:.0f} | {after:.0f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    with diptych_server("aggregated", "--dtype", "float32") as server:
        rows = measure(server, args.prompt_tokens, args.max_tokens)
    body = "\n".join(
        [
            "`python benchmarks/n_choices.py --write-docs` (`diptych serve`, aggregated, fp32, "
            f"block size 16, {args.max_tokens} output tokens per choice; CPU: {cpu_name()}, "
            f"{cpu_isa()}). Blocks held by the pattern's requests on the decode worker: the "
            "peak sampled every 5 ms (less the background load's blocks), and the worker's "
            "count before and after (with a background load: its blocks).",
            "",
            "| pattern | server | prompt tokens | peak blocks held | before | after |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "n=4 holds the prompt once: choice 0 computes it, then choices 1-3 go to the same "
            "worker and find its full blocks cached (shared, reference counted), computing "
            "only the last partial block. Four separate requests share as much only when the "
            "first one's prefill step runs alone (an idle server); on a busy one they are "
            "admitted in the same step and each holds the whole prompt. Every block comes "
            "back after (the worker's count returns to its baseline).",
        ]
    )
    print(body)
    if args.write_docs:
        write_subsection("### n > 1: shared prompt blocks", body, section="## OpenAI API")


if __name__ == "__main__":
    main()

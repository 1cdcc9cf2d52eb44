"""A `diptych bench` workload as the simulator needs it: token ids and send times.

The bench's workload generators are used as they are, with a prompt builder whose
"text" is the token ids themselves (one character per id), so a prompt of n tokens
costs n random draws and no tokenizer, and shared prefixes (random-prefix, multi-turn
histories) stay shared token for token.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.arrivals import arrival_times
from bench.request import Request, chains
from bench.workloads import WorkloadSpec, build_workload

_BASE = 0x100  # ids are characters from here, skipping the surrogates
_SURROGATES = (0xD800, 0xE000)


def _char(i: int) -> str:
    c = _BASE + i
    return chr(c + 0x800 if c >= _SURROGATES[0] else c)


class IdPromptBuilder:
    """The `PromptBuilder` interface over a vocabulary of `vocab_size` ids."""

    def __init__(self, vocab_size: int, reserved: int = 64) -> None:
        self.name = "token-ids"
        self.alphabet = [_char(i) for i in range(reserved, vocab_size)]

    def text(self, n: int, rng: random.Random) -> str:
        return "".join(rng.choices(self.alphabet, k=n)) if n > 0 else ""

    def concat(self, *texts: str) -> str:
        return "".join(texts)

    def count(self, text: str) -> int:
        return len(text)

    def render_chat(self, messages: Sequence[Mapping[str, object]]) -> str:
        return "".join(str(m.get("content", "")) for m in messages)


def token_ids(prompt: str) -> list[int]:
    codes = np.frombuffer(prompt.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    codes -= np.where(codes >= _SURROGATES[1], 0x800, 0)
    ids: list[int] = (codes - _BASE).tolist()
    return ids


@dataclass
class Workload:
    requests: list[Request]
    send_at: list[float | None]  # a chain's first request: when; later turns: None
    next_turn: dict[int, int]  # request index -> the index of its session's next turn


def build(
    spec: WorkloadSpec, vocab_size: int, rate: float, burstiness: float, seed: int
) -> Workload:
    """The requests of `spec` and their send times at `rate` (as `diptych bench`)."""
    reqs = build_workload(spec, IdPromptBuilder(vocab_size))  # type: ignore[arg-type]
    groups = chains(reqs)
    times = arrival_times(len(groups), rate, burstiness, seed)
    send_at: list[float | None] = [None] * len(reqs)
    next_turn: dict[int, int] = {}
    for chain, t in zip(groups, times, strict=True):
        send_at[chain[0]] = 0.0 if math.isinf(rate) else t
        for a, b in itertools.pairwise(chain):
            next_turn[a] = b
    return Workload(reqs, send_at, next_turn)


def from_trace(path: str | Path, vocab_size: int, block_tokens: int = 512) -> Workload:
    """A request trace in the Mooncake format, one JSON object per line:

        {"timestamp": 27482, "input_length": 6955, "output_length": 52,
         "hash_ids": [46, 47, 48, ...]}

    `timestamp` is the send time in milliseconds; each id of `hash_ids` stands for one
    `block_tokens`-token block of the prompt, the same tokens wherever the id appears,
    so requests that share ids share a cached prefix (the prompt is cut to
    `input_length`). Without `hash_ids` every prompt is fresh. ValueError says which
    line is wrong."""
    reqs: list[Request] = []
    send_at: list[float | None] = []
    blocks: dict[int, str] = {}
    builder = IdPromptBuilder(vocab_size)
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t = float(row["timestamp"]) / 1000.0
            n_in, n_out = int(row["input_length"]), int(row["output_length"])
            ids = [int(h) for h in row.get("hash_ids", [])]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a trace record ({e})") from None
        if n_in < 1 or n_out < 1 or t < 0:
            raise ValueError(f"{path}:{lineno}: lengths must be >= 1 and timestamp >= 0")
        for h in ids:
            if h not in blocks:
                blocks[h] = builder.text(block_tokens, random.Random(h))
        prompt = "".join(blocks[h] for h in ids)[:n_in]
        if len(prompt) < n_in:
            prompt += builder.text(n_in - len(prompt), random.Random(f"{lineno}"))
        reqs.append(Request(prompt, n_in, n_out, tag="trace"))
        send_at.append(t)
    if not reqs:
        raise ValueError(f"{path} holds no trace records")
    return Workload(reqs, send_at, {})

"""A `diptych bench` workload as the simulator needs it: token ids and send times.

The bench's workload generators are used as they are, with a prompt builder whose
"text" is the token ids themselves (one character per id), so a prompt of n tokens
costs n random draws and no tokenizer, and shared prefixes (random-prefix, multi-turn
histories) stay shared token for token.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
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

"""The simulated model's text: a deterministic function of the prompt and the position.

The same prompt yields the same tokens on every worker and in every mode (a prefill
worker's first token and a decode worker's continuation agree; aggregated and
disaggregated serving agree), so stop conditions, `max_tokens` and parity checks keep
their meaning. A prompt's key hashes its length and its first and last 64 tokens (O(1)
per request and step, whatever the prompt length); the request's seed, when set, joins
the key, so seeded sampling differs per seed as it would on a real model.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Sequence

_EDGE = 64
_MASK = (1 << 64) - 1


def prompt_key(prompt: Sequence[int], seed: int | None = None) -> int:
    edges = list(prompt[:_EDGE]) + list(prompt[-_EDGE:])
    data = struct.pack(f"<q{len(edges)}q", len(prompt), *edges)
    key = zlib.crc32(data) | (zlib.adler32(data) << 32)
    return key if seed is None else mix(key ^ (seed & _MASK))


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=8192)  # asked once per token of a request
def natural_length(key: int, mean_output_tokens: int) -> int | None:
    """How many tokens the simulated model writes before it would stop, its EOS last:
    geometric with this mean (at least 1), drawn from the key; None when 0 (never)."""
    if mean_output_tokens <= 0:
        return None
    if mean_output_tokens == 1:
        return 1
    u = (mix(key ^ 0x5EED) + 1) / 2.0**64  # in (0, 1]
    return 1 + int(math.log(u) / math.log1p(-1.0 / mean_output_tokens))


def token_at(
    key: int, position: int, output_index: int, vocab_size: int, eos: Sequence[int],
    mean_output_tokens: int,
) -> int:  # fmt: skip
    """The token at `position` of the sequence, the reply's `output_index`-th: the EOS
    at the natural length (when there are EOS ids), else an ordinary token."""
    length = natural_length(key, mean_output_tokens)
    if eos and length is not None and output_index == length - 1:
        return eos[0]
    token = mix(key ^ (position * 0xD6E8FEB86659FD93 & _MASK)) % vocab_size
    while token in eos:
        token = (token + 1) % vocab_size
    return token

"""Synthetic workloads: fixed or ranged lengths, a ShareGPT-like mix, and a bursty mix.

- `random` is vLLM's random dataset: an optional prefix shared by every prompt, then
  input and output lengths drawn uniformly from [len * (1 - r), len * (1 + r)].
- `sharegpt_like` draws lengths from lognormal distributions with the means reported
  for ShareGPT in the vLLM paper (Kwon et al., 2023: 161 input and 338 output tokens,
  heavy-tailed), filtered as vLLM filters the real dataset: both lengths >= 4, the
  prompt <= 1024 and prompt + output <= 2048 tokens. It is a length mix, not the
  dataset's text; pass the real file with --dataset-path for that.
- `bursty` interleaves steady short chats with a long prompt every k-th request.
  Under load each long prefill competes with the short chats' decode steps on an
  aggregated server (their TPOT tail grows), which disaggregation moves elsewhere.
"""

from __future__ import annotations

import math
import random

from bench.request import Request
from bench.workloads.spec import WorkloadSpec
from bench.workloads.tokens import PromptBuilder

# Lognormal lengths, mean = exp(mu + sigma^2 / 2) before the filter; these means are
# set so that the filtered mix averages 161 input and 338 output tokens (medians 106
# and 240).
SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA = 178.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 365.0, 0.9
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN = 1024, 2048, 4


def _ranged(rng: random.Random, length: int, ratio: float) -> int:
    lo = max(1, math.floor(length * (1 - ratio)))
    hi = max(lo, math.ceil(length * (1 + ratio))) if ratio > 0 else lo
    return rng.randint(lo, hi)


def random_lengths(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    rng = random.Random(spec.seed)
    prefix = builder.text(spec.prefix_len, rng)
    out = []
    for _ in range(spec.num_prompts):
        n_in = _ranged(rng, spec.input_len, spec.range_ratio)
        n_out = _ranged(rng, spec.output_len, spec.range_ratio)
        text = builder.concat(prefix, builder.text(n_in, rng))
        out.append(Request(text, spec.prefix_len + n_in, n_out, tag="random"))
    return out


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


def sharegpt_lengths(rng: random.Random) -> tuple[int, int]:
    """One (input, output) length pair from the ShareGPT-like mix, after vLLM's filter."""
    while True:
        n_in = _lognormal_int(rng, SHAREGPT_INPUT_MEAN, SHAREGPT_INPUT_SIGMA)
        n_out = _lognormal_int(rng, SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA)
        if min(n_in, n_out) < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        return n_in, n_out


def sharegpt_like(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num_prompts):
        n_in, n_out = sharegpt_lengths(rng)
        n_out = spec.sharegpt_output_len or n_out
        out.append(Request(builder.text(n_in, rng), n_in, n_out, tag="sharegpt"))
    return out


def bursty(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.num_prompts):
        if (i + 1) % spec.long_every == 0:
            n_in, n_out, tag = spec.long_input_len, spec.long_output_len, "long"
        elif spec.short_sharegpt:
            n_in, n_out = sharegpt_lengths(rng)
            tag = "short"
        else:
            n_in, n_out, tag = spec.short_input_len, spec.short_output_len, "short"
        out.append(Request(builder.text(n_in, rng), n_in, n_out, tag=tag))
    return out


def reasoning(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    """Low- and high-effort requests to a reasoning model: a thinking budget each, the
    answer after it (the output: the budget plus the answer)."""
    rng = random.Random(spec.seed)
    out = []
    for i in range(spec.num_prompts):
        high = (i + 1) % spec.high_every == 0
        budget = spec.high_thinking if high else spec.low_thinking
        n_in = spec.reasoning_input_len
        out.append(Request(builder.text(n_in, rng), n_in, budget + spec.answer_len,
                           tag="high" if high else "low", thinking=budget))  # fmt: skip
    return out

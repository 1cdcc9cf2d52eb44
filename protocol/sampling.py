"""Sampling parameters: how to pick each next token and when to stop, declared once.

Each field's type, default, range and help are here and nowhere else. The HTTP edge
takes the fields marked ``api=True`` under the same names and ranges
(`frontend/protocol.py` builds them from this declaration), the control plane carries
the whole object by its field names (`protocol.declare`), and the engine reads it as is.
A value out of range raises :class:`InvalidInput` naming the field, wherever the object
is built: at the edge, when a worker decodes it, or in the offline `LLM` API.

``temperature == 0`` (or ``top_k == 1``, or ``top_p == 0``) is greedy. ``top_k`` of 0
or -1, ``top_p == 1`` and ``min_p == 0`` disable those filters. ``max_tokens=None``
generates until a stop condition or the context window. ``logprobs=n`` returns the
sampled token's logprob and the n most likely tokens (n may be 0). ``seed`` makes
sampling reproducible per request, whatever else is in the batch. Penalties follow
OpenAI (presence and frequency, over generated tokens) and HF (repetition, over
prompt and generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from protocol.declare import check_fields, spec
from protocol.errors import InvalidInput

MAX_INT32 = 2**31 - 1
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI
MAX_SPECULATIVE_TOKENS = 16  # drafted tokens a step
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_GRAMMAR_CHARS = 1 << 20
MAX_MARKER_IDS = 16  # token ids of a thinking marker
# a thinking budget from which a request is long (the engine's long lane, the
# frontend's per-key cap): about the most thinking a short answer waits behind
LONG_THINKING_TOKENS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = spec(
        16, lo=1, hi=MAX_INT32, help="tokens to generate at most (None: until the context is full)"
    )
    min_tokens: int = spec(
        0, lo=0, hi=MAX_INT32, api=True, help="tokens generated before EOS or a stop may end it"
    )
    temperature: float = spec(1.0, lo=0.0, hi=2.0, api=True, help="0: greedy")
    top_p: float = spec(1.0, lo=0.0, hi=1.0, api=True, help="nucleus sampling's mass (0: greedy)")
    top_k: int = spec(0, lo=-1, hi=MAX_INT32, api=True, help="the k most likely (0 or -1: all)")
    min_p: float = spec(0.0, lo=0.0, hi=1.0, api=True, help="drop tokens under min_p x the top's p")
    typical_p: float = spec(
        1.0, lo=0.0, lo_open=True, hi=1.0, api=True,
        help="locally typical sampling: the tokens whose surprise is nearest the entropy, "
        "up to this mass (1: off)",
    )  # fmt: skip
    seed: int | None = spec(
        None, lo=-(2**63), hi=2**64 - 1, api=True, help="reproducible sampling, per request"
    )
    presence_penalty: float = spec(
        0.0, lo=-2.0, hi=2.0, api=True, help="subtracted from the logit of every token generated"
    )
    frequency_penalty: float = spec(
        0.0, lo=-2.0, hi=2.0, api=True, help="subtracted per time a token was generated"
    )
    repetition_penalty: float = spec(
        1.0, lo=0.0, lo_open=True, hi=10.0, api=True,
        help="divides the positive logits (multiplies the negative) of prompt and output tokens",
    )  # fmt: skip
    stop: tuple[str, ...] = spec(
        (), max_items=MAX_STOP_STRINGS, max_chars=MAX_STOP_CHARS, help="stop strings"
    )
    stop_token_ids: tuple[int, ...] = spec(
        (), lo=0, hi=MAX_INT32, max_items=MAX_STOP_TOKEN_IDS, api=True
    )
    include_stop_str_in_output: bool = spec(False, api=True)
    ignore_eos: bool = spec(False, api=True)
    skip_special_tokens: bool = spec(True, api=True)
    logprobs: int | None = spec(
        None, lo=0, hi=MAX_LOGPROBS, help="the sampled token's logprob and this many others"
    )
    logit_bias: dict[int, float] = spec(
        {}, lo=-100.0, hi=100.0, max_items=MAX_LOGIT_BIAS, help="token id -> added to its logit"
    )
    # Structured output: an llguidance grammar (engine/grammar.py) every token obeys.
    grammar: str | None = spec(None, max_chars=MAX_GRAMMAR_CHARS)
    # The last `output_replay` prompt tokens are earlier output (a migrated request):
    # the grammar and the reasoning count consume them before the first new token.
    output_replay: int = spec(0, lo=0, hi=MAX_INT32)
    # Reasoning models (engine/reasoning.py): the thinking markers' token ids, whether
    # the prompt opened a thinking block, and the thinking budget.
    max_reasoning_tokens: int | None = spec(
        None, lo=0, hi=MAX_INT32, api=True,
        help="thinking tokens at most: then the model's end-of-thinking marker is forced "
        "and the answer follows (reasoning models)",
    )  # fmt: skip
    reasoning_start: tuple[int, ...] = spec((), lo=0, hi=MAX_INT32, max_items=MAX_MARKER_IDS)
    reasoning_end: tuple[int, ...] = spec((), lo=0, hi=MAX_INT32, max_items=MAX_MARKER_IDS)
    reasoning_open: bool = spec(False)
    num_speculative_tokens: int | None = spec(
        None, lo=0, hi=MAX_SPECULATIVE_TOKENS, api=True,
        help="drafted tokens a step for a greedy request (None: the worker's default; 0: off)",
    )  # fmt: skip
    # The raw fp32 logits row of every generated token (offline evaluation and tests).
    output_logits: bool = spec(False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        check_fields(self)
        if any(not s for s in self.stop):
            raise InvalidInput("stop strings must not be empty")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInput(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.grammar is not None and not self.grammar:
            raise InvalidInput("grammar must not be empty")
        thinks = self.max_reasoning_tokens is not None or self.reasoning_open
        if thinks and not self.reasoning_end:
            raise InvalidInput(
                "max_reasoning_tokens is for reasoning models: this model has no "
                "end-of-thinking marker (serve it with --reasoning-parser)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1 or self.top_p == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def replace(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)

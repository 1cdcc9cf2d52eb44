"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bound on top-n logprobs per token (OpenAI allows 20).
MAX_LOGPROBS = 20
# Upper bound on the tokens speculative decoding drafts a step.
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. `max_tokens=None` generates until a stop condition or the context window.
    `logprobs=n` returns the sampled token's logprob and the n most likely tokens
    (n may be 0). `seed` makes sampling reproducible per request, whatever else is in
    the batch. Penalties follow the OpenAI (presence/frequency, over generated tokens)
    and HF (repetition, over prompt and generated tokens) definitions.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Return the raw fp32 logits row of every generated token (for evaluation/tests).
    output_logits: bool = False
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: an llguidance grammar (engine/grammar.py) every token obeys.
    grammar: str | None = None
    # The last `grammar_replay` prompt tokens are earlier output (a migrated request):
    # the grammar consumes them before the first new token.
    grammar_replay: int = 0
    # Speculative decoding (engine/spec/): draft up to this many tokens a step by prompt
    # lookup and verify them in one pass (greedy requests only; output unchanged).
    # None: the engine's default (`EngineConfig.num_speculative_tokens`); 0: off.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        self._check()

    def _check(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 or not _finite(b) for t, b in self.logit_bias.items()):
            raise bad("logit_bias maps non-negative token ids to finite numbers")
        if not _is_int(self.grammar_replay) or self.grammar_replay < 0:
            raise bad(f"grammar_replay must be an integer >= 0, got {self.grammar_replay!r}")
        if self.grammar_replay and self.grammar is None:
            raise bad("grammar_replay needs a grammar")
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise bad(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _finite(x: object) -> bool:
    return (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and x == x
        and abs(x) != float("inf")
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

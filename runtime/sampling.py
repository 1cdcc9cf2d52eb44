"""Sampling parameters, shared by the Generate RPC and the remote-prefill queue message."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.validation import check_token_ids

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300
MAX_GRAMMAR_BYTES = 1 << 20
MAX_SPECULATIVE = 16  # drafted tokens a step (engine.sampling_params.MAX_SPECULATIVE_TOKENS)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Defaults follow the OpenAI API and vLLM.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``min_p == 0`` disable those
    filters. ``max_tokens=None`` generates until the context is full. ``logprobs`` asks for
    the sampled token's logprob, ``top_logprobs`` for that many alternatives besides.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    # token id -> bias in [-100, 100], as (id, bias) pairs sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None  # structured output (engine/grammar.py)
    grammar_replay: int = 0  # trailing prompt tokens that are earlier output
    # speculative decoding's drafts a step (None: the worker's default; 0: off)
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "stop_token_ids",
            check_token_ids("stop_token_ids", self.stop_token_ids, allow_empty=True),
        )
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise :class:`InvalidInput` naming the first out-of-range field."""
        _finite_in("temperature", self.temperature, 0.0, 100.0)
        _finite_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_in("top_k", self.top_k, 0, 2**31 - 1)
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int_in("seed", self.seed, 0, 2**64 - 1)
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, 2**31 - 1)
        _int_in("min_tokens", self.min_tokens, 0, 2**31 - 1)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInput(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"
            )
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.logprobs, bool):
            raise InvalidInput("ignore_eos and logprobs must be booleans")
        _finite_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _finite_in("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _int_in("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidInput("top_logprobs > 0 requires logprobs=True")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidInput(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for token, bias in self.logit_bias:
            _int_in("logit_bias token id", token, 0, 2**32 - 1)
            _finite_in("logit_bias value", bias, -100.0, 100.0)
        if self.grammar is not None and not (
            isinstance(self.grammar, str) and 0 < len(self.grammar) <= MAX_GRAMMAR_BYTES
        ):
            raise InvalidInput(f"grammar must be a non-empty string of at most {MAX_GRAMMAR_BYTES}")
        _int_in("grammar_replay", self.grammar_replay, 0, 2**31 - 1)
        if self.grammar_replay and self.grammar is None:
            raise InvalidInput("grammar_replay needs a grammar")
        if self.num_speculative_tokens is not None:
            _int_in("num_speculative_tokens", self.num_speculative_tokens, 0, MAX_SPECULATIVE)

    def to_proto(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            logit_bias=dict(self.logit_bias),
            grammar=self.grammar,
            grammar_replay=self.grammar_replay,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    @classmethod
    def from_proto(cls, msg: pb.SamplingParams) -> SamplingParams:
        """Decode and validate; unset optional fields take the defaults above."""
        return cls(
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k,
            min_p=msg.min_p,
            seed=msg.seed if msg.HasField("seed") else None,
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
            min_tokens=msg.min_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=(
                msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
            ),
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            grammar=msg.grammar if msg.HasField("grammar") else None,
            grammar_replay=msg.grammar_replay,
            num_speculative_tokens=(
                msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None
            ),
        )


def _finite_in(
    name: str, value: object, low: float, high: float, *, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInput(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidInput(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidInput(f"{name} must be in [{low}, {high}], got {value}")

"""A request's state inside the engine, and what the engine reports about it.

The scheduler reasons in counters (see `Request`): `num_computed_tokens` is how many
tokens of `all_token_ids` have their KV in the cache, `num_tokens` how many tokens
exist. Prefill, chunked prefill, prefix hits, recompute after preemption and KV
arriving from a remote prefill worker are all the same arithmetic: close the gap.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.grammar import GrammarState
from engine.reasoning import ReasoningState
from protocol.logprobs import TokenLogprob
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # KV blocks are allocated and pinned; a remote prefill worker is writing them.
    # The scheduler never looks at such a request until the KV is declared ready.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


class DuplicateRequestError(ValueError):
    """A new request reuses the id of one the engine still tracks."""


@dataclass(frozen=True)
class NewRequest:
    """A request as its caller hands it to `EngineCore.submit`.

    `hold_blocks`: when the request finishes (not when aborted), its KV blocks stay
    allocated until `release_held(request_id)`: a prefill worker reads them after the
    request ends. `session_id`: the conversation the request is a turn of; with
    `EngineConfig.kv_session_ttl_s` its blocks stay on the device between turns (the
    scheduler's session holds).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    cache_salt: str | None = None
    hold_blocks: bool = False
    session_id: str | None = None
    lora: AdapterRef | None = None  # the LoRA adapter it runs (None: the base model)


@dataclass(frozen=True)
class RemoteRule:
    """When a prompt is prefilled remotely (conditional disaggregation), from what this
    engine's prefix cache holds of it:

        uncached >= min_uncached  and  (uncached >= max_local
                                        or uncached >= min_share x prompt)

    A worker that holds most of a prompt (a conversation's next turn, routed to the
    worker holding its history) prefills the rest itself: a remote prefill would make a
    prefill worker hold or recompute that prefix to produce a few blocks, and adds the
    round trip. Past `max_local` uncached tokens it goes remote whatever it holds, so a
    long prefill does not stall this worker's decode batch."""

    min_uncached: int
    min_share: float = 0.0
    max_local: int | None = None

    def remote(self, prompt_tokens: int, cached_tokens: int) -> bool:
        uncached = prompt_tokens - cached_tokens
        if uncached < self.min_uncached:
            return False
        if self.max_local is not None and uncached >= self.max_local:
            return True
        return uncached >= self.min_share * prompt_tokens


@dataclass(frozen=True)
class RemotePlan:
    """Blocks pinned for a remote prefill: the prompt's block table and its cached prefix
    (the remote side writes positions from `num_cached_tokens` on)."""

    block_ids: list[int]
    num_cached_tokens: int


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        hold_blocks: bool = False,
        session_id: str | None = None,
        lora: AdapterRef | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora
        self.lora_skips = 0  # steps it waited at the head of the queue for a LoRA slot
        self.lane_skips = 0  # short-lane requests admitted past it at the head of the queue
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.cache_salt = cache_salt
        self.hold_blocks = hold_blocks
        self.session_id = session_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Chained hashes of the full blocks of all_token_ids, filled by the KV manager.
        self.block_hashes: list[int] = []
        # Prompt tokens found in the prefix cache (or delivered remotely) at first schedule.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_is_request = False  # the request's own fault (its output constraint)
        self.logprobs: list[TokenLogprob] = []
        self.logits: list[torch.Tensor] = []
        self.stop_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else frozenset(eos_token_ids)
        )
        room = max_model_len - len(prompt_token_ids)
        cap = sampling_params.max_tokens
        self.max_tokens = room if cap is None else min(cap, room)
        # Structured output: set by the engine when the request has a grammar.
        self.grammar: GrammarState | None = None
        # Reasoning models: the thinking count and budget (engine/reasoning.py).
        self.reasoning: ReasoningState | None = None
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed % 2**64)  # negative: as unsigned

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def may_draft(self) -> bool:
        """Whether speculative drafts keep this request's output what it would be: its
        tokens are drawn from logits shaped only by temperature, top-k, top-p and min-p
        (no penalties, bias, grammar, logprobs or min_tokens, whose effect would differ
        per drafted position)."""
        p = self.sampling_params
        return (
            not p.needs_penalties
            and not p.logit_bias
            and p.logprobs is None
            and not p.output_logits
            and self.grammar is None
            and self.num_output_tokens >= p.min_tokens
            and (self.reasoning is None or self.reasoning.budget is None
                 or (self.reasoning.answering and not self.reasoning.owes_answer))
            # (a budget may force or ban the next token)
        )  # fmt: skip

    @property
    def thinking_left(self) -> int:
        """Thinking tokens its budget still allows (0 past the thinking or without one;
        a budget not yet begun counts whole)."""
        r = self.reasoning
        if r is None or r.budget is None or r.answering:
            return 0
        return max(r.budget - r.thought, 0)

    @property
    def constrained(self) -> bool:
        """Its grammar applies to the next token: it has one and is past any thinking."""
        return self.grammar is not None and (self.reasoning is None or self.reasoning.answering)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        answering = self.reasoning is None or self.reasoning.answering
        if self.reasoning is not None:
            self.reasoning.accept(token_id)
        if self.grammar is not None and answering:  # thinking is not the grammar's
            self.grammar.accept(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last appended token implies, if any."""
        n = self.num_output_tokens
        last = self.output_token_ids[-1]
        if self.constrained:
            assert self.grammar is not None
            if self.grammar.error is not None:
                self.error, self.error_is_request = self.grammar.error, True
                return RequestStatus.FINISHED_ERROR
            if self.grammar.stopped:  # complete: nothing more may follow
                self.stop_reason = last if last in self.stop_ids else None
                return RequestStatus.FINISHED_STOPPED
        if n >= self.sampling_params.min_tokens and last in self.stop_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if n >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __lt__(self, other: Request) -> bool:
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


@dataclass
class RequestOutput:
    """What one engine step reports for one request: the tokens new since last time."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    new_logits: list[torch.Tensor] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0  # of the output, thinking markers included
    error: str | None = None
    error_is_request: bool = False  # the request's fault (a 400), not the engine's

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the next one of the same request as one: tokens (and their
        logprobs and logits) concatenated, the state as of ``later``."""

        def joined(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
            return None if a is None and b is None else [*(a or ()), *(b or ())]

        return dataclasses.replace(
            later,
            new_token_ids=[*self.new_token_ids, *later.new_token_ids],
            new_logprobs=joined(self.new_logprobs, later.new_logprobs),
            new_logits=joined(self.new_logits, later.new_logits),
        )

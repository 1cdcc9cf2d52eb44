"""Structured output: a grammar per request, its token mask computed off the step's path.

The grammar engine is llguidance (chosen over xgrammar and outlines-core: see
docs/benchmarks.md "Structured output"). A request's grammar arrives as llguidance's
grammar text (the frontend turns JSON schemas, regexes, choices and Lark/GBNF
grammars into it) and becomes a :class:`GrammarState` holding a matcher.

Masks are computed off the critical path: when a token is accepted, the mask for the
next position is filled on a background thread (llguidance drops the GIL while it
computes), so it overlaps the scheduling and forward pass of the next step; the
sampler only waits for it, which costs nothing once the forward pass took longer.
Requests without a grammar never touch any of this.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

# One thread: masks are small (~100 us) and two cores are shared with the forward pass.
_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diptych-grammar")


class GrammarError(ValueError):
    """A grammar that does not compile, or tokens it does not accept."""


class GrammarCompiler:
    """Builds matchers for one tokenizer (building its llguidance view takes ~0.5 s,
    done once, on first use)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> None:
        self._hf = hf_tokenizer
        self._eos = eos_token_ids
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def validate(self, grammar: str) -> None:
        """Raise :class:`GrammarError` with llguidance's message for a bad grammar."""
        import llguidance

        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise GrammarError(message)

    def state(self, grammar: str, replay: Sequence[int] = ()) -> GrammarState:
        """A matcher for ``grammar`` that has consumed ``replay`` (earlier output of a
        migrated request); raises :class:`GrammarError`."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        if replay and not matcher.consume_tokens(list(replay)):
            raise GrammarError(
                f"the output so far does not match the grammar: {matcher.get_error()}"
            )
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """One request's matcher and the mask of its next position."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.num_words = (vocab_size + 31) // 32
        self._mask = torch.empty(self.num_words, dtype=torch.int32)
        self._pending: Future[None] | None = None
        self.error: str | None = None
        self._prefetch()

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (its EOS was taken)."""
        self._wait()  # the matcher is not to be read while its mask is being computed
        return self.error is None and bool(self._matcher.is_stopped())

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token and start the next mask; a token the grammar does
        not allow (only possible for tokens not sampled under this mask) sets ``error``."""
        self._wait()
        if self.error is not None or self._matcher.is_stopped():
            return
        if not self._matcher.consume_token(token_id):
            self.error = _failed(self._matcher.get_error())
            return
        self._prefetch()

    def mask(self) -> torch.Tensor:
        """The next position's allowed tokens, packed 32 per int32 (bit i of word w is
        token 32w + i)."""
        if self._pending is None:
            self._fill()
        self._wait()
        return self._mask

    def _prefetch(self) -> None:
        if not self._matcher.is_stopped():
            self._pending = _EXECUTOR.submit(self._fill)

    def _fill(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), self.num_words * 4)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as e:  # the grammar's failure is its request's alone
                self.error = _failed(str(e))
                self._mask.fill_(-1)  # any token: the request ends at this step anyway


def _failed(detail: str) -> str:
    """What a request whose grammar failed mid-generation is told: llguidance's first
    line (its messages go on with the parser's internal state and the whole grammar)."""
    first = (detail or "unknown error").strip().splitlines()[0][:300]
    return f"the output constraint failed: {first}"


_BITS = torch.arange(8, dtype=torch.uint8)


def unpack_masks(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks -> [rows, vocab] bool (True: allowed); tokens past
    the masks' width (a model vocabulary padded beyond the tokenizer's) are not allowed."""
    raw = masks.contiguous().view(torch.uint8)  # little-endian: byte 0 holds tokens 0-7
    bits = (raw[:, :, None] >> _BITS) & 1
    allowed = bits.view(masks.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(masks.shape[0], vocab - width, dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)

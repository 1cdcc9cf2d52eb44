"""A reasoning request's thinking, counted and budgeted token by token.

The frontend names the model's thinking markers as token ids (`SamplingParams.
reasoning_start` / `reasoning_end`, e.g. Qwen3's ``<think>`` / ``</think>``) and whether
the prompt already opened the block (`reasoning_open`). :class:`ReasoningState`
follows the output:

* **before**: the output may open a block itself: while its first tokens spell the
  start marker it is thinking, and at the first token that does not it is answering;
* **thinking**: every token counts as a reasoning token, the end marker included;
  the block ends when the output ends with the end marker's ids (or, for a marker
  that is several tokens, when the text of the last tokens contains it);
* **answer**: everything after; a grammar (structured output, tool choice) applies
  from here on only.

With `max_reasoning_tokens` set, once the thinking after the start marker holds that
many tokens the next tokens are forced to the end marker (continuing a partial one the
model began), so the reasoning tokens are at most the budget plus the marker's length
and the answer follows (its first token may not be a stop token); a stop token sampled
inside a budgeted block ends the thinking the same way instead of the request.
`Request` holds one; the sampler passes each row's sampled token through
:meth:`next_token`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Sequence

from protocol.sampling import SamplingParams


class Phase(enum.Enum):
    BEFORE = "before"
    THINKING = "thinking"
    ANSWER = "answer"


class ReasoningState:
    def __init__(
        self, params: SamplingParams, decode: Callable[[Sequence[int]], str] | None = None
    ) -> None:
        self.start = tuple(params.reasoning_start)
        self.end = tuple(params.reasoning_end)
        self.budget = params.max_reasoning_tokens
        self.phase = Phase.THINKING if params.reasoning_open else Phase.BEFORE
        if not self.start and not params.reasoning_open:
            self.phase = Phase.ANSWER
        self.interrupted = False  # the budget (not the model) ended the thinking
        self.answered = 0  # answer tokens so far (counted up to 1)
        self.tokens = 0  # reasoning tokens so far, markers included
        self.thought = 0  # thinking tokens after the start marker (what the budget counts)
        self._seen: list[int] = []  # the output's first tokens (before) or its last (thinking)
        # several-token markers: matched in text too, since a tokenizer may spell the
        # marker with other tokens mid-text than alone
        self._decode = decode if len(self.end) > 1 else None
        self._end_text = self._decode(self.end) if self._decode is not None else ""

    @property
    def answering(self) -> bool:
        return self.phase is Phase.ANSWER

    @property
    def owes_answer(self) -> bool:
        """The budget cut the thinking short and no answer token came yet: the next token
        may not be a stop token."""
        return self.interrupted and self.phase is Phase.ANSWER and not self.answered

    def accept(self, token: int) -> None:
        if self.phase is Phase.ANSWER:
            self.answered = 1
            return
        if self.phase is Phase.BEFORE:
            self._seen.append(token)
            k = len(self._seen)
            if tuple(self._seen) != self.start[:k]:
                self.phase, self.tokens, self._seen = Phase.ANSWER, 0, []
                return
            self.tokens = k
            if k == len(self.start):
                self.phase, self._seen = Phase.THINKING, []
            return
        self.tokens += 1
        self.thought += 1
        self._seen.append(token)
        keep = max(len(self.end), 8)
        if len(self._seen) > 2 * keep:
            del self._seen[:-keep]
        if self._ended():
            self.phase, self._seen = Phase.ANSWER, []

    def _ended(self) -> bool:
        n = len(self.end)
        if n and tuple(self._seen[-n:]) == self.end:
            return True
        if self._decode is None:
            return False
        return self._end_text in self._decode(self._seen[-(n + 4) :])

    def next_token(self, sampled: int, stop_ids: Container[int]) -> int:
        """The token to emit for ``sampled``: the end marker's next id once the budget is
        spent, or in place of a stop token while thinking under a budget (the answer is
        what the budget promises); else ``sampled``."""
        if self.phase is not Phase.THINKING or self.budget is None or not self.end:
            return sampled
        done = _matched_prefix(self._seen, self.end)
        if self.thought - done < self.budget and sampled not in stop_ids:
            return sampled
        self.interrupted = True
        return self.end[done]


def _matched_prefix(seen: Sequence[int], marker: Sequence[int]) -> int:
    """Length of the longest beginning of ``marker`` that ``seen`` ends with (short of
    the whole marker)."""
    for k in range(min(len(marker) - 1, len(seen)), 0, -1):
        if tuple(seen[-k:]) == tuple(marker[:k]):
            return k
    return 0


def answer_offset(
    params: SamplingParams,
    output: Sequence[int],
    decode: Callable[[Sequence[int]], str] | None = None,
) -> int:
    """Where the answer starts in ``output`` (earlier output of a migrated request):
    the grammar replays only what follows."""
    state = ReasoningState(params, decode)
    for i, token in enumerate(output):
        if state.answering:
            return i
        state.accept(token)
    return len(output)

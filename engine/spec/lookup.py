"""The engine's prompt-lookup speculator: which running requests draft, and how much.

A request drafts when its tokens are drawn from the logits shaped only by
temperature, top-k, top-p and min-p (no penalties, bias, grammar, logprobs or
min_tokens, whose effect would differ per drafted position): then verifying k drafted
tokens in one forward pass of k + 1 positions emits 1 to k + 1 tokens a step, the
model's own greedy tokens, or sampled exactly from its distributions by the rejection
rule (engine/spec/verify.py).
`SamplingParams.num_speculative_tokens` opts a request in or out (None: the
engine's `EngineConfig.num_speculative_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from engine.spec import ngram
from protocol.sampling import MAX_SPECULATIVE_TOKENS


def can_speculate(req: Request) -> bool:
    p = req.sampling_params
    return (
        not p.needs_penalties
        and not p.logit_bias
        and p.logprobs is None
        and not p.output_logits
        and req.grammar is None
        and req.num_output_tokens >= p.min_tokens
    )


@dataclass
class Speculator:
    """What the scheduler asks of a speculator (`propose`, `record`), the draft length
    every speculator gives a request, and the counters /metrics reads."""

    num_tokens: int = 0  # the default for requests that do not say (0: no drafting)
    # counters for /metrics: verification steps, drafted and accepted tokens
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def draft_len(self, req: Request, room: int) -> int:
        """How many tokens `req` drafts this step: its own setting or the default,
        within `room`; 0 for requests that cannot draft."""
        want = req.sampling_params.num_speculative_tokens
        k = min(self.num_tokens if want is None else want, room, MAX_SPECULATIVE_TOKENS)
        return k if k > 0 and can_speculate(req) else 0

    def propose(self, req: Request, room: int) -> list[int]:
        """Up to `room` draft tokens for `req`'s next step, or []."""
        raise NotImplementedError

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted


@dataclass
class PromptLookup(Speculator):
    """Drafts for a decoding request from its own context (`engine.spec.ngram`)."""

    min_n: int = 3  # 2 drafts on common bigrams of plain prose, and loses there
    max_n: int = 4

    def propose(self, req: Request, room: int) -> list[int]:
        k = self.draft_len(req, room)
        return ngram.propose(req.all_token_ids, k, self.min_n, self.max_n) if k else []

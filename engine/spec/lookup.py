"""The engine's speculators' interface, and prompt lookup.

Which running requests draft, and how many tokens, the scheduler decides
(`Scheduler._draft`, `Request.may_draft`): a request drafts when its tokens are drawn
from the logits shaped only by temperature, top-k, top-p and min-p; then verifying k drafted
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


@dataclass
class Speculator:
    """What the scheduler asks of a speculator (`propose`, `record`), the default draft
    length, and the counters /metrics reads."""

    num_tokens: int = 0  # the default for requests that do not say (0: no drafting)
    # counters for /metrics: verification steps, drafted and accepted tokens
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` draft tokens for `req`'s next step (k >= 1: the scheduler has
        decided that the request drafts, and how many), or []."""
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

    def propose(self, req: Request, k: int) -> list[int]:
        return ngram.propose(req.all_token_ids, k, self.min_n, self.max_n)

"""The draft-model speculator: a smaller model of the same tokenizer drafts greedily.

`DraftModel` runs the draft model in an engine of its own (an `EngineCore` built from
`EngineConfig.speculative_model`, with its own KV pool and prefix caching). To draft k
tokens for a request it submits the request's whole context as a prompt and decodes k
greedy tokens. The draft engine's prefix cache still holds the context's full blocks
from the request's previous step, so a step recomputes only the last partial block and
the tokens accepted since, then runs k - 1 decode steps. Blocks are keyed by their
tokens, so a block that held a rejected draft never matches a later context.

The drafts are the draft model's greedy tokens, point masses, for which the target's
rejection rule (`engine.spec.verify.accept_sampled`) is exact: sampled requests keep
their distribution and greedy ones their exact output, as with prompt lookup.

A cached prefix is attended through other kernels than a fresh one, so a near-tie
among the draft model's logits can split differently, and a sampled request's draws
follow its drafts. The draft engine's cache is therefore salted per request (its
`request_id`): a request's drafts never depend on what other requests left there, only
on its own history, so a seed fixes a sampled request's output as it does without
drafts, as long as the draft pool does not run short and evict the request's blocks
between its steps. Which requests draft and how much the scheduler decides (`Scheduler._draft`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import NewRequest, Request
from engine.spec.lookup import Speculator
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine_core import EngineCore


@dataclass(kw_only=True)
class DraftModel(Speculator):
    """Drafts for a decoding request: the draft model's greedy continuation."""

    engine: EngineCore
    _ids: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    def propose(self, req: Request, k: int) -> list[int]:
        context = req.all_token_ids
        if len(context) + k > self.engine.max_model_len:
            return []
        params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        self.engine.submit(
            NewRequest(f"draft-{next(self._ids)}", list(context), params,
                       cache_salt=f"request:{req.request_id}")
        )  # fmt: skip
        draft: list[int] = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                draft += out.new_token_ids
        return draft[:k]

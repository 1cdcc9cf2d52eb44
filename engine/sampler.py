"""Turn a batch of logits rows into next tokens.

Order of operations per row: raw logprobs (what `logprobs` reports) are taken from
the model's logits; then penalties, the min_tokens ban on stop tokens, temperature,
top-k, top-p and min-p shape the distribution; then a token is drawn.

Drawing uses the exponential race (argmax of p / E with E ~ Exp(1)), which samples
from p exactly. Rows with a seed draw E from their own generator, so a seeded
request yields the same tokens whatever else shares its batch. Greedy rows skip all
of it; an all-greedy batch without logprobs costs one argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.grammar import unpack_masks
from engine.request import Request
from engine.spec.verify import accept_sampled
from kernels import ops
from protocol.logprobs import TokenLogprob, TopLogprob
from protocol.sampling import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device)
        self.generator.manual_seed(seed)
        # speculative verification draws on the CPU (a few rows, a request's own
        # generator lives there too)
        self.cpu_generator = torch.Generator()
        self.cpu_generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: [len(requests), vocab] in the model dtype.

        A greedy batch without logprobs takes the argmax as is (widening bf16 logits
        to fp32 changes no value, so not their argmax); anything else works in fp32.
        """
        params = [r.sampling_params for r in requests]
        plain_greedy = all(p.greedy and p.logprobs is None for p in params)
        if not plain_greedy or any(p.needs_penalties or p.min_tokens for p in params):
            logits = logits.float()
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if any(p.needs_penalties for p in params):
            logits = _apply_penalties(logits.clone(), requests)
        if any(p.logit_bias for p in params):
            logits = _apply_logit_bias(logits, requests)
        unbanned = logits  # a grammar that can only end overrides the min_tokens ban
        logits = _ban_stop_tokens(logits, requests)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:  # unconstrained batches never get here
            logits = _apply_grammars(logits, unbanned, requests, constrained)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = ops.argmax(logits)  # the fast path: no sort, no softmax
        else:
            tokens = self._sample(logits, requests, greedy)
        token_list = tokens.tolist()
        lps: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            lps = _gather_logprobs(raw_logprobs, token_list, params)
        return SamplerOutput(token_list, lps)

    def verify(self, logits: torch.Tensor, request: Request, draft: list[int]) -> list[int]:
        """The tokens a sampled request emits after drafting `draft`: the rejection
        rule (engine/spec/verify.py) over the distributions it samples from, shaped
        by its temperature, top-k, top-p and min-p (speculating requests have no
        penalties, bias, grammar or stop-token ban). `logits` [k + 1, vocab]: at its
        last token and each draft. Draws come from the request's seeded generator, or
        the engine's."""
        params = [request.sampling_params] * logits.shape[0]
        probs = shaped(logits.float(), params, [False] * len(params))[1].cpu()
        generator = request.generator or self.cpu_generator
        return accept_sampled(draft, probs, None, generator)

    def _sample(
        self, logits: torch.Tensor, requests: Sequence[Request], greedy: list[bool]
    ) -> torch.Tensor:
        logits, probs = shaped(logits, [r.sampling_params for r in requests], greedy)
        dev = logits.device
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None and not greedy[i]:
                # a request's generator lives on the CPU, so its draws don't depend
                # on the device or on what else is in the batch
                row = torch.empty(noise.shape[1]).exponential_(generator=r.generator)
                noise[i].copy_(row)
        sampled = (probs / noise).argmax(dim=-1)
        greedy_mask = torch.tensor(greedy, device=dev)
        return torch.where(greedy_mask, logits.argmax(dim=-1), sampled)


def shaped(
    logits: torch.Tensor, params: Sequence[SamplingParams], greedy: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, probs) rows are drawn from: logits over temperature (1 for greedy
    rows) with top-k and top-p applied; their softmax with min-p applied."""
    dev = logits.device
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=dev)
    logits = logits / temps[:, None]
    # greedy rows take the argmax of their logits unfiltered (top_p 0 is greedy too)
    top_k = [0 if g or p.top_k < 0 else p.top_k for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    typical = [1.0 if g else p.typical_p for p, g in zip(params, greedy)]
    if any(t < 1.0 for t in typical):
        logits = _typical(logits, typical)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        mp = torch.tensor(min_p, device=dev)[:, None]
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return logits, probs


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    vocab = logits.shape[-1]
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not p.needs_penalties:
            continue
        row = logits[i]
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.zeros(vocab, device=row.device)
        if len(out):
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(r.prompt_token_ids, dtype=torch.long, device=row.device)
            seen[prompt] = True
            rp = p.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _ban_stop_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Until a request has min_tokens outputs, its stop tokens cannot be drawn."""
    cloned = False
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.sampling_params.min_tokens and r.stop_ids:
            if not cloned:
                logits, cloned = logits.clone(), True
            logits[i, list(r.stop_ids)] = float("-inf")
    return logits


def _apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    logits = logits.float().clone()
    for i, r in enumerate(requests):
        bias = r.sampling_params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            vals = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, vals)
    return logits


def _apply_grammars(
    logits: torch.Tensor, unbanned: torch.Tensor, requests: Sequence[Request], rows: list[int]
) -> torch.Tensor:
    """Mask the constrained rows to their grammars' next tokens (one batched bitmask).

    A grammar that can only end while min_tokens bans the stop tokens leaves no token:
    such a row takes the grammar's mask over the logits without the ban (the grammar wins).
    """
    masks = torch.stack([r.grammar.mask() for r in (requests[i] for i in rows)])  # type: ignore[union-attr]
    allowed = unpack_masks(masks, logits.shape[-1]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    dead = torch.isinf(masked).all(dim=-1)
    if bool(dead.any()):
        fallback = (
            unbanned.index_select(0, index).to(masked.dtype).masked_fill(~allowed, float("-inf"))
        )
        masked = torch.where(dead[:, None], fallback, masked)
    out = logits.clone()
    out.index_copy_(0, index, masked)
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    dev = logits.device
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev)[:, None]
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, device=dev)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
    before = probs.cumsum(dim=-1) - probs
    # rows with top_p == 1 keep everything (float cumsum can reach 1.0 before the tail)
    sorted_logits = sorted_logits.masked_fill((before >= p) & (p < 1.0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _typical(logits: torch.Tensor, mass: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022, as HF's TypicalLogitsWarper): keep
    the tokens whose surprise -log p is nearest the entropy, fewest first, until their
    probability reaches the row's mass (at least one)."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shift, order = shifted.sort(dim=-1)
    cum = p.gather(-1, order).cumsum(dim=-1)
    m = torch.tensor(mass, device=logits.device)[:, None]
    last = (cum < m).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    drop = sorted_shift > sorted_shift.gather(-1, last)
    drop[:, 0] = False
    drop &= m < 1.0  # rows that do not ask for it keep everything
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def _gather_logprobs(
    raw: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    n_top = max((p.logprobs or 0) for p in params)
    tok = torch.tensor(tokens, device=raw.device)
    chosen = raw.gather(1, tok[:, None])
    ranks = (raw > chosen).sum(dim=-1) + 1
    top_vals = top_ids = None
    if n_top:
        top_vals, top_ids = raw.topk(n_top, dim=-1)
    out: list[TokenLogprob | None] = []
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    tv = top_vals.tolist() if top_vals is not None else None
    ti = top_ids.tolist() if top_ids is not None else None
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        n = p.logprobs
        top = tuple(map(TopLogprob, ti[i][:n], tv[i][:n])) if (ti and tv and n) else ()
        out.append(TokenLogprob(tokens[i], chosen_l[i], ranks_l[i], top))
    return out

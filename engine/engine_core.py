"""The step-level engine: add and abort requests, run steps, collect outputs.

Not thread-safe: one owner calls it (the offline `LLM`, or `AsyncEngine`'s loop
thread). Bad input raises before anything is allocated, so a rejected request
never disturbs the running ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.kv_cache.layout import KVLayout
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.weights import ModelSource, open_checkpoint, resolve_model

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        kv_pool: torch.Tensor | None = None,
        kv_allocator: Callable[[int], torch.Tensor] | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.source: ModelSource = resolve_model(config.model)
        checkpoint = open_checkpoint(self.source)
        self.model_config: ModelConfig = checkpoint.config
        mc = self.model_config
        self.runner = ModelRunner(mc, config, checkpoint.iter_weights(), kv_pool, kv_allocator)
        self.layout: KVLayout = self.runner.layout
        capacity = (self.layout.num_blocks - 1) * config.block_size
        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > capacity:
            log.warning(
                "context window %d exceeds the KV pool (%d tokens); capping it", max_len, capacity
            )
            max_len = capacity
        self.max_model_len = max_len
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else mc.eos_token_ids)
        self.kv = KVCacheManager(
            self.layout.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=str(config.extra.get("scheduling_policy", "fcfs")),
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
            log.warning(
                "chunked prefill is off and the token budget (%d) is below the context "
                "window (%d): longer prompts will wait forever",
                config.max_num_batched_tokens,
                max_len,
            )

    # -- requests ----------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_blocks: bool = False,
    ) -> Request:
        """Validate input and build a Request; raises ValueError with the reason.

        `hold_blocks`: when the request finishes (not when aborted), its KV blocks
        stay allocated until `release_held(request_id)`: a prefill worker reads
        them after the request ends.
        """
        params = params or SamplingParams()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context window is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room for one output token"
            )
        needed = self.kv.blocks_needed(n + 1)
        if needed > self.kv.pool.num_usable_blocks:
            raise ValueError(
                f"the prompt needs {needed} KV blocks but the whole pool holds "
                f"{self.kv.pool.num_usable_blocks}"
            )
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad_stops}")
        return Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=priority,
            cache_salt=cache_salt,
            hold_blocks=hold_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_blocks: bool = False,
    ) -> Request:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.make_request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            hold_blocks=hold_blocks,
        )
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> Request:
        """Stop a request now and free its blocks; KeyError for an unknown id."""
        return self.scheduler.abort_request(request_id)

    # -- remote prefill (the decode worker drives these) --------------------------

    def plan_remote(self, req: Request, min_uncached: int) -> list[int] | None:
        """Pin blocks for `req`'s whole prompt if its uncached part has at least
        `min_uncached` tokens; return its block ids (None: prefill locally, nothing
        changed). `req.num_cached_tokens` tells how much of the prompt was cached."""
        hit = self.kv.find_prefix(req)
        if req.num_tokens - hit.num_tokens < min_uncached:
            return None
        try:
            self.scheduler.park_for_remote_kv(req)
        except RuntimeError:  # the pool can't hold the prompt now: queue it locally
            return None
        return self.kv.block_ids(req.request_id)

    def remote_kv_ready(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Adopt a remote prefill's KV and first token; returns the first token's output."""
        req = self.scheduler.remote_kv_ready(request_id, first_token, logprob)
        if req.generator is not None and not req.sampling_params.greedy:
            # the prefill worker sampled the first token with this seed's first draw
            torch.empty(self.model_config.vocab_size).exponential_(generator=req.generator)
        return self._output(req, 1)

    def remote_kv_failed(self, request_id: str) -> Request:
        """No remote write can land: free the pinned blocks, prefill locally."""
        return self.scheduler.remote_kv_failed(request_id)

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished `hold_blocks` request."""
        self.scheduler.release_held(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over what the scheduler picks; report new tokens."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        block_ids = {
            s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled
        }
        result = self.runner.execute(sched, block_ids)
        for rid, lp in result.logprobs.items():
            self.scheduler.requests[rid].logprobs.append(lp)
        for rid, row in result.logits.items():
            self.scheduler.requests[rid].logits.append(row)
        self.scheduler.update(sched, result.tokens)
        outputs = []
        for s in sched.scheduled:
            req = s.request
            if req.request_id not in result.tokens:
                continue
            outputs.append(self._output(req, 1))
        return outputs

    def _output(self, req: Request, num_new: int) -> RequestOutput:
        params = req.sampling_params
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.output_token_ids[-num_new:],
            finished=req.finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            new_logprobs=req.logprobs[-num_new:] if params.logprobs is not None else None,
            new_logits=req.logits[-num_new:] if params.output_logits else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            error=req.error,
        )

    # -- introspection -----------------------------------------------------------

    def check_invariants(self) -> list[str]:
        problems = self.kv.check_invariants()
        for rid, req in self.scheduler.requests.items():
            if req.finished and req.status != RequestStatus.FINISHED_ABORTED:
                problems.append(f"finished request {rid} still tracked")
        return problems

    def is_idle(self) -> bool:
        s = self.scheduler
        return not s.requests and not s.held and self.kv.is_idle()

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "remote_waiting": len(s.remote_waiting),
            "kv_usage": self.kv.usage,
            "num_preemptions": s.num_preemptions,
            "prefix_hit_rate": s.prefix_hit_tokens / max(s.prefix_queried_tokens, 1),
        }

"""The step-level engine: add and abort requests, run steps, collect outputs.

Not thread-safe: one owner calls it (the offline `LLM`, or `AsyncEngine`'s loop
thread). Bad input raises before anything is allocated, so a rejected request
never disturbs the running ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler, GrammarState
from engine.kv_cache import KVCacheManager
from engine.kv_cache.layout import KvAllocator
from engine.kv_cache.tiers import KvTiers, TierStats, tier_namespace
from engine.lora import AdapterStats, LoraManager
from engine.model_runner import ModelRunner
from engine.models.moe import ExpertLoadStats
from engine.parallel.ranks import Ranks, check_parallel, rank_config, start_ranks
from engine.reasoning import ReasoningState, answer_offset
from engine.request import (
    DuplicateRequestError,
    NewRequest,
    RemotePlan,
    RemoteRule,
    Request,
    RequestOutput,
    RequestStatus,
)
from engine.scheduler import Scheduler
from engine.sim.runner import SimModelRunner, simulated_model
from engine.sim.timing import load_timing
from engine.spec.draft import DraftModel
from engine.spec.lookup import PromptLookup, Speculator
from engine.tokenizer import Tokenizer
from engine.weights import (
    ModelSource,
    load_model_config,
    open_checkpoint,
    resolve_model,
    weights_for,
)
from protocol.errors import InvalidInput
from protocol.kv_layout import BlockHash, KvLayout, hash_block
from protocol.logprobs import TokenLogprob
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


_PLAIN_INTS = {int, bool}
PREFILL_SAMPLE_TOKENS = 64  # a step of at least this many tokens times the prefill speed


class EngineCore:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        kv_pool: torch.Tensor | None = None,
        kv_allocator: KvAllocator | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.source: ModelSource = resolve_model(config.model)
        self.runner: ModelRunner | SimModelRunner
        self.ranks: Ranks | None = None  # the other tensor-parallel ranks (engine/parallel/)
        if config.sim is not None:  # `model` names the tokenizer; no weights are read
            if config.tensor_parallel_size > 1:
                raise ValueError("the simulated engine models tensor parallelism in its "
                                 "timing profile (its 'tp8'); --tensor-parallel-size is "
                                 "for real engines")  # fmt: skip
            timing = load_timing(config.sim.profile)
            tokenizer_model = load_model_config(self.source)
            self.model_config = simulated_model(timing, tokenizer_model, eos_token_ids)
            self.runner = SimModelRunner(timing, self.model_config, config, kv_pool, kv_allocator)
        else:
            checkpoint = open_checkpoint(self.source)
            self.model_config = checkpoint.config
            if config.tensor_parallel_size > 1:
                check_parallel(config, checkpoint.config)
                self.config = config = rank_config(config)
                self.ranks = start_ranks(config, checkpoint.config)
            try:
                self.runner = ModelRunner(
                    checkpoint.config,
                    config,
                    weights_for(checkpoint, config.quantization,
                                None if self.ranks is None else self.ranks.group.shard.weights),
                    kv_pool,
                    kv_allocator,
                    tp=None if self.ranks is None else self.ranks.group,
                )
            except BaseException:
                self.close()
                raise
        mc = self.model_config
        self.loras = self._loras(config)
        self.layout: KvLayout = self.runner.layout
        # `--deterministic`: what this engine's bits depend on (`engine.determinism.numerics`)
        self.numerics = self.runner.numerics if isinstance(self.runner, ModelRunner) else None
        capacity = (self.layout.num_blocks - 1) * config.block_size
        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > capacity:
            log.warning(
                "context window %d exceeds the KV pool (%d tokens); capping it", max_len, capacity
            )
            max_len = capacity
        self.max_model_len = max_len
        self.last_step_tokens = 0  # tokens the last step computed (0: it ran nothing)
        # seconds a prompt token takes in steps of prefill (a moving average; 0: none yet),
        # what a tier's restore is priced against (`TierStats.restore_cost`)
        self.prefill_s_per_token = 0.0
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else mc.eos_token_ids)
        self._grammar: GrammarCompiler | None = None
        self._text: Tokenizer | None = None  # decodes several-token thinking markers
        self.kv = KVCacheManager(
            self.layout.num_blocks, config.block_size, config.enable_prefix_caching,
            self._tiers(config),
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            long_thinking_tokens=config.long_thinking_tokens,
            session_ttl_s=config.kv_session_ttl_s,
            max_loras=config.max_loras if self.loras is not None else 0,
            on_lora_wait=self.loras.waited if self.loras is not None else None,
            # the simulated engine runs no verification pass: it never drafts
            speculator=None if config.sim is not None else self._speculator(config),
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_len:
            log.warning(
                "chunked prefill is off and the token budget (%d) is below the context "
                "window (%d): longer prompts will wait forever",
                config.max_num_batched_tokens,
                max_len,
            )

    def _loras(self, config: EngineConfig) -> LoraManager | None:
        """The LoRA slots on the model's linears and their pager (engine/lora/), if asked for."""
        if not config.enable_lora:
            return None
        runner = self.runner
        if not isinstance(runner, ModelRunner):
            raise ValueError("LoRA adapters need a real model")
        if self.model_config.mla:
            raise ValueError("LoRA adapters are not served for latent-attention (MLA) models")
        runner.loras = LoraManager.for_model(
            runner.model, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras or config.max_loras,
            lambda: {r.lora for r in self.scheduler.requests.values() if r.lora is not None},
        )  # fmt: skip
        return runner.loras

    def _tiers(self, config: EngineConfig) -> KvTiers | None:
        """The host and disk tiers under the KV pool, if asked for (engine/kv_cache/tiers.py)."""
        if not (config.kv_host_memory_bytes or config.kv_disk_dir):
            return None
        runner = self.runner  # (a simulated one: a host tier of its device's block sizes)
        disk = (Path(config.kv_disk_dir), config.kv_disk_bytes) if config.kv_disk_dir else None
        return KvTiers(
            runner.tier_block_bytes, config.kv_host_memory_bytes, runner.read_blocks,
            runner.write_blocks, disk, tier_namespace(self.source, self.layout, config),
        )  # fmt: skip

    def _speculator(self, config: EngineConfig) -> Speculator:
        """Prompt lookup, or the draft model's engine when the config names one."""
        if config.speculative_model is None:
            return PromptLookup(config.num_speculative_tokens)
        # the draft runs whole in this process (rank 0's), whatever the target's split
        draft = EngineCore(replace(
            config, model=config.speculative_model, quantization=config.speculative_quantization,
            speculative_model=None, speculative_quantization=None, num_speculative_tokens=0,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes // 4, enable_prefix_caching=True,
            tensor_parallel_size=1, tensor_parallel_nodes=1, enable_lora=False,
        ))  # fmt: skip
        mine, theirs = self.model_config, draft.model_config
        if theirs.vocab_size != mine.vocab_size or set(theirs.eos_token_ids) != set(
            mine.eos_token_ids
        ):
            raise ValueError(
                f"speculative model {config.speculative_model} does not share the model's "
                f"tokenizer (vocabulary {theirs.vocab_size} vs {mine.vocab_size}, EOS "
                f"{theirs.eos_token_ids} vs {mine.eos_token_ids})"
            )
        return DraftModel(num_tokens=config.num_speculative_tokens, engine=draft)

    # -- requests: the one way in --------------------------------------------------

    def submit(
        self,
        new: NewRequest,
        *,
        remote_min_uncached: int | RemoteRule | None = None,
        grammar: GrammarState | None = None,
    ) -> RemotePlan | None:
        """Admit a new request: validate it, refuse an id in use, match the prefix cache
        once and decide where its prompt is prefilled.

        `remote_min_uncached=None` prefills here. Otherwise (a `RemoteRule`, or an int:
        the rule with only that many uncached tokens as its bar), when the rule says so
        for the prompt's cached prefix and the pool can hold the whole prompt now, the
        prompt's blocks are pinned for a remote prefill and its plan returned: the
        request then waits (costing nothing per step) for `remote_kv_ready` or
        `remote_kv_failed`. Returns None when the request was queued for local prefill.
        Raises ValueError (`DuplicateRequestError` for an id in use) before anything
        changes, so a rejected request never disturbs the running ones. `grammar`: the
        request's structured-output state from `compile_grammar`, compiled off the engine
        thread; compiled here when not given.
        """
        req = self._validated(new, grammar)
        if self.kv.tiers is not None:  # its prefix's disk blocks, read while it waits
            self.kv.tiers.prefetch(self.kv.block_hashes(req))
        rule = remote_min_uncached
        if isinstance(rule, int):
            rule = RemoteRule(rule)
        if rule is not None:
            hit = self.kv.find_prefix(req)
            if rule.remote(req.num_tokens, hit.num_tokens):
                try:
                    cached = self.scheduler.park_for_remote_kv(req, hit)
                except RuntimeError:  # the pool cannot hold the prompt now: prefill here
                    pass
                else:
                    return RemotePlan(self.kv.block_ids(req.request_id), cached)
        self.scheduler.add_request(req)
        return None

    def _validated(self, new: NewRequest, grammar: GrammarState | None = None) -> Request:
        rid = new.request_id
        if rid in self.scheduler.requests or rid in self.scheduler.held:
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        if self.scheduler.sessions.ttl_s:  # a held turn's id, reused: let it go
            self.scheduler.sessions.release_request(rid)
        params = new.params
        ids = list(new.prompt_token_ids)
        n = len(ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        # in C first (the types, then the range); token by token only to name the bad ones
        if not set(map(type, ids)) <= _PLAIN_INTS or min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}"
                )
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
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(
                f"logit_bias token ids outside the vocabulary [0, {vocab}): {bad_bias}"
            )
        if new.lora is not None:
            if self.loras is None:
                raise InvalidInput(f"LoRA adapter {new.lora.name!r}: this engine serves no "
                                   "adapters (start it with --enable-lora)")  # fmt: skip
            self.loras.prepare(new.lora)  # read and checked now: a bad one fails here
        if params.grammar is not None and grammar is None:
            grammar = self.compile_grammar(new)
        req = Request(
            rid,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=new.priority,
            cache_salt=new.cache_salt,
            hold_blocks=new.hold_blocks,
            session_id=new.session_id,
            lora=new.lora,
        )
        req.grammar = grammar
        if params.reasoning_end or params.reasoning_start:
            req.reasoning = ReasoningState(params, self._marker_decoder(params))
            for token in ids[n - params.output_replay :] if params.output_replay else ():
                req.reasoning.accept(token)  # a migrated request's thinking so far
        if new.lora is not None and self.loras is not None:
            stats = self.loras.stats_of(new.lora.name)
            stats.requests += 1
            stats.prompt_tokens += n
        return req

    def compile_grammar(self, new: NewRequest) -> GrammarState | None:
        """The request's structured-output state (None without a grammar), its earlier
        output replayed; raises ValueError (`GrammarError`). Safe off the engine thread:
        a complex grammar can take a while, and the batch should not wait for it."""
        params = new.params
        if params.grammar is None:
            return None
        if self.config.sim is not None:
            raise ValueError("structured output needs a real model; this engine is simulated")
        n = len(new.prompt_token_ids)
        if params.output_replay > n:
            raise ValueError("output_replay exceeds the prompt")
        replay = new.prompt_token_ids[n - params.output_replay :] if params.output_replay else []
        if params.reasoning_end or params.reasoning_start:  # the grammar is the answer's
            replay = replay[answer_offset(params, replay, self._marker_decoder(params)) :]
        return self.grammar_compiler().state(params.grammar, list(replay))

    def _marker_decoder(self, params: SamplingParams) -> Callable[[Sequence[int]], str] | None:
        """Text of token ids, for a thinking end marker of several tokens (None: ids do)."""
        if len(params.reasoning_end) < 2 or self.config.sim is not None:
            return None
        if self._text is None:
            self._text = Tokenizer.from_source(self.source)
        tok = self._text
        return lambda ids: tok.decode(ids, skip_special_tokens=False)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer, built on first use."""
        if self._grammar is None:
            tok = Tokenizer.from_source(self.source)
            self._grammar = GrammarCompiler(
                tok.hf_tokenizer, list(self.eos_token_ids), self.model_config.vocab_size
            )
        return self._grammar

    def abort_request(self, request_id: str) -> Request:
        """Stop a request now and free its blocks; KeyError for an unknown id."""
        return self.scheduler.abort_request(request_id)

    def abort_all(self) -> list[str]:
        """Abort every tracked request (the step failed); returns their ids."""
        ids = list(self.scheduler.requests)
        for rid in ids:
            self.scheduler.abort_request(rid)
        return ids

    # -- remote prefill (the decode worker drives these) --------------------------

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

    def prefix_hit_tokens(self, request_id: str) -> int:
        """Prompt tokens of a waiting request that its prefix-cache match covers now
        (what it will not have to prefill, unless the blocks are evicted first)."""
        req = self.scheduler.requests[request_id]
        if req.num_computed_tokens > 0:
            return req.num_computed_tokens
        return self.kv.find_prefix(req).num_tokens

    def block_ids(self, request_id: str) -> list[int]:
        """The block table of a tracked (or held) request."""
        return self.kv.block_ids(request_id)

    def release_held(self, request_id: str) -> None:
        """Free the blocks of a finished `hold_blocks` request."""
        self.scheduler.release_held(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- a prefix moved between workers' pools (a peer pull) -----------------------
    #
    # `owner` names a holding that is not a request ("pull <id>", "push <id>": request
    # ids have no spaces); every holding ends with `release_peer_blocks` or, for a
    # reservation, `commit_peer_blocks`.

    def reserve_peer_blocks(self, owner: str, hashes: Sequence[BlockHash]) -> tuple[int, list[int]]:
        """For blocks `hashes` (a prompt's leading chain) that a peer is to write here:
        how many leading ones this worker holds already (its pool or a tier), and fresh
        blocks, held by `owner`, for as many of the rest as are free."""
        return self.kv.reserve(owner, hashes)

    def commit_peer_blocks(self, owner: str, hashes: Sequence[BlockHash]) -> int:
        """The peer's write into `owner`'s reservation landed for blocks `hashes` (the
        reservation's first ones): cache them, free the reservation; how many were cached."""
        cached = self.kv.commit(owner, hashes)
        self.scheduler.kv_freed()
        return cached

    def pin_peer_blocks(self, owner: str, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the leading `hashes` this worker holds (a tier's restored into
        the pool), pinned for `owner` while a peer copies them."""
        return self.kv.pin_cached(owner, hashes)

    def release_peer_blocks(self, owner: str) -> None:
        self.kv.release(owner)
        self.scheduler.kv_freed()

    def record_kv_events(self) -> None:
        """From now on, note every block stored in, moved under or evicted from the
        prefix cache."""
        self.kv.pool.record_events = True
        if self.kv.tiers is not None:
            self.kv.tiers.record_moves = True

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        """("stored" | "host" | "disk" | "removed", block hashes) since the last call, in
        order. With KV tiers a block the pool evicts is "host" or "disk" (held there now:
        restoring it costs a copy, not a prefill, and routers price it so), and removed
        when no tier holds it any more."""
        tiers = self.kv.tiers
        if tiers is None:
            return self.kv.pool.drain_events()
        return self.kv.pool.drain_events(tiers.drain_gone(), tiers.drain_moves())

    def has_work(self) -> bool:
        """Something to compute now (requests waiting for remote KV cost nothing; a
        queue that cannot move until a request or remote KV event has none)."""
        return self.scheduler.has_work()

    # -- the step ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward pass over what the scheduler picks; report new tokens."""
        sched = self.scheduler.schedule()
        self.last_step_tokens = sched.num_tokens
        if not sched.scheduled:
            return []
        block_ids = {
            s.request.request_id: self.kv.block_ids(s.request.request_id) for s in sched.scheduled
        }
        began = time.perf_counter()
        result = self.runner.execute(sched, block_ids)
        if sched.num_tokens >= PREFILL_SAMPLE_TOKENS:  # a step of prefill: its speed
            per_token = (time.perf_counter() - began) / sched.num_tokens
            old = self.prefill_s_per_token
            self.prefill_s_per_token = per_token if not old else 0.8 * old + 0.2 * per_token
        for rid, lp in result.logprobs.items():
            self.scheduler.requests[rid].logprobs.append(lp)
        for rid, row in result.logits.items():
            self.scheduler.requests[rid].logits.append(row)
        before = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        self.scheduler.update(sched, result.tokens, result.accepted)
        if self.loras is not None:  # finished requests may let host copies go
            self.loras.trim_host()
        outputs = []
        for s in sched.scheduled:
            req = s.request
            if req.request_id not in result.tokens:
                continue
            new = req.num_output_tokens - before[req.request_id]
            outputs.append(self._output(req, max(new, 1)))
            if req.lora is not None and self.loras is not None:
                self.loras.stats_of(req.lora.name).generated_tokens += max(new, 1)
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
            num_reasoning_tokens=req.reasoning.tokens if req.reasoning is not None else 0,
            error=req.error,
            error_is_request=req.error_is_request,
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

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the disk tier's writer once
        its queued blocks are written (the rest is garbage)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close()
        kv = getattr(self, "kv", None)  # (a failed start has none)
        if kv is not None and kv.tiers is not None:
            kv.tiers.close()

    def _tier_stats(self) -> TierStats | None:
        tiers = self.kv.tiers
        if tiers is None:
            return None
        return replace(tiers.snapshot(), block_size=self.kv.block_size,
                       prefill_s_per_token=self.prefill_s_per_token)  # fmt: skip

    def _expert_load(self) -> ExpertLoadStats | None:
        load = getattr(self.runner, "expert_load", None)
        return replace(load) if isinstance(load, ExpertLoadStats) else None

    def snapshot(self) -> EngineSnapshot:
        s, kv = self.scheduler, self.kv
        total = kv.pool.num_usable_blocks
        spec = s.speculator
        held, held_blocks = (len(s.sessions), s.sessions.num_blocks) if s.sessions.ttl_s else (0, 0)
        return EngineSnapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            remote_waiting=len(s.remote_waiting),
            kv_used_blocks=total - kv.num_free_blocks,
            kv_total_blocks=total,
            num_preemptions=s.num_preemptions,
            prefix_hit_rate=s.prefix_hit_tokens / max(s.prefix_queried_tokens, 1),
            spec_steps=spec.steps if spec else 0,
            spec_drafted=spec.drafted if spec else 0,
            spec_accepted=spec.accepted if spec else 0,
            tp_collectives=self.ranks.group.collectives if self.ranks else 0,
            tp_collective_s=self.ranks.group.collective_s if self.ranks else 0.0,
            tp_collective_bytes=self.ranks.group.collective_bytes if self.ranks else 0,
            expert_load=self._expert_load(),
            kv_tiers=self._tier_stats(),
            sessions_held=held,
            session_blocks=held_blocks,
            sessions_released_for_room=s.sessions.num_released_for_room,
            sessions_expired=s.sessions.num_expired,
            block_size=kv.block_size,
            cached_blocks=kv.pool.cached if kv.enable_caching else frozenset(),
            loras=self._lora_stats(),
            lora_resident=tuple(self.loras.resident_names()) if self.loras else (),
        )

    def _lora_stats(self) -> dict[str, AdapterStats]:
        if self.loras is None:
            return {}
        return {name: replace(st) for name, st in self.loras.stats.items()}


@dataclass(frozen=True)
class EngineSnapshot:
    """What other threads may read of an engine: figures of one moment, copied after
    every step (`AsyncEngine.snapshot`), and the prefix cache's block hashes as a live
    read-only view for `prefix_hit` (a membership test, atomic under the GIL: an
    estimate that may be a step stale, never a torn read)."""

    running: int = 0
    waiting: int = 0
    remote_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    num_preemptions: int = 0
    prefix_hit_rate: float = 0.0
    spec_steps: int = 0  # speculative verification steps, drafted and accepted tokens
    spec_drafted: int = 0
    spec_accepted: int = 0
    # tensor parallelism: the forward passes' collectives so far and rank 0's seconds in them
    tp_collectives: int = 0
    tp_collective_s: float = 0.0
    tp_collective_bytes: int = 0  # rank 0's tensors put into them
    # a mixture of experts' routing imbalance (a copy; None: no experts)
    expert_load: ExpertLoadStats | None = None
    kv_tiers: TierStats | None = None  # the host and disk tiers' counts (None: no tiers)
    # session holds (engine/kv_cache/sessions.py): held now, their blocks, let go so far
    sessions_held: int = 0
    session_blocks: int = 0
    sessions_released_for_room: int = 0
    sessions_expired: int = 0
    block_size: int = 16
    cached_blocks: Container[BlockHash] = frozenset()
    # LoRA adapters (engine/lora/): each one's counters (copies) and those in a slot now
    loras: dict[str, AdapterStats] = field(default_factory=dict)
    lora_resident: tuple[str, ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    def prefix_hit(
        self, token_ids: Sequence[int], salt: str | None = None, adapter: AdapterRef | None = None
    ) -> int:
        """Prompt tokens of `token_ids` the prefix cache holds, as admission would count
        them (whole blocks, the last token never), to the first block it lacks."""
        bs, cached = self.block_size, self.cached_blocks
        parent: BlockHash | None = None
        n = 0
        for i in range((len(token_ids) - 1) // bs):
            first = i == 0
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs],
                                salt if first else None, adapter if first else None)  # fmt: skip
            if parent not in cached:
                break
            n += 1
        return n * bs

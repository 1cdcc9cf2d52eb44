"""Owns the model weights and the KV pool; turns a scheduled step into sampled tokens.

Sampling (`sample`) turns a batch of logits rows into next tokens.

Order of operations per row: raw logprobs (what `logprobs` reports) are taken from
the model's logits; then penalties, the min_tokens ban on stop tokens, temperature,
top-k, top-p and min-p shape the distribution; then a token is drawn.

Drawing uses the exponential race (argmax of p / E with E ~ Exp(1)), which samples
from p exactly. Rows with a seed draw E from their own generator, so a seeded
request yields the same tokens whatever else shares its batch. Greedy rows skip all
of it; an all-greedy batch without logprobs costs one argmax.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from engine.attention import BatchLayout, TorchAttention, get_backend_class
from engine.config import EngineConfig, ModelConfig
from engine.determinism import (
    SUMMARY,
    TRITON_PATHS,
    check_loaded,
    check_model,
    kernel_paths,
    numerics,
)
from engine.grammar import unpack_masks
from engine.kv_cache.layout import (
    KvAllocator,
    map_shared,
    pool_tensor,
    read_block_bytes,
    write_block_bytes,
)
from engine.lora.manager import LoraManager
from engine.models.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM, build_decode_stack
from engine.models.mla import MlaAttention, mla_scale
from engine.models.moe import ExpertLoadStats, SparseMoE
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec.verify import accept_greedy, accept_sampled
from kernels import cpu_ops, kv_quant, ops
from kernels.quant import QuantTensor
from protocol.kv_layout import KvLayout
from protocol.logprobs import TokenLogprob, TopLogprob
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.parallel.group import TpGroup


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
        constrained = [i for i, r in enumerate(requests) if r.constrained]
        if constrained:  # unconstrained batches never get here
            logits = _apply_grammars(logits, unbanned, requests, constrained)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = ops.argmax(logits)  # the fast path: no sort, no softmax
        else:
            tokens = self._sample(logits, requests, greedy)
        token_list = tokens.tolist()
        for i, r in enumerate(requests):  # a spent thinking budget: the end marker
            if r.reasoning is not None:
                token_list[i] = r.reasoning.next_token(token_list[i], r.stop_ids)
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
    """Until a request has min_tokens outputs, or while a budget that cut its thinking
    short awaits the answer's first token, its stop tokens cannot be drawn."""
    cloned = False
    for i, r in enumerate(requests):
        owes = r.reasoning is not None and r.reasoning.owes_answer
        if (r.num_output_tokens < r.sampling_params.min_tokens or owes) and r.stop_ids:
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


log = logging.getLogger(__name__)
# a role's start-up stages, printed whatever the log level (diptych/roles.py)
STARTUP = logging.getLogger("diptych.startup")


@dataclass
class StepResult:
    """Per sampled request: the token, and optional logprob and logits row; for a
    request that drafted (speculative decoding), the drafted tokens verification
    accepted, emitted before its token."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    logits: dict[str, torch.Tensor]
    accepted: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPlan:
    """What a step's forward pass needs, as plain values: rank 0 builds it from the
    schedule and, under tensor parallelism, sends it to the other ranks, which run the
    same forward pass on their shards (engine/parallel/)."""

    query_lens: list[int]  # new tokens per sequence, in step order
    starts: list[int]  # tokens each has computed before
    block_ids: list[list[int]]
    input_ids: np.ndarray  # int64 [sum(query_lens)]
    logit_rows: tuple[list[int], ...]  # rows whose logits are wanted, per use
    invariant: int = 0  # `ops.row_invariant`'s rows (a step that verifies drafts)


class ModelRunner:
    # the LoRA adapters' pager when the engine serves adapters (engine/lora/; set by it)
    loras: LoraManager | None = None

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
        kv_pool: torch.Tensor | None = None,
        kv_allocator: KvAllocator | None = None,
        tp: TpGroup | None = None,
    ) -> None:
        """`kv_pool` hands over memory for the KV pool (its size sets the block count);
        `kv_allocator(nbytes, rank)` is called for it once the block count is known
        (from the config's budget); with neither, the pool is an ordinary tensor. With
        `tp` this is one rank's runner: its shard of the weights, its KV heads, and the
        pool's block count rank 0's; rank 0 asks `kv_allocator` for every rank's pool
        (the others map theirs, so that the owner's agent reaches each)."""
        self.tp = tp
        if tp is not None:  # `weights` are this rank's shard (weights_for's `cut`)
            model_config = tp.shard.local_config()
        self.model_config = mc = model_config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if config.threads is not None and self.device.type == "cpu":
            # process-wide: ATen gives every thread that runs a parallel op this count
            torch.set_num_threads(config.threads)
        # the count the engine's ops run with (asked here: another thread that has run no
        # parallel op yet would report OpenMP's default instead)
        self.threads = torch.get_num_threads()
        if self.device.type == "cpu" and self.dtype == torch.float16:
            log.warning("float16 matmul is very slow on most CPUs; prefer bfloat16 or float32")
        self.block_size = config.block_size
        # one kernel selection (kernels/ops.py, from the environment at import)
        # decides the attention backend and every op it and the model run
        kernels = ops.DEFAULT
        self.deterministic = config.deterministic
        # what this engine's bits depend on under --deterministic (None: not on)
        self.numerics: str | None = None
        if self.deterministic:
            check_model(config, mc, self.device, self.dtype)
            self.numerics = numerics(self.device, self.dtype, config.tensor_parallel_size)
        backend_cls = get_backend_class(config.attention_backend, self.device, kernels.selection)
        self.attn_backend = backend_cls(
            mc.num_attention_heads,
            mc.kv_cache_heads,
            mc.kv_cache_dim,
            mla_scale(mc) if mc.mla else mc.head_dim**-0.5,
            mc.sliding_window,
            kernels=kernels,
            deterministic=self.deterministic,
        )
        if isinstance(self.attn_backend, TorchAttention) and not mc.mla:
            # prompts as rows of the batch-invariant kernel where it beats SDPA
            self.attn_backend.prompt_rows = (
                self.device.type == "cpu"
                and kernels.selection.backend == "auto"
                and config.kv_cache_dtype == "auto"
                and cpu_ops.det_attention_for_prompts(self.dtype, self.dtype, mc.head_dim)
            )
        loading = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(mc, self.attn_backend, tp)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.init_rotary(self.device)
        model.load_weights(weights)
        if self.deterministic:
            check_loaded(model)
        self.prepacked = (
            config.cpu_weight_prepack
            and self.device.type == "cpu"
            and cpu_ops.weight_prepack_available(self.dtype)
        )
        if self.prepacked:
            added, released = model.prepack_weights(self.deterministic)
            log.info(
                "prepacked linear weights (+%.0f MB, %.0f MB of plain copies released)",
                added / 1e6, released / 1e6,
            )  # fmt: skip
        self.model = model.eval()
        # routing imbalance of a mixture of experts, step by step (its metrics)
        ep_ranks = config.expert_parallel_size
        self.expert_load = ExpertLoadStats(ep_ranks) if mc.num_experts else None
        self.quantization = quantized_formats(model)
        layers = [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]
        if tp is None:  # the one-call stack has no all-reduce between its layers
            model.model.decode_stack = build_decode_stack(layers, self.attn_backend, self.device)
        if self.quantization:
            fp8_experts = any(isinstance(m, SparseMoE) and m.fp8 for m in model.modules())
            experts = "" if not mc.num_experts else "; the experts " + (
                "in FP8" if fp8_experts else "in " + str(self.dtype).split(".")[-1]
            )
            log.info("linear weights kept quantized (%s%s): %.1f MB of weights in all",
                     self.quantization, experts, weight_bytes(model) / 1e6)  # fmt: skip
        STARTUP.info(
            "weights: %.0f MB of %s loaded in %.1f s%s", weight_bytes(model) / 1e6,
            mc.name or "the model", time.perf_counter() - loading,
            " (prepacked for the GEMM)" if self.prepacked else "",
        )  # fmt: skip
        self.layout = self._make_layout(config, kv_pool)
        if self.tp is not None:
            kv_pool = self._rank_memory(kv_allocator, config.ranks_per_node)
        elif kv_pool is None and kv_allocator is not None:
            memory = kv_allocator(self.layout.total_bytes, 0)
            kv_pool = None if memory is None else memory.tensor
        self.kv_pool = self._make_pool(kv_pool)
        STARTUP.info(
            "KV pool: %d blocks of %d tokens, %.0f MB", self.kv_pool.shape[0], self.block_size,
            self.kv_pool.numel() * self.kv_pool.element_size() / 1e6,
        )  # fmt: skip
        self.kv_layers = [self.kv_pool[:, i] for i in range(mc.num_hidden_layers)]
        self.sampler = Sampler(config.seed, self.device)
        log.info("%s (dtype %s)", self.kernel_summary(), config.dtype)

    def kernel_paths(self) -> dict[str, str]:
        """Device, dtype and the path each kernel takes here (for /metrics and logs)."""
        dtype = str(self.dtype).removeprefix("torch.")
        quant = {"weights": self.quantization or "dense", "kv_cache": self.layout.dtype,
                 "threads": str(self.threads),
                 "tensor_parallel": str(1 if self.tp is None else self.tp.size)}  # fmt: skip
        if self.device.type == "cpu":
            shape = self._attention_shape()
            report = cpu_ops.dispatch_report(self.dtype, self.prepacked, shape, self._kv_quantized)
            if self.deterministic:
                report.update(kernel_paths(self.model))
            return {"device": "cpu", **report, **quant, "decode_layers": self._decode_layers,
                    "deterministic": "yes" if self.deterministic else "no"}  # fmt: skip
        kernels = self.attn_backend.kernels.selection.backend
        paths = {"attention": self.attn_backend.name, **quant, "deterministic": "no"}
        if self.deterministic:
            paths.update(TRITON_PATHS, deterministic="yes")
        return {"device": self.device.type, "dtype": dtype, "kernels": kernels, **paths}

    def kernel_summary(self) -> str:
        """`kernel_paths` as one line (the start-up log, `diptych serve`)."""
        if self.device.type == "cpu":
            line = cpu_ops.describe_dispatch(
                self.dtype, self.prepacked, self._attention_shape(), self._kv_quantized
            )
            plural = "s" if self.threads != 1 else ""
            mode = f"; {SUMMARY}" if self.deterministic else ""
            return (
                f"{line}; weights {self.quantization or 'dense'}; KV cache {self.layout.dtype}; "
                f"{self.threads} thread{plural}; decode layers {self._decode_layers}{mode}"
            )
        return ", ".join(f"{k} {v}" for k, v in self.kernel_paths().items())

    @property
    def _decode_layers(self) -> str:
        """How a decode step runs the layers (engine/models/llama.py)."""
        stack = self.model.model.decode_stack
        if stack and stack.deterministic:
            return "in one op (steps of one token a sequence)"
        return f"in one op (<= {stack.max_rows} rows)" if stack else "loop"

    @property
    def _kv_quantized(self) -> str:
        """The KV cache's quantized format ("int8", "fp8"), or "" (`kernels.kv_quant`)."""
        return kv_quant.format_of(self.layout.dtype)

    def _attention_shape(self) -> tuple[int, int]:
        mc = self.model_config
        return mc.num_attention_heads // mc.kv_cache_heads, mc.kv_cache_dim

    # -- KV pool ---------------------------------------------------------------

    def _make_layout(self, config: EngineConfig, kv_pool: torch.Tensor | None) -> KvLayout:
        mc = self.model_config
        per_block = KvLayout(
            num_blocks=1,
            num_layers=mc.num_hidden_layers,
            block_size=self.block_size,
            num_kv_heads=mc.kv_cache_heads,
            head_dim=mc.kv_cache_dim,
            kv_planes=mc.kv_planes,
            dtype=kv_dtype(config, self.dtype),
            model=mc.name,
            tp_size=1 if self.tp is None else self.tp.size,
            model_kv_heads=0 if self.tp is None else self.tp.shard.model.kv_cache_heads,
        )
        if self.tp is not None and self.tp.rank:  # every rank holds rank 0's block count
            return per_block.with_blocks(int(self.tp.broadcast()))
        if kv_pool is not None:
            num_blocks = kv_pool.numel() * kv_pool.element_size() // per_block.block_bytes
        elif config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_cache_memory_bytes
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used_elsewhere = total - free
                budget = int(total * config.gpu_memory_utilization) - used_elsewhere
            num_blocks = budget // per_block.block_bytes
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget holds {num_blocks} blocks of {per_block.block_bytes} bytes; "
                "need at least 2 (raise kv_cache_memory_bytes or num_blocks)"
            )
        if self.tp is not None:
            self.tp.broadcast(int(num_blocks))
        return per_block.with_blocks(int(num_blocks))

    def _verify(
        self, logits: torch.Tensor, drafting: list[ScheduledRequest], result: StepResult
    ) -> None:
        """Verification of drafted tokens (engine/spec/verify.py) from the logits at a
        request's last token and each draft: greedy requests accept the drafts the
        argmax agrees with, then the argmax; sampled ones take the rejection rule."""
        target = self.attn_backend.kernels.argmax(logits).tolist()
        at = 0
        for s in drafting:
            k = len(s.draft)
            if s.request.sampling_params.greedy:
                emitted = accept_greedy(s.draft, target[at : at + k + 1])
            else:
                emitted = self.sampler.verify(logits[at : at + k + 1], s.request, s.draft)
            at += k + 1
            result.tokens[s.request.request_id] = emitted[-1]
            result.accepted[s.request.request_id] = emitted[:-1]

    def _rank_memory(self, kv_allocator: KvAllocator | None, local: int) -> torch.Tensor | None:
        """This rank's pool memory: rank 0 asks the owner for the pools of this host's
        `local` ranks and sends each rank the path of its own (None: the rank allocates
        its pool itself, as another host's ranks do)."""
        assert self.tp is not None
        if self.tp.rank:
            path = self.tp.broadcast()[self.tp.rank]
            return None if path is None else map_shared(path, self.layout.total_bytes)
        paths: list[str | None] = [None] * self.tp.size
        mine = None
        if kv_allocator is not None:
            for rank in range(local):
                memory = kv_allocator(self.layout.total_bytes, rank)
                if memory is None:  # that rank allocates its own
                    continue
                if rank == 0:
                    mine = memory.tensor
                elif memory.path is None:
                    raise ValueError(f"the KV pool of tensor-parallel rank {rank} must be "
                                     "shared memory its process can map (a path)")  # fmt: skip
                paths[rank] = memory.path
        self.tp.broadcast(paths)
        return mine

    @property
    def tier_block_bytes(self) -> int:
        """A block's bytes (what a KV tier's budget counts)."""
        return self.layout.block_bytes

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Blocks' bytes, copied to the host (a KV tier's offload)."""
        return read_block_bytes(self.kv_pool, block_ids)

    def write_blocks(self, block_ids: list[int], rows: list[torch.Tensor]) -> None:
        """`read_blocks`' bytes back into blocks (fresh ones: a KV tier's restore)."""
        write_block_bytes(self.kv_pool, block_ids, rows)

    def _make_pool(self, kv_pool: torch.Tensor | None) -> torch.Tensor:
        return pool_tensor(self.layout, self.device, kv_pool)

    # -- the step --------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepResult:
        # Decodes (one new token) first, then verifications of drafted tokens, so
        # attention can batch them all as decode rows.
        items = sorted(sched.scheduled, key=_step_order)
        lens = [s.num_new_tokens for s in items]
        ends = np.cumsum(lens).tolist()
        ids = np.fromiter(
            (
                t
                for s in items
                for t in (
                    s.request.all_token_ids[s.start : s.start + s.num_new_tokens - len(s.draft)]
                    + s.draft
                )
            ),
            dtype=np.int64,
            count=ends[-1] if ends else 0,
        )
        drafting = [s for s in items if s.draft]
        sampling = [s.request for s in items if s.samples and not s.draft]
        verify_rows = [r for e, s in zip(ends, items) if s.draft
                       for r in range(e - s.num_new_tokens, e)]  # fmt: skip
        sample_rows = [e - 1 for e, s in zip(ends, items) if s.samples and not s.draft]
        # A step that verifies drafts runs row-invariant linears (where its rows fit
        # them), so each row's logits are those of a plain decode step: speculation
        # then leaves greedy output as it is without drafts, in bf16 too.
        small = len(ids) <= cpu_ops.SMALL_M_MAX
        plan = StepPlan(
            lens, [s.start for s in items], [block_ids[s.request.request_id] for s in items],
            ids, (verify_rows, sample_rows), cpu_ops.SMALL_M_MAX if drafting and small else 0,
        )  # fmt: skip
        if self.tp is not None:
            self.tp.broadcast(plan)
        loras = self.loras
        if loras is not None:  # each row's adapter slot (the base model's rows: -1)
            refs = [s.request.lora for s in items]
            loras.slots.set_step(*loras.step_slots(refs, lens, self.device))
        try:
            verify_logits, logits = self.forward(plan)
        except BaseException:
            if self.tp is not None:
                self.tp.broken = True
            raise
        finally:
            if loras is not None:
                loras.slots.set_step(None, frozenset())
        result = StepResult({}, {}, {})
        if verify_logits is not None:
            self._verify(verify_logits, drafting, result)
        if logits is None:
            return result
        return self._sampled(logits, sampling, result)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> list[torch.Tensor | None]:
        """Run a step's forward pass; the fp32 logits of each of `plan.logit_rows` (None
        where it is empty). Every rank of a tensor-parallel group runs it on the same plan."""
        layout = BatchLayout.build(
            plan.query_lens, plan.starts, plan.block_ids, self.block_size, self.device
        )
        input_ids = torch.from_numpy(plan.input_ids).to(self.device)
        positions = torch.from_numpy(layout.positions).to(self.device)
        meta = self.attn_backend.prepare(layout)
        with ops.row_invariant(plan.invariant), ops.deterministic(self.deterministic):
            step = self.model.step_inputs(positions, meta)
            hidden = self.model(input_ids, self.kv_layers, step)
            if self.expert_load is not None:
                self.expert_load.record(
                    self.model, self.tp.all_to_all_bytes if self.tp is not None else 0
                )
            return [
                self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
                if rows else None
                for rows in plan.logit_rows
            ]  # fmt: skip

    def _sampled(
        self, logits: torch.Tensor, reqs: list[Request], result: StepResult
    ) -> StepResult:
        out = self.sampler(logits, reqs)
        for j, r in enumerate(reqs):
            rid = r.request_id
            result.tokens[rid] = out.token_ids[j]
            lp = out.logprobs[j]
            if lp is not None:
                result.logprobs[rid] = lp
            if r.sampling_params.output_logits:
                result.logits[rid] = logits[j].float().cpu()
        return result


def _step_order(s: ScheduledRequest) -> int:
    """Decodes, then drafted verifications, then prompt chunks."""
    return 0 if s.num_new_tokens == 1 else 1 if s.draft else 2


def kv_dtype(config: EngineConfig, dtype: torch.dtype) -> str:
    """The KV pool's dtype name (`KvLayout.dtype`): the model's, or `kv_cache_dtype`."""
    if config.kv_cache_dtype == "auto":
        return str(dtype).removeprefix("torch.")
    return kv_quant.POOL_DTYPES[config.kv_cache_dtype]


def quantized_formats(model: LlamaForCausalLM) -> str:
    """The quantized formats the model's weights are kept in ("Q4_1+Q8_0"), or ""."""
    parts = [q for m in model.modules() if isinstance(m, Linear) for q in m.quant]
    if model.model.embed_quant is not None:
        parts.append(model.model.embed_quant)
    return "+".join(sorted({p.source for p in parts}))


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every weight the model holds: parameters, packed copies, quantized ones."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, Linear):
            total += sum(q.nbytes for q in m.quant)
            total += m.packed.data.nbytes if m.packed is not None else 0
        if isinstance(m, SparseMoE) and m.fp8 is not None:
            total += sum(w.nbytes for w in m.fp8)
        if isinstance(m, MlaAttention):  # kv_b_proj, split for the absorbed attention
            total += sum(w.numel() * w.element_size() for w in m.absorbed())
    if model.model.embed_quant is not None:
        total += model.model.embed_quant.nbytes
    if model.packed_head is not None:
        total += model.packed_head.data.nbytes
    return total

"""Owns the model weights and the KV pool; turns a scheduled step into sampled tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from engine.attention import BatchLayout, get_backend_class
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.layout import pool_tensor
from engine.models.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM, build_decode_stack
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec.verify import accept_greedy
from kernels import cpu_ops, kv_quant, ops
from kernels.quant import QuantTensor
from protocol.kv_layout import KvLayout
from protocol.logprobs import TokenLogprob

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


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
        kv_pool: torch.Tensor | None = None,
        kv_allocator: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`kv_pool` hands over memory for the KV pool (its size sets the block count);
        `kv_allocator(nbytes)` is called for it once the block count is known (from
        the config's budget); with neither, the pool is an ordinary tensor."""
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
        backend_cls = get_backend_class(config.attention_backend, self.device, kernels.selection)
        self.attn_backend = backend_cls(
            mc.num_attention_heads,
            mc.num_key_value_heads,
            mc.head_dim,
            mc.head_dim**-0.5,
            mc.sliding_window,
            kernels=kernels,
        )
        loading = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(mc, self.attn_backend)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.init_rotary(self.device)
        model.load_weights(weights)
        self.prepacked = (
            config.cpu_weight_prepack
            and self.device.type == "cpu"
            and cpu_ops.weight_prepack_available(self.dtype)
        )
        if self.prepacked:
            added, released = model.prepack_weights()
            log.info(
                "prepacked linear weights (+%.0f MB, %.0f MB of plain copies released)",
                added / 1e6, released / 1e6,
            )  # fmt: skip
        self.model = model.eval()
        self.quantization = quantized_formats(model)
        layers = [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]
        model.model.decode_stack = build_decode_stack(layers, self.attn_backend, self.device)
        if self.quantization:
            log.info("linear weights kept quantized (%s): %.1f MB of weights in all",
                     self.quantization, weight_bytes(model) / 1e6)  # fmt: skip
        STARTUP.info(
            "weights: %.0f MB of %s loaded in %.1f s%s", weight_bytes(model) / 1e6,
            mc.name or "the model", time.perf_counter() - loading,
            " (prepacked for the GEMM)" if self.prepacked else "",
        )  # fmt: skip
        self.layout = self._make_layout(config, kv_pool)
        if kv_pool is None and kv_allocator is not None:
            kv_pool = kv_allocator(self.layout.total_bytes)
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
                 "threads": str(self.threads)}  # fmt: skip
        if self.device.type == "cpu":
            shape = self._attention_shape()
            report = cpu_ops.dispatch_report(self.dtype, self.prepacked, shape, self._kv_quantized)
            return {"device": "cpu", **report, **quant, "decode_layers": self._decode_layers}
        kernels = self.attn_backend.kernels.selection.backend
        return {"device": self.device.type, "dtype": dtype, "kernels": kernels,
                "attention": self.attn_backend.name, **quant}  # fmt: skip

    def kernel_summary(self) -> str:
        """`kernel_paths` as one line (the start-up log, `diptych serve`)."""
        if self.device.type == "cpu":
            line = cpu_ops.describe_dispatch(
                self.dtype, self.prepacked, self._attention_shape(), self._kv_quantized
            )
            plural = "s" if self.threads != 1 else ""
            return (
                f"{line}; weights {self.quantization or 'dense'}; KV cache {self.layout.dtype}; "
                f"{self.threads} thread{plural}; decode layers {self._decode_layers}"
            )
        return ", ".join(f"{k} {v}" for k, v in self.kernel_paths().items())

    @property
    def _decode_layers(self) -> str:
        """How a decode step runs the layers (engine/models/llama.py)."""
        stack = self.model.model.decode_stack
        return f"in one op (<= {stack.max_rows} rows)" if stack else "loop"

    @property
    def _kv_quantized(self) -> str:
        """The KV cache's quantized format ("int8", "fp8"), or "" (`kernels.kv_quant`)."""
        return kv_quant.format_of(self.layout.dtype)

    def _attention_shape(self) -> tuple[int, int]:
        mc = self.model_config
        return mc.num_attention_heads // mc.num_key_value_heads, mc.head_dim

    # -- KV pool ---------------------------------------------------------------

    def _make_layout(self, config: EngineConfig, kv_pool: torch.Tensor | None) -> KvLayout:
        mc = self.model_config
        per_block = KvLayout(
            num_blocks=1,
            num_layers=mc.num_hidden_layers,
            block_size=self.block_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=kv_dtype(config, self.dtype),
            model=mc.name,
        )
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
        return per_block.with_blocks(int(num_blocks))

    def _verify(
        self,
        hidden: torch.Tensor,
        layout: BatchLayout,
        drafting: list[tuple[int, ScheduledRequest]],
        result: StepResult,
    ) -> None:
        """Verification of drafted tokens (engine/spec/verify.py) from the logits at a
        request's last token and each draft: greedy requests accept the drafts the
        argmax agrees with, then the argmax; sampled ones take the rejection rule."""
        qsl = layout.query_start_loc
        rows = [r for i, _ in drafting for r in range(int(qsl[i]), int(qsl[i + 1]))]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        target = self.attn_backend.kernels.argmax(logits).tolist()
        at = 0
        for _, s in drafting:
            k = len(s.draft)
            if s.request.sampling_params.greedy:
                emitted = accept_greedy(s.draft, target[at : at + k + 1])
            else:
                emitted = self.sampler.verify(logits[at : at + k + 1], s.request, s.draft)
            at += k + 1
            result.tokens[s.request.request_id] = emitted[-1]
            result.accepted[s.request.request_id] = emitted[:-1]

    def _make_pool(self, kv_pool: torch.Tensor | None) -> torch.Tensor:
        return pool_tensor(self.layout, self.device, kv_pool)

    # -- the step --------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepResult:
        # Decodes (one new token) first, then verifications of drafted tokens, so
        # attention can batch them all as decode rows.
        items = sorted(sched.scheduled, key=_step_order)
        layout = BatchLayout.build(
            [s.num_new_tokens for s in items],
            [s.start for s in items],
            [block_ids[s.request.request_id] for s in items],
            self.block_size,
            self.device,
        )
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
            count=layout.num_tokens,
        )
        input_ids = torch.from_numpy(ids).to(self.device)
        positions = torch.from_numpy(layout.positions).to(self.device)
        meta = self.attn_backend.prepare(layout)
        drafting = [(i, s) for i, s in enumerate(items) if s.draft]
        # A step that verifies drafts runs row-invariant linears (where its rows fit
        # them), so each row's logits are those of a plain decode step: speculation
        # then leaves greedy output as it is without drafts, in bf16 too.
        small = layout.num_tokens <= cpu_ops.SMALL_M_MAX
        invariant = cpu_ops.SMALL_M_MAX if drafting and small else 0
        with ops.row_invariant(invariant):
            return self._run(items, layout, input_ids, positions, meta, drafting)

    def _run(
        self,
        items: list[ScheduledRequest],
        layout: BatchLayout,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: object,
        drafting: list[tuple[int, ScheduledRequest]],
    ) -> StepResult:
        hidden = self.model(input_ids, self.kv_layers, self.model.step_inputs(positions, meta))
        result = StepResult({}, {}, {})
        if drafting:
            self._verify(hidden, layout, drafting, result)
        sampling = [(i, s.request) for i, s in enumerate(items) if s.samples and not s.draft]
        if not sampling:
            return result
        rows = torch.tensor([int(layout.query_start_loc[i + 1]) - 1 for i, _ in sampling])
        logits = self.model.compute_logits(hidden[rows.to(self.device)])
        reqs = [r for _, r in sampling]
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
    if model.model.embed_quant is not None:
        total += model.model.embed_quant.nbytes
    if model.packed_head is not None:
        total += model.packed_head.data.nbytes
    return total

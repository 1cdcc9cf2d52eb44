"""Offline API: `LLM(model=None).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import NewRequest
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.weights import resolve_model
from protocol.logprobs import TokenLogprob
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    logits: list[torch.Tensor] | None = None
    num_cached_tokens: int = 0
    num_reasoning_tokens: int = 0  # of a reasoning model's output (engine/reasoning.py)
    prompt: str | None = None


class LLM:
    """A model with its tokenizer and an engine, for batch generation in-process.

    Extra keyword arguments are `EngineConfig` fields (block_size, num_blocks,
    max_num_batched_tokens, enable_prefix_caching, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        self._start(EngineConfig(model=model, dtype=name, device=device, **engine_kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.tokenizer = Tokenizer.from_source(resolve_model(config.model))
        self.engine = EngineCore(config, eos_token_ids=self.tokenizer.eos_token_ids)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing else needs closing)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora: AdapterRef | Sequence[AdapterRef | None] | None = None,
    ) -> list[CompletionResult]:
        """Generate for each prompt (text or token ids); results in prompt order.
        `lora`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), with `enable_lora=True`."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        adapters = _per_prompt_lora(lora, len(batch))
        results: dict[str, CompletionResult] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        try:
            for i, (prompt, p) in enumerate(zip(batch, params)):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"llm-{next(self._ids)}"
                self.engine.submit(NewRequest(rid, ids, p, priority=priority[i] if priority else 0,
                                              lora=adapters[i]))  # fmt: skip
                res = CompletionResult(rid, ids, prompt=prompt if isinstance(prompt, str) else None)
                res.logprobs = [] if p.logprobs is not None else None
                res.logits = [] if p.output_logits else None
                results[rid] = res
                detoks[rid] = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop
                )
                order.append(rid)
            self._run(results, detoks)
        finally:
            for rid in order:
                if rid in self.engine.scheduler.requests:
                    self.engine.abort_request(rid)
        return [results[rid] for rid in order]

    def _run(
        self, results: dict[str, CompletionResult], detoks: dict[str, IncrementalDetokenizer]
    ) -> None:
        pending = set(results)
        while pending:
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None or out.request_id not in pending:
                    continue
                res.token_ids.extend(out.new_token_ids)
                res.num_cached_tokens = out.num_cached_tokens
                res.num_reasoning_tokens = out.num_reasoning_tokens
                if res.logprobs is not None and out.new_logprobs:
                    res.logprobs.extend(out.new_logprobs)
                if res.logits is not None and out.new_logits:
                    res.logits.extend(out.new_logits)
                det = detoks[out.request_id]
                det.push(out.new_token_ids)
                if det.stopped:
                    self.engine.abort_request(out.request_id)
                    res.finish_reason, res.stop_reason = "stop", det.stop_reason
                elif out.finished:
                    det.flush()
                    res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
                else:
                    continue
                res.text = det.text
                pending.discard(out.request_id)
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionResult]:
        """Apply the model's chat template to one conversation or several, then generate."""
        convs: Sequence[Sequence[Mapping[str, Any]]]
        if messages and isinstance(messages[0], Mapping):
            convs = [messages]  # type: ignore[list-item]
        else:
            convs = messages  # type: ignore[assignment]
        prompts: list[Prompt] = [self.tokenizer.apply_chat_template(c) for c in convs]
        return self.generate(prompts, sampling_params)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [[int(t) for t in prompts]]  # type: ignore[arg-type]
    batch: list[Prompt] = list(prompts)  # type: ignore[arg-type]
    for p in batch:
        if not isinstance(p, (str, list)):
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(p).__name__}")
    return batch


def _per_prompt_lora(
    lora: AdapterRef | Sequence[AdapterRef | None] | None, n: int
) -> list[AdapterRef | None]:
    if lora is None or isinstance(lora, AdapterRef):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"{len(lora)} LoRA adapters for {n} prompts")
    return list(lora)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)

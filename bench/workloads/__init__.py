"""Workloads: lists of `Request`s built with the served model's tokenizer."""

from __future__ import annotations

import dataclasses

from bench.request import Request
from bench.workloads.files import from_file
from bench.workloads.multiturn import agentic, multiturn
from bench.workloads.spec import WORKLOADS, WorkloadSpec
from bench.workloads.synthetic import bursty, random_lengths, reasoning, sharegpt_like
from bench.workloads.tokens import PromptBuilder, load_tokenizer

__all__ = [
    "WORKLOADS",
    "PromptBuilder",
    "WorkloadSpec",
    "build_workload",
    "load_tokenizer",
    "reseeded",
]


def build_workload(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    """The requests of `spec`, the same for the same spec and tokenizer."""
    spec.validate()
    if spec.name == "random":
        return random_lengths(spec, builder)
    if spec.name == "sharegpt":
        return from_file(spec, builder) if spec.dataset_path else sharegpt_like(spec, builder)
    if spec.name == "bursty":
        return bursty(spec, builder)
    if spec.name == "multiturn":
        return multiturn(spec, builder)
    if spec.name == "agentic":
        return agentic(spec, builder)
    if spec.name == "reasoning":
        return reasoning(spec, builder)
    return from_file(spec, builder)


def reseeded(spec: WorkloadSpec, salt: int) -> WorkloadSpec:
    """The same workload with fresh prompts (a sweep's later rate must not hit the cache)."""
    return dataclasses.replace(spec, seed=spec.seed + 1_000_003 * salt)

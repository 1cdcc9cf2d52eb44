"""Prompts from a file: JSON lines, plain text lines, or a ShareGPT JSON dump.

- `.jsonl`: one object per line with "prompt" (str) and optionally the output length
  as "output_tokens", "output_len" or "max_tokens" (vLLM's custom dataset format).
- `.txt`: one prompt per line (blank lines skipped).
- `.json`: ShareGPT format, a list of {"conversations": [{"from": "human", "value":
  ...}, {"from": "gpt", "value": ...}, ...]}; the first human turn is the prompt and
  the reply's token count its output length, filtered as vLLM filters ShareGPT.

Prompts are counted with the tokenizer; the first `num_prompts` usable ones are
taken in order, or a seeded sample of them for ShareGPT (as vLLM does).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from bench.request import Request
from bench.workloads.spec import WorkloadSpec
from bench.workloads.synthetic import SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN
from bench.workloads.tokens import PromptBuilder

_OUTPUT_KEYS = ("output_tokens", "output_len", "max_tokens")


def from_file(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    if not spec.dataset_path:
        raise ValueError("--dataset-path is required for prompts from a file")
    path = Path(spec.dataset_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path} is not a file")
    if path.suffix == ".json":
        requests = _sharegpt(path, spec, builder)
    else:
        requests = [
            Request(p, builder.count(p), n or spec.custom_output_len, tag="file")
            for p, n in _lines(path)
        ]
        requests = requests[: spec.num_prompts]
    if not requests:
        raise ValueError(f"{path} holds no usable prompts")
    if len(requests) < spec.num_prompts:
        raise ValueError(
            f"{path} holds {len(requests)} usable prompts, fewer than --num-prompts "
            f"{spec.num_prompts}"
        )
    return requests


def _lines(path: Path) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                out.append((line.rstrip("\n"), None))
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a "prompt" string')
            out.append((row["prompt"], _output_len(row, path, lineno)))
    return out


def _output_len(row: dict[str, Any], path: Path, lineno: int) -> int | None:
    for key in _OUTPUT_KEYS:
        if key in row:
            value = row[key]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}:{lineno}: {key} must be a positive integer")
            return value
    return None


def _sharegpt(path: Path, spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a ShareGPT list of conversations")
    pairs = [
        (c[0]["value"], c[1]["value"])
        for row in data
        if isinstance(row, dict)
        and isinstance(c := row.get("conversations"), list)
        and len(c) >= 2
        and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in c[:2])
    ]
    random.Random(spec.seed).shuffle(pairs)
    out: list[Request] = []
    for prompt, reply in pairs:
        if len(out) == spec.num_prompts:
            break
        n_in = builder.count(prompt)
        n_out = spec.sharegpt_output_len or builder.count(reply)
        if min(n_in, n_out) < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT or n_in + n_out > SHAREGPT_MAX_TOTAL:
            continue
        out.append(Request(prompt, n_in, n_out, tag="sharegpt"))
    return out

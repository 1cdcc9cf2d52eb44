"""The result JSON of one run, with `vllm bench serve`'s keys, and where it is saved.

Keys shared with vLLM: date, endpoint_type, backend, label, model_id, tokenizer_id,
num_prompts, request_rate ("inf" or a number), burstiness, max_concurrency, duration,
completed, failed, total_input_tokens, total_output_tokens, request_throughput,
request_goodput (None without --goodput), output_throughput, total_token_throughput,
max_output_tokens_per_s, max_concurrent_requests, latencies, queue_times, and
{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms; with --save-detailed also input_lens,
output_lens, ttfts, itls, start_times, generated_texts, errors. Ours in addition:
dataset_name, seed, ignore_eos, goodput_config, good_requests, and per_tag (the
figures of each request class, e.g. the bursty mix's "short" and "long").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.metrics import METRIC_NAMES, RequestResult, compute_metrics, queue_metrics

DETAILED_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
)


def assemble(
    config: BenchConfig,
    *,
    model_id: str,
    tokenizer_id: str,
    rate: float,
    results: Sequence[RequestResult],
    duration: float,
    date: str,
) -> dict[str, Any]:
    """The JSON document of one run (detailed keys included; `save` drops them)."""
    metric_names = [m for m in config.percentile_metrics if m in METRIC_NAMES]
    out: dict[str, Any] = {
        "date": date,
        "endpoint_type": config.backend,
        "backend": config.backend,
        "label": config.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(results),
        **config.metadata,
        "request_rate": rate if not math.isinf(rate) else "inf",
        "burstiness": config.burstiness,
        "time_scale": config.time_scale,
        "max_concurrency": config.max_concurrency,
        "dataset_name": config.workload.name,
        "seed": config.seed,
        "ignore_eos": config.ignore_eos,
        "goodput_config": dict(config.goodput) or None,
        "duration": duration,
    }
    out.update(compute_metrics(results, duration, config.percentiles, config.goodput, metric_names))
    if config.max_concurrency is not None:
        queue = queue_metrics(results, config.percentiles, include_e2el=not math.isinf(rate))
        out.update({k: v for k, v in queue.items() if _selected(k, config.percentile_metrics)})
    tags = sorted({r.tag for r in results})
    if len(tags) > 1:
        out["per_tag"] = {
            tag: compute_metrics(
                [r for r in results if r.tag == tag],
                duration,
                config.percentiles,
                config.goodput,
                metric_names,
            )
            for tag in tags
        }
    out.update(
        {
            "latencies": [r.latency for r in results],
            "queue_times": [r.queue_time for r in results],
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
        }
    )
    return out


def _selected(key: str, metrics: Sequence[str]) -> bool:
    return any(key.endswith(f"_{m}_ms") for m in metrics if m not in METRIC_NAMES)


def result_path(config: BenchConfig, model_id: str, rate: float, date: str) -> Path:
    """vLLM's name, {label}-{rate}qps[-concurrencyN]-{model}-{date}.json, in --result-dir."""
    label = config.label or config.backend
    conc = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    base = model_id.split("/")[-1]
    name = f"{label}-{float(rate)}qps{conc}-{base}-{date}.json"
    if config.result_filename:
        name = config.result_filename
        if config.sweep:
            p = Path(name)
            name = f"{p.stem}-{float(rate)}qps{p.suffix or '.json'}"
    return Path(config.result_dir or ".") / name


def sweep_path(config: BenchConfig, model_id: str, date: str, suffix: str) -> Path:
    label = config.label or config.backend
    base = model_id.split("/")[-1]
    return Path(config.result_dir or ".") / f"{label}-sweep-{base}-{date}{suffix}"


def save(doc: dict[str, Any], path: Path, detailed: bool) -> None:
    if not detailed:
        doc = {k: v for k, v in doc.items() if k not in DETAILED_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def summary_row(doc: dict[str, Any]) -> dict[str, Any]:
    """The scalar figures of a run (what a sweep summary and its plot need)."""
    drop = (*DETAILED_KEYS, "latencies", "queue_times")
    return {k: v for k, v in doc.items() if k not in drop}

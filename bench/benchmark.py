"""One benchmark invocation: a run per request rate, results printed and saved.

For each rate: build the workload (fresh seeded prompts per rate in a sweep, so an
earlier rate's prefix cache does not help a later one), warm up, run, print the
table, and save the JSON. A sweep (several rates) always saves one JSON per rate, a
summary JSON and a PNG of the latency, throughput and goodput curves.
"""

from __future__ import annotations

import math
import sys
from datetime import datetime
from typing import Any

import httpx

from bench.client import Endpoint, OpenAIClient
from bench.config import BenchConfig
from bench.plot import plot_sweep
from bench.progress import Progress
from bench.report import format_result, format_sweep, operating_point
from bench.results import assemble, result_path, save, summary_row, sweep_path
from bench.runner import run_load, wait_ready, warm_up
from bench.workloads import PromptBuilder, build_workload, load_tokenizer, reseeded


def first_model(base_url: str, headers: dict[str, str], timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists at /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(
            f"could not list models at {url} ({e}); is the server up? (or pass --model)"
        ) from None
    if not data:
        raise ValueError(f"the server at {url} lists no models; pass --model")
    return str(data[0]["id"])


def _log(msg: str) -> None:
    print(msg, flush=True)


async def run_benchmark(
    config: BenchConfig, builder: PromptBuilder | None = None
) -> list[dict[str, Any]]:
    """Run every rate of `config`; returns the result documents (detailed keys included)."""
    config.validate()
    model = config.model or first_model(config.base_url, config.headers)
    if builder is None:
        builder = PromptBuilder(load_tokenizer(config.tokenizer), name=config.tokenizer or "")
    tokenizer_id = config.tokenizer or builder.name or "default"
    if "temperature" not in config.extra_body:
        _log("note: no --temperature given; the server's default sampling applies")
    endpoint = Endpoint(
        api_url=config.api_url,
        model=model,
        chat=config.chat,
        ignore_eos=config.ignore_eos,
        extra_body=config.extra_body,
        headers=config.headers,
        session_header=config.session_header,
    )
    client = OpenAIClient(endpoint, timeout_s=config.request_timeout_s, count_tokens=builder.count)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    docs: list[dict[str, Any]] = []
    try:
        if config.ready_check_timeout_s > 0:
            probe = build_workload(reseeded(config.workload, -1), builder)[0]
            ready = await wait_ready(probe, client.send, config.ready_check_timeout_s)
            if not ready.success:
                raise ValueError(f"the server never answered a test request: {ready.error}")
        for i in range(len(config.rates)):
            docs.append(await _run_rate(config, client, builder, model, tokenizer_id, i, date))
    finally:
        await client.aclose()
    if config.sweep:
        _finish_sweep(config, model, date, docs)
    return docs


async def _run_rate(
    config: BenchConfig,
    client: OpenAIClient,
    builder: PromptBuilder,
    model: str,
    tokenizer_id: str,
    index: int,
    date: str,
) -> dict[str, Any]:
    rate = config.rates[index]
    spec = reseeded(config.workload, index) if index else config.workload
    requests = build_workload(spec, builder)
    if config.num_warmups:
        warm_spec = reseeded(config.workload, 10_000 + index)
        warm = build_workload(warm_spec, builder)[: config.num_warmups]
        _log(f"warming up with {len(warm)} requests")
        await warm_up(warm, client.send, config.max_concurrency)
    burst = "Poisson process" if config.burstiness == 1 else "gamma distribution"
    _log(
        f"traffic request rate: {rate:g} req/s, burstiness {config.burstiness:g} ({burst}), "
        f"max concurrency: {config.max_concurrency}, {len(requests)} requests "
        f"({spec.name}), model {model} at {config.api_url}"
    )
    progress = Progress(len(requests), label=f"rate {rate:g}", enabled=config.progress)
    out = await run_load(
        requests,
        client.send,
        rate=rate,
        burstiness=config.burstiness,
        seed=config.seed + index,
        max_concurrency=config.max_concurrency,
        progress=progress,
        time_scale=config.time_scale,
    )
    doc = assemble(
        config,
        model_id=model,
        tokenizer_id=tokenizer_id,
        rate=rate,
        results=out.results,
        duration=out.duration,
        date=date,
    )
    print(format_result(doc, config.percentiles, doc["errors"]), flush=True)
    if doc["completed"] == 0:
        print("warning: every request failed; check the endpoint and model", file=sys.stderr)
    if config.save_result or config.sweep:
        path = result_path(config, model, rate, date)
        save(doc, path, config.save_detailed)
        _log(f"saved {path}")
    return doc


def _finish_sweep(config: BenchConfig, model: str, date: str, docs: list[dict[str, Any]]) -> None:
    rows = sorted((summary_row(d) for d in docs), key=_rate_key)
    print(format_sweep(rows, config.goodput), flush=True)
    point = operating_point(rows) if config.goodput else None
    summary = {
        "date": date,
        "label": config.label,
        "backend": config.backend,
        "model_id": model,
        "dataset_name": config.workload.name,
        "goodput_config": config.goodput or None,
        "operating_point": None if point is None else point["request_rate"],
        "runs": rows,
    }
    path = sweep_path(config, model, date, ".json")
    save(summary, path, detailed=True)
    _log(f"saved {path}")
    png = config.plot or str(sweep_path(config, model, date, ".png"))
    title = f"{config.label or config.backend}: {config.workload.name}, {model}"
    try:
        _log(f"saved {plot_sweep({config.label or model: rows}, png, config.goodput, title)}")
    except RuntimeError as e:
        print(f"warning: no plot: {e}", file=sys.stderr)


def _rate_key(row: dict[str, Any]) -> float:
    r = row["request_rate"]
    return math.inf if r == "inf" else float(r)

"""Everything one `diptych bench` invocation needs, as one typed record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.workloads.spec import WorkloadSpec


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    backend: str = "openai"  # "openai" (completions) or "openai-chat"
    model: str | None = None  # None: the first model the server lists
    tokenizer: str | None = None  # .gguf / HF directory; None: Diptych's default model
    label: str | None = None
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    rates: list[float] = field(default_factory=lambda: [float("inf")])
    burstiness: float = 1.0
    time_scale: float = 1.0  # simulated seconds per wall second of a dilated server
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    session_header: bool = False  # X-Session-Id on each multi-turn request
    goodput: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 95.0, 99.0])
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl", "e2el"])
    num_warmups: int = 0
    ready_check_timeout_s: float = 0.0
    request_timeout_s: float = 6 * 3600.0
    save_result: bool = False
    save_detailed: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
    plot: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    progress: bool = True

    @property
    def chat(self) -> bool:
        return self.backend == "openai-chat"

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def sweep(self) -> bool:
        return len(self.rates) > 1

    def validate(self) -> None:
        self.workload.validate()
        if self.backend not in ("openai", "openai-chat", "vllm"):
            raise ValueError(f"--backend {self.backend!r}: choose openai or openai-chat")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        known = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
        for m in self.percentile_metrics:
            if m not in known:
                raise ValueError(f"--percentile-metrics: {m!r} is not one of {', '.join(known)}")
        for p in self.percentiles:
            if not 0 <= p <= 100:
                raise ValueError(f"--metric-percentiles: {p} is not in [0, 100]")

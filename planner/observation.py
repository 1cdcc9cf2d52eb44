"""What the planner knows at one tick: the fleet's load over the last interval and the
replicas each pool has, as plain data (OBSERVE fills it in from Prometheus metrics,
the simulator from its own counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Slo:
    """The latency targets attainment is measured against (p99 targets, seconds)."""

    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class WorkerState:
    """One worker as its last scrape shows it."""

    worker_id: str
    pool: str
    running: int = 0  # requests in its batch (a prefill worker: prefills under way)
    waiting: int = 0  # queued for a batch slot (decode workers)
    kv_usage: float | None = None  # fraction of its KV blocks in use
    started: float | None = None  # Unix time its process started
    ready_s: float | None = None  # seconds from that start to ready (registered)


@dataclass(frozen=True)
class Observation:
    """The last interval, ending at `time` (seconds on the caller's clock).

    Latency percentiles are None when no request finished in the interval; queue and
    KV fields are fleet-wide (queue depth summed, age the oldest, KV usage the mean
    fraction of a pool's blocks in use).
    """

    time: float
    request_rate: float = 0.0  # requests/s that arrived
    mean_input_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    # the mean of squared prompt lengths (0: unknown): how much prefill times vary,
    # which sets how long prompts queue behind long ones
    mean_input_tokens_sq: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    # the share of requests whose TTFT, and of token gaps whose ITL, was within the
    # target; counted from the histogram buckets up to the largest bound not above the
    # target, so a lower bound when the target falls inside a bucket (None: no SLO
    # given, or nothing measured)
    ttft_attainment: float | None = None
    itl_attainment: float | None = None
    prefill_queue_depth: int = 0
    prefill_queue_age_s: float = 0.0
    kv_usage: dict[str, float] = field(default_factory=dict)  # pool -> used fraction
    running_requests: int = 0  # in the decode workers' batches
    waiting_requests: int = 0  # queued in the decode workers for a batch slot
    in_flight: int = 0  # requests the frontends hold (running, queued or prefilling)
    held: int = 0  # of those, waiting for a decode worker to join (the pool has none)
    # requests/s the frontends refused: 429 (shed, the decode pool saturated) and 503
    # (no worker to serve, or too many held)
    refused_429_rate: float = 0.0
    refused_503_rate: float = 0.0
    # thinking tokens/s the decode workers generate (reasoning models), counted as they
    # are generated: long thinking streams show here long before they finish
    reasoning_tokens_per_s: float = 0.0
    ready: dict[str, int] = field(default_factory=dict)  # pool -> ready replicas
    workers: tuple[WorkerState, ...] = ()

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.request_rate * self.mean_input_tokens

    @property
    def refused_rate(self) -> float:
        return self.refused_429_rate + self.refused_503_rate

    def ready_in(self, pool: str) -> int:
        return self.ready.get(pool, 0)


@dataclass(frozen=True)
class Forecast:
    """PREDICT's answer for the next interval."""

    request_rate: float
    mean_input_tokens: float
    mean_output_tokens: float
    mean_input_tokens_sq: float = 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.request_rate * self.mean_input_tokens

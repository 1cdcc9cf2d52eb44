"""What the planner knows at one tick: the fleet's load over the last interval and the
replicas each pool has, as plain data (OBSERVE fills it in from Prometheus metrics,
the simulator from its own counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

POOLS = ("prefill", "decode")


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
    prefill_queue_depth: int = 0
    prefill_queue_age_s: float = 0.0
    kv_usage: dict[str, float] = field(default_factory=dict)  # pool -> used fraction
    running_requests: int = 0  # in the decode workers' batches
    waiting_requests: int = 0  # queued in the decode workers for a batch slot
    in_flight: int = 0  # requests the frontends hold (running, queued or prefilling)
    held: int = 0  # of those, waiting for a decode worker to join (the pool has none)
    ready: dict[str, int] = field(default_factory=dict)  # pool -> ready replicas

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.request_rate * self.mean_input_tokens

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

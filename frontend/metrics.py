"""The frontend's Prometheus metrics (``diptych_frontend_*``), on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from frontend.router import Decision, RouterObserver
from runtime.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    PROMPT_TOKEN_BUCKETS,
    TTFT_BUCKETS,
    counter,
    gauge,
    histogram,
    new_registry,
)

C = "frontend"
# Seconds one routing decision takes (hashing the prompt and matching it included).
ROUTER_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
)  # fmt: skip


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, time_scale: float = 1.0) -> None:
        r = self.registry = registry or new_registry()
        # latencies are observed in the workers' simulated seconds (--engine sim
        # --time-scale s: wall seconds x s); 1.0 for a real fleet
        self.time_scale = time_scale
        self.requests = counter(
            r, C, "requests_total", "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
        )  # fmt: skip
        self.stream_errors = counter(
            r, C, "stream_errors_total", "Streams ended by an error after the 200 was sent"
        )
        self.in_flight = gauge(r, C, "requests_in_flight", "Generation requests being served")
        self.held = gauge(
            r, C, "requests_held",
            "Requests held for a decode worker to join (the pool has none: scaled to zero)",
        )  # fmt: skip
        self.arrivals = counter(
            r, C, "generation_requests_total", "Generation requests admitted (sent to a worker)"
        )
        self.prompt_length = histogram(
            r, C, "request_prompt_tokens", "Prompt tokens of each admitted request",
            PROMPT_TOKEN_BUCKETS,
        )  # fmt: skip
        self.ttft = histogram(
            r, C, "time_to_first_token_seconds", "From arrival to the first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            r, C, "inter_token_latency_seconds", "Between consecutive output tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            r, C, "request_duration_seconds", "From arrival to the last token", E2E_BUCKETS
        )
        self.prompt_tokens = counter(r, C, "prompt_tokens_total", "Prompt tokens of requests")
        self.cached_tokens = counter(
            r, C, "cached_prompt_tokens_total", "Prompt tokens found in a worker's prefix cache"
        )
        self.generation_tokens = counter(r, C, "generation_tokens_total", "Tokens generated")
        self.reasoning_tokens = counter(
            r, C, "reasoning_tokens_total",
            "Thinking tokens of reasoning models' outputs, by API key (a digest prefix, as "
            "frontend/auth.py names keys; '-' without keys)",
            ["api_key"],
        )  # fmt: skip
        self.failovers = counter(
            r, C, "failovers_total",
            "Requests moved to another worker: retry (no token yet) or migration",
            ["kind"],
        )  # fmt: skip
        for kind in ("retry", "migration"):  # at 0 from the start: rate() reads 0
            self.failovers.labels(kind)
        self.cancelled = counter(
            r, C, "client_disconnects_total", "Requests cancelled because the client went away"
        )
        self.workers = gauge(r, C, "decode_workers", "Decode workers known from discovery")
        self.worker_proof_failures = counter(
            r, C, "worker_proof_failures_total",
            "Answers refused because they did not prove they came from the worker called "
            "(another server at its address); with a deployment secret only",
        )  # fmt: skip
        self.shed = counter(
            r, C, "requests_shed_total",
            "Requests refused with 429 because the decode pool was saturated, by class",
            ["priority_class"],
        )  # fmt: skip
        for cls in ("interactive", "batch", "long_thinking"):
            self.shed.labels(cls)


class RouterMetrics(RouterObserver):
    """The KV-aware router's decisions, its predictions against the workers' real prefix
    hits, and what a decision costs (``diptych_frontend_router_*``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = counter(
            r, C, "router_decisions_total",
            "Routing decisions by what decided them: prefix (the chosen worker holds part "
            "of the prompt), session (the sticky hint), load (no cached prefix counted)",
            ["reason"],
        )  # fmt: skip
        for reason in ("prefix", "session", "pull", "load"):
            self.decisions.labels(reason)
        self.seconds = histogram(
            r, C, "router_decision_seconds", "Wall time of one routing decision", ROUTER_BUCKETS
        )
        self.prompt_tokens = counter(
            r, C, "router_prompt_tokens_total", "Prompt tokens of attempts whose first token came"
        )
        self.predicted = counter(
            r, C, "router_predicted_cached_tokens_total",
            "Of those, the tokens the router expected the chosen worker to hold",
        )  # fmt: skip
        self.actual = counter(
            r, C, "router_actual_cached_tokens_total",
            "Of those, the tokens the worker's prefix cache really held",
        )  # fmt: skip

    def decided(self, decision: Decision) -> None:
        self.decisions.labels(decision.reason).inc()
        self.seconds.observe(decision.seconds)

    def prefilled(
        self, predicted_cached_tokens: int, cached_tokens: int, prompt_tokens: int
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted.inc(predicted_cached_tokens)
        self.actual.inc(cached_tokens)

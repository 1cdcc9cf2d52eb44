"""What one frontend process serves, where it finds its workers, and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.model_formats import DEFAULT_EFFORT_BUDGETS
from frontend.reasoning import PARSERS as REASONING_PARSERS
from frontend.tool_formats import FORMATS as TOOL_FORMATS
from protocol.declare import check_fields, spec
from protocol.sampling import LONG_THINKING_TOKENS
from runtime.discovery import DiscoveryOptions

MiB = 1024 * 1024
ROUTERS = ("kv", "least-loaded")


@dataclass(frozen=True)
class KvRouterConfig:
    """The KV-aware router's knobs (``frontend/router.py``)."""

    # a prompt token to prefill against a token of context the worker's requests read
    # each decode step (4: prefilling a token costs about what reading four tokens of
    # context over a reply costs; the best TTFT and hit rate in the simulator's sweep)
    overlap_weight: float = spec(
        4.0, lo=0.0, flag="router-overlap-weight",
        help="a prompt token to prefill against a token of context the worker's running "
        "requests read each decode step",
    )  # fmt: skip
    temperature: float = spec(
        0.0, lo=0.0, flag="router-temperature",
        help="0 takes the cheapest worker; above 0 samples workers by softmax of -cost",
    )  # fmt: skip
    kv_events: bool = spec(
        True, flag="no-kv-events",
        help="approximate KV routing: predict what workers cache from this frontend's own "
        "routing (for workers that publish no KV events)",
    )  # fmt: skip
    predict_ttl_s: float = spec(
        120.0, lo=0.0, lo_open=True, flag="router-predict-ttl",
        help="with --no-kv-events: seconds a predicted cached prefix lasts after its last use",
    )  # fmt: skip
    session_affinity: bool = spec(
        False,
        help="treat a request's X-Session-Id header (or its `user`) as a sticky hint: its "
        "last worker is assumed to hold the session's history",
    )
    session_ttl_s: float = spec(1800.0, lo=0.0, lo_open=True)
    # A hit in a tier under a worker's pool costs a copy back (engine/kv_cache/tiers.py):
    # priced at the share of computing the block the worker measures and reports, or at
    # these until it has.
    host_hit_cost: float = spec(
        0.1, lo=0.0, hi=1.0, flag="router-host-hit-cost",
        help="a block restored from a worker's host-memory tier against computing it, "
        "until the worker reports its measured cost",
    )  # fmt: skip
    disk_hit_cost: float = spec(
        0.5, lo=0.0, hi=1.0, flag="router-disk-hit-cost",
        help="a block read back from a worker's disk tier against computing it, until the "
        "worker reports its measured cost",
    )  # fmt: skip
    # A worker that lacks blocks another holds can have them written into its pool
    # (decode_worker/peer_kv.py): priced at this share of computing them.
    peer_pull: bool = spec(
        True, flag="no-router-peer-pull",
        help="price a prompt's blocks held by another decode worker as prefill work, not "
        "as a pull from that worker",
    )  # fmt: skip
    peer_pull_cost: float = spec(
        0.25, lo=0.0, hi=1.0, flag="router-peer-pull-cost",
        help="a block pulled from another decode worker against computing it (0: free, "
        "1: as dear)",
    )  # fmt: skip
    peer_pull_min_blocks: int = spec(
        4, lo=1, flag="router-peer-pull-min-blocks",
        help="a pull is worth its round trip from this many blocks on",
    )  # fmt: skip
    # A worker that must copy a request's LoRA adapter into a device slot first (its
    # load report does not list it as resident) is charged this much prefill.
    lora_load_tokens: float = spec(
        64.0, lo=0.0, flag="router-lora-load-tokens",
        help="prompt tokens of prefill a decode worker is charged for loading a request's "
        "LoRA adapter into a device slot (0: adapters do not steer routing)",
    )  # fmt: skip
    seed: int | None = None  # of the tie-breaking and sampling

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class AdmissionConfig:
    """Load shedding at the edge (``frontend/workers.py``)."""

    # None: each worker's own bound, as its discovery record states (WorkerInfo.max_queued);
    # 0: never shed on the workers' queues
    max_queued_per_worker: int | None = spec(
        None, lo=0,
        help="answer 429 (Retry-After) once every decode worker has this many requests "
        "queued beyond those it runs (default: each worker's own --max-queued-requests); "
        "batch requests (X-Priority: batch, or priority > 0) from --shed-batch-at of it; "
        "0 never sheds",
    )  # fmt: skip
    batch_share: float = spec(
        0.5, lo=0.0, lo_open=True, hi=1.0, flag="shed-batch-at",
        help="share of --max-queued-per-worker from which batch requests are refused",
    )  # fmt: skip
    max_in_flight: int = spec(
        0, lo=0, help="requests this frontend serves at once before answering 429 (0: no limit)"
    )
    retry_after_s: float = spec(
        1.0, lo=0.0, lo_open=True, flag="retry-after", help="seconds told to refused clients"
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class FrontendConfig:
    """Configuration of the OpenAI-compatible frontend.

    ``model`` is what the engine's model resolution takes (a .gguf file, a HF
    directory, or None for the default model); the frontend loads only its tokenizer.
    Clients name the model ``served_model_name``, by default the resolved model's name.

    ``max_model_len`` is the context window used to reject long prompts when no decode
    worker states its own in its discovery record (``WorkerInfo.max_model_len``); when
    neither is known, the worker's own check is the only one.
    """

    model: str | None = spec(None, help="model whose tokenizer to use (default model)")
    served_model_name: str | None = spec(None, help="name clients use in requests")
    lora_modules: tuple[str, ...] = spec(
        (), max_items=1024, metavar="NAME=PATH",
        help="a LoRA adapter clients may name as their model: name=path (a PEFT directory "
        "the decode workers can read; repeat the flag for more). Workers need --enable-lora",
    )  # fmt: skip
    discovery_url: str = "embedded"
    namespace: str = "default"
    host: str = spec("127.0.0.1", help="address the API listens on")
    port: int = spec(8000, lo=0, hi=65535, help="port the API listens on")
    # Whole request, all attempts together; None: no limit.
    request_timeout_s: float | None = spec(600.0, lo=0.0, lo_open=True)
    max_model_len: int | None = spec(None, lo=2)
    # Workers tried per request (the first included), for retries and migrations.
    max_attempts: int = spec(3, lo=1)
    # After a retryable failure a worker is avoided this long (unless it is the only one).
    worker_cooldown_s: float = spec(5.0, lo=0.0)
    router: str = spec(
        "kv", choices=ROUTERS,
        help="kv: the decode worker holding most of the prompt, weighed against its load; "
        "least-loaded: the one with the fewest requests",
    )  # fmt: skip
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    # Subscribe to each worker's Events stream and use its load reports in routing.
    use_load_reports: bool = True
    max_request_bytes: int = spec(32 * MiB, lo=1024)
    max_header_bytes: int = spec(64 * 1024, lo=1024)  # request line and headers: 431 beyond
    drain_timeout_s: float = spec(
        30.0, lo=0.0, flag="drain-timeout",
        help="seconds a stopping frontend gives its streams in flight (after closing its "
        "listening socket)",
    )  # fmt: skip
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    hold_for_workers_s: float = spec(
        0.0, lo=0.0, flag="hold-for-workers",
        help="with no decode worker at all (a pool scaled to zero), hold a request up to "
        "this many wall seconds for one to join, counted in "
        "diptych_frontend_requests_held so a planner scales the pool up; 0 answers 503 "
        "at once",
    )  # fmt: skip
    max_held: int = spec(
        1024, lo=0, help="requests held for a decode worker at once (503 beyond)"
    )
    # Accepted `Authorization: Bearer` keys; empty: no key needed (frontend/auth.py).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # HTTPS for the API: a PEM certificate (chain) and its key; both or neither.
    tls_certfile: str | None = spec(None, help="serve the API over HTTPS: PEM cert")
    tls_keyfile: str | None = spec(None, help="...and its PEM private key")
    otlp_endpoint: str | None = spec(
        None,
        help="send OpenTelemetry traces of each request (OTLP over HTTP) to this collector, "
        "e.g. http://localhost:4318 (default: OTEL_EXPORTER_OTLP_ENDPOINT if set, else off)",
    )
    # How often the embedded discovery backend is polled; bounds how late a join is seen.
    discovery_poll_s: float = 0.05
    log_level: str = "info"
    chat_template: str | None = spec(
        None, metavar="PATH",
        help="a Jinja chat template file to use instead of the model's own",
    )  # fmt: skip
    reasoning_parser: str = spec(
        "auto", choices=("auto", "none", *REASONING_PARSERS),
        help="how the model marks its thinking, split off as reasoning_content (auto: from "
        "its chat template; none: no thinking parsed)",
    )  # fmt: skip
    tool_call_parser: str = spec(
        "auto", choices=("auto", *TOOL_FORMATS),
        help="the format the model writes tool calls in (auto: from its chat template)",
    )  # fmt: skip
    low_effort_tokens: int = spec(
        DEFAULT_EFFORT_BUDGETS["low"], lo=0, flag="reasoning-budget-low",
        help="thinking tokens a reasoning_effort of low allows",
    )  # fmt: skip
    medium_effort_tokens: int = spec(
        DEFAULT_EFFORT_BUDGETS["medium"], lo=0, flag="reasoning-budget-medium",
        help="thinking tokens a reasoning_effort of medium allows",
    )  # fmt: skip
    high_effort_tokens: int = spec(
        DEFAULT_EFFORT_BUDGETS["high"], lo=0, flag="reasoning-budget-high",
        help="thinking tokens a reasoning_effort of high allows",
    )  # fmt: skip
    long_thinking_tokens: int = spec(
        LONG_THINKING_TOKENS, lo=0, flag="long-thinking-tokens",
        help="a request with at least this thinking budget is a long one",
    )  # fmt: skip
    max_long_thinking_per_key: int = spec(
        0, lo=0,
        help="long-thinking requests (--long-thinking-tokens) one API key may have in flight "
        "(all requests together without keys); 429 beyond (0: no cap)",
    )  # fmt: skip
    # Simulated seconds per wall second of the workers (`--engine sim --time-scale`):
    # request_timeout_s and the latency metrics are in simulated seconds.
    time_scale: float = spec(1.0, lo=0.0, lo_open=True)

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together")
        DiscoveryOptions(namespace=self.namespace)  # validates the namespace

    def effort_budgets(self) -> dict[str, int]:
        """reasoning_effort -> thinking tokens (none and minimal: 0)."""
        return {
            "low": self.low_effort_tokens,
            "medium": self.medium_effort_tokens,
            "high": self.high_effort_tokens,
        }

    def discovery_options(self) -> DiscoveryOptions:
        return DiscoveryOptions(namespace=self.namespace, poll_interval=self.discovery_poll_s)

"""What one frontend process serves, where it finds its workers, and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.discovery import DiscoveryOptions

MiB = 1024 * 1024
ROUTERS = ("kv", "least-loaded")


@dataclass(frozen=True)
class KvRouterConfig:
    """The KV-aware router's knobs (``frontend/kv_router.py``)."""

    # a prompt token to prefill against a token of context the worker's requests read
    # each decode step (4: prefilling a token costs about what reading four tokens of
    # context over a reply costs; the best TTFT and hit rate in the simulator's sweep)
    overlap_weight: float = 4.0
    temperature: float = 0.0  # 0: the cheapest worker; > 0: sample, softmax of -cost / T
    kv_events: bool = True  # False: predict caches from this router's own routing
    predict_ttl_s: float = 120.0  # how long such a prediction lasts after its last use
    session_affinity: bool = False  # X-Session-Id / `user` as a sticky hint
    session_ttl_s: float = 1800.0
    seed: int | None = None  # of the tie-breaking and sampling

    def __post_init__(self) -> None:
        if not self.overlap_weight >= 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (self.predict_ttl_s > 0 and self.session_ttl_s > 0):
            raise ValueError("predict_ttl_s and session_ttl_s must be positive")


@dataclass(frozen=True)
class AdmissionConfig:
    """Load shedding at the edge (``frontend/admission.py``)."""

    # None: each worker's own bound, as its discovery record states (WorkerInfo.max_queued);
    # 0: never shed on the workers' queues
    max_queued_per_worker: int | None = None
    batch_share: float = 0.5  # batch requests are shed once every queue is this full
    max_in_flight: int | None = None  # of this frontend, all workers together
    retry_after_s: float = 1.0  # told to refused clients

    def __post_init__(self) -> None:
        if self.max_queued_per_worker is not None and self.max_queued_per_worker < 0:
            raise ValueError("max_queued_per_worker must be >= 0 (or None)")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError("batch_share must be in (0, 1]")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1 (or None)")
        if not self.retry_after_s > 0:
            raise ValueError("retry_after_s must be > 0")


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

    model: str | None = None
    served_model_name: str | None = None
    discovery_url: str = "embedded"
    namespace: str = "default"
    host: str = "0.0.0.0"
    port: int = 8000
    # Whole request, all attempts together; None: no limit.
    request_timeout_s: float | None = 600.0
    max_model_len: int | None = None
    # Workers tried per request (the first included), for retries and migrations.
    max_attempts: int = 3
    # After a retryable failure a worker is avoided this long (unless it is the only one).
    worker_cooldown_s: float = 5.0
    # "kv": KV-aware (most cached prefix against load); "least-loaded": fewest requests.
    router: str = "kv"
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    # Subscribe to each worker's Events stream and use its load reports in routing.
    use_load_reports: bool = True
    max_request_bytes: int = 32 * MiB
    max_header_bytes: int = 64 * 1024  # request line and headers: 431 beyond
    # On SIGTERM: stop accepting connections, give streams in flight this long to end.
    drain_timeout_s: float = 30.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # Accepted `Authorization: Bearer` keys; empty: no key needed (frontend/auth.py).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # HTTPS for the API: a PEM certificate (chain) and its key; both or neither.
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    # How often the embedded discovery backend is polled; bounds how late a join is seen.
    discovery_poll_s: float = 0.05
    log_level: str = "info"
    # Simulated seconds per wall second of the workers (`--engine sim --time-scale`):
    # request_timeout_s and the latency metrics are in simulated seconds.
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive (or None for no limit)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.worker_cooldown_s < 0:
            raise ValueError("worker_cooldown_s must not be negative")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be at least 1024")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together")
        DiscoveryOptions(namespace=self.namespace)  # validates the namespace

    def discovery_options(self) -> DiscoveryOptions:
        return DiscoveryOptions(namespace=self.namespace, poll_interval=self.discovery_poll_s)

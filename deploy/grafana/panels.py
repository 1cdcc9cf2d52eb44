"""The Diptych Grafana dashboard's rows and panels, and the metrics they may name.

Every expression names metrics by the exact sample names the processes export
(``runtime/metrics.py`` names them ``diptych_{component}_{name}``; prometheus_client adds
``_total`` to counters and ``_bucket``/``_sum``/``_count`` to histograms). ``EXPORTED``
lists them, with the module that defines each, and the build fails on any other name.

Both worker roles export ``diptych_worker_kv_*`` and ``diptych_transfer_write_seconds``
under the same names, so pool panels keep one role's series with ``and on (job,
instance)`` against a gauge that only that role exports: ``prefills_in_flight`` for
prefill workers, ``running_requests`` for decode workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# sample name -> the module whose metrics class defines it
EXPORTED: dict[str, str] = {
    # frontend/metrics.py
    "diptych_frontend_requests_total": "frontend",  # {endpoint, status}
    "diptych_frontend_stream_errors_total": "frontend",
    "diptych_frontend_requests_in_flight": "frontend",
    "diptych_frontend_generation_requests_total": "frontend",
    "diptych_frontend_request_prompt_tokens_bucket": "frontend",
    "diptych_frontend_time_to_first_token_seconds_bucket": "frontend",
    "diptych_frontend_inter_token_latency_seconds_bucket": "frontend",
    "diptych_frontend_request_duration_seconds_bucket": "frontend",
    "diptych_frontend_prompt_tokens_total": "frontend",
    "diptych_frontend_cached_prompt_tokens_total": "frontend",
    "diptych_frontend_generation_tokens_total": "frontend",
    "diptych_frontend_failovers_total": "frontend",  # {kind}
    "diptych_frontend_client_disconnects_total": "frontend",
    "diptych_frontend_decode_workers": "frontend",
    "diptych_frontend_router_decisions_total": "frontend",  # {reason}
    "diptych_frontend_router_decision_seconds_bucket": "frontend",
    "diptych_frontend_router_prompt_tokens_total": "frontend",
    "diptych_frontend_router_predicted_cached_tokens_total": "frontend",
    "diptych_frontend_router_actual_cached_tokens_total": "frontend",
    "diptych_frontend_router_indexed_blocks": "frontend",
    # worker/metrics.py (both roles)
    "diptych_worker_kv_used_blocks": "worker",
    "diptych_worker_kv_total_blocks": "worker",
    # prefill_worker/metrics.py
    "diptych_worker_prefills_total": "prefill_worker",  # {result}
    "diptych_worker_prefill_seconds_bucket": "prefill_worker",
    "diptych_worker_prefills_in_flight": "prefill_worker",
    "diptych_transfer_sent_bytes_total": "prefill_worker",
    # decode_worker/metrics.py
    "diptych_worker_requests_total": "decode_worker",  # {prefill}
    "diptych_worker_remote_prefills_started_total": "decode_worker",
    "diptych_worker_remote_prefills_finished_total": "decode_worker",  # {result}
    "diptych_worker_remote_prefills_routed_total": "decode_worker",  # {to}
    "diptych_worker_remote_prefills_released_total": "decode_worker",  # {why}
    "diptych_worker_malformed_prefill_notices_total": "decode_worker",
    "diptych_worker_remote_prefill_seconds_bucket": "decode_worker",
    "diptych_transfer_received_bytes_total": "decode_worker",
    "diptych_worker_prefill_queue_depth": "decode_worker",
    "diptych_worker_remote_prefill_oldest_seconds": "decode_worker",
    "diptych_worker_running_requests": "decode_worker",
    "diptych_worker_waiting_requests": "decode_worker",
    "diptych_worker_remote_waiting_requests": "decode_worker",
    "diptych_worker_prefix_hit_rate": "worker",
    # worker/metrics.py KvTierCounts (zeros on a worker without tiers)
    "diptych_worker_kv_tier_bytes": "worker",  # {tier}
    "diptych_worker_kv_tier_offloaded_blocks_total": "worker",
    "diptych_worker_kv_tier_restored_blocks_total": "worker",
    "diptych_worker_kv_tier_disk_reads_total": "worker",
    "diptych_worker_kv_tier_dropped_blocks_total": "worker",
    # decode_worker/metrics.py: prefix pulls between decode workers (decode_worker/peer_kv.py)
    "diptych_worker_kv_peer_pulls_total": "decode_worker",  # {result}
    "diptych_worker_kv_peer_pulled_blocks_total": "decode_worker",
    # prefill_worker/metrics.py and decode_worker/metrics.py
    "diptych_transfer_write_seconds_bucket": "prefill_worker, decode_worker",
    # worker/metrics.py, from the transfer agent's counters
    "diptych_transfer_failures_total": "worker",  # {reason}
    # planner/metrics.py
    "diptych_planner_desired_replicas": "planner",  # {pool}
    "diptych_planner_ready_replicas": "planner",  # {pool}
    "diptych_planner_proposed_replicas": "planner",  # {pool}
    "diptych_planner_predicted_request_rate": "planner",
    "diptych_planner_observed_request_rate": "planner",
    "diptych_planner_decisions_total": "planner",  # {pool, direction, rule}
    "diptych_planner_errors_total": "planner",  # {kind}
    "diptych_planner_ticks_total": "planner",
}

METRIC = re.compile(r"diptych_[a-z0-9_]+")
JOB = 'job=~"$job"'
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# a gauge only one role exports: selects that role's workers by (job, instance)
ROLE_MARKER = {
    "prefill": "diptych_worker_prefills_in_flight",
    "decode": "diptych_worker_running_requests",
}


def sel(metric: str, matchers: str = "") -> str:
    """``metric{job=~"$job",matchers}``."""
    inner = f"{JOB},{matchers}" if matchers else JOB
    return f"{metric}{{{inner}}}"


def rate(metric: str, matchers: str = "") -> str:
    return f"rate({sel(metric, matchers)}[{RATE}])"


def of_role(expr: str, role: str) -> str:
    """Keep the series of ``expr`` that come from workers of ``role``."""
    return f"({expr}) and on (job, instance) {sel(ROLE_MARKER[role])}"


def quantile(q: float, histogram: str, role: str | None = None) -> str:
    """The ``q`` quantile of a histogram (``histogram`` names its ``_bucket`` series) over
    all matching processes, or only workers of ``role``."""
    buckets = rate(histogram)
    if role is not None:
        buckets = of_role(buckets, role)
    return f"histogram_quantile({q}, sum by (le) ({buckets}))"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    width: int = 8
    stacked: bool = False
    bars: bool = False
    minimum: float | None = 0
    maximum: float | None = None


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def latency(
    title: str,
    description: str,
    histogram: str,
    role: str | None = None,
    unit: str = "s",
    width: int = 8,
) -> Panel:
    return Panel(
        title,
        description,
        unit,
        tuple(Target(quantile(q / 100, histogram, role), f"p{q}") for q in (50, 90, 99)),
        width=width,
    )


def kv_usage(role: str, width: int = 8) -> Panel:
    used = sel("diptych_worker_kv_used_blocks")
    total = sel("diptych_worker_kv_total_blocks")
    return Panel(
        "KV cache usage",
        f"Share of each {role} worker's usable KV blocks held by requests "
        "(kv_used_blocks / kv_total_blocks).",
        "percentunit",
        (Target(of_role(f"{used} / {total}", role), "{{instance}}"),),
        width=width,
        maximum=1,
    )


def per_minute(expr: str) -> str:
    return f"60 * {expr}"


# selections with label matchers (f-strings may not nest the same quotes before 3.12)
HTTP_ERRORS = rate("diptych_frontend_requests_total", 'status=~"[45].."')
REMOTE_REQUESTS = rate("diptych_worker_requests_total", 'prefill="remote"')
PREFILL_FAILURES = rate("diptych_worker_prefills_total", 'result=~"failed|refused"')
REMOTE_PREFILL_FAILURES = rate("diptych_worker_remote_prefills_finished_total", 'result!="ok"')

FRONTEND = Row(
    "Frontend",
    (
        latency(
            "Time to first token",
            "From a request's arrival at the frontend to its first token.",
            "diptych_frontend_time_to_first_token_seconds_bucket",
        ),
        latency(
            "Inter-token latency",
            "Between consecutive output tokens of one request.",
            "diptych_frontend_inter_token_latency_seconds_bucket",
        ),
        latency(
            "End-to-end latency",
            "From a request's arrival to its last token.",
            "diptych_frontend_request_duration_seconds_bucket",
        ),
        Panel(
            "Request rate",
            "HTTP requests by endpoint, and generation requests admitted (sent to a worker).",
            "reqps",
            (
                Target(
                    f"sum by (endpoint) ({rate('diptych_frontend_requests_total')})",
                    "{{endpoint}}",
                ),
                Target(
                    f"sum({rate('diptych_frontend_generation_requests_total')})",
                    "admitted generations",
                ),
            ),
        ),
        Panel(
            "Errors",
            "HTTP responses with a 4xx or 5xx status, streams that failed after their 200, "
            "requests moved to another worker (retry before the first token, migration "
            "after), and requests whose client went away.",
            "reqps",
            (
                Target(
                    f"sum by (status) ({HTTP_ERRORS})",
                    "HTTP {{status}}",
                ),
                Target(f"sum({rate('diptych_frontend_stream_errors_total')})", "stream errors"),
                Target(
                    f"sum by (kind) ({rate('diptych_frontend_failovers_total')})",
                    "failover: {{kind}}",
                ),
                Target(
                    f"sum({rate('diptych_frontend_client_disconnects_total')})",
                    "client disconnects",
                ),
            ),
        ),
        Panel(
            "In-flight requests",
            "Generation requests being served by each frontend, and the decode workers "
            "it knows from discovery.",
            "short",
            (
                Target(sel("diptych_frontend_requests_in_flight"), "in flight {{instance}}"),
                Target(sel("diptych_frontend_decode_workers"), "decode workers {{instance}}"),
            ),
        ),
        Panel(
            "Token throughput",
            "Prompt tokens of finished requests, the part of them found in a worker's prefix "
            "cache, and tokens generated.",
            "short",
            (
                Target(f"sum({rate('diptych_frontend_prompt_tokens_total')})", "prompt"),
                Target(
                    f"sum({rate('diptych_frontend_cached_prompt_tokens_total')})",
                    "prompt, cached",
                ),
                Target(f"sum({rate('diptych_frontend_generation_tokens_total')})", "generated"),
            ),
            width=12,
        ),
        latency(
            "Prompt length",
            "Prompt tokens of each admitted request.",
            "diptych_frontend_request_prompt_tokens_bucket",
            unit="short",
            width=12,
        ),
    ),
)

PREFILL = Row(
    "Prefill pool",
    (
        Panel(
            "Prefill queue depth",
            "Remote prefills pending in the shared prefill queue, as the decode workers "
            "read it (each reports the same queue; the panel takes the largest).",
            "short",
            (Target(f"max({sel('diptych_worker_prefill_queue_depth')})", "pending"),),
        ),
        Panel(
            "Prefill queue age",
            "Age of the oldest remote prefill a decode worker still waits for (0: none).",
            "s",
            (
                Target(
                    f"max({sel('diptych_worker_remote_prefill_oldest_seconds')})",
                    "oldest pending",
                ),
            ),
        ),
        kv_usage("prefill"),
        Panel(
            "Prefills in flight",
            "Prefills each prefill worker is working on (its running requests).",
            "short",
            (Target(sel("diptych_worker_prefills_in_flight"), "{{instance}}"),),
        ),
        Panel(
            "Prefill prefix hit rate",
            "Share of queried prompt tokens each prefill worker served from its prefix "
            "cache since it started.",
            "percentunit",
            (Target(of_role(sel("diptych_worker_prefix_hit_rate"), "prefill"), "{{instance}}"),),
            maximum=1,
        ),
        Panel(
            "Prefill outcomes",
            "Remote prefills finished by the prefill workers, by result "
            "(ok, skipped, refused, failed, duplicate).",
            "ops",
            (Target(f"sum by (result) ({rate('diptych_worker_prefills_total')})", "{{result}}"),),
            stacked=True,
        ),
        latency(
            "Prefill latency",
            "From fetching a prefill off the queue to its first token.",
            "diptych_worker_prefill_seconds_bucket",
        ),
    ),
)

DECODE = Row(
    "Decode pool",
    (
        Panel(
            "Running requests",
            "Requests in each decode worker's batch.",
            "short",
            (Target(sel("diptych_worker_running_requests"), "{{instance}}"),),
            width=6,
        ),
        Panel(
            "Decode queue",
            "Requests queued for a decode worker's batch, and requests waiting for their "
            "KV from a remote prefill.",
            "short",
            (
                Target(sel("diptych_worker_waiting_requests"), "waiting {{instance}}"),
                Target(sel("diptych_worker_remote_waiting_requests"), "remote KV {{instance}}"),
            ),
            width=6,
        ),
        kv_usage("decode", width=6),
        Panel(
            "Prefix cache hit rate",
            "Share of queried prompt tokens each decode worker served from its prefix "
            "cache since it started, and the fleet's share of prompt tokens found cached "
            "over the interval (from the frontend's token counters).",
            "percentunit",
            (
                Target(of_role(sel("diptych_worker_prefix_hit_rate"), "decode"), "{{instance}}"),
                Target(
                    f"sum({rate('diptych_frontend_cached_prompt_tokens_total')}) / "
                    f"sum({rate('diptych_frontend_prompt_tokens_total')})",
                    "fleet (frontend)",
                ),
            ),
            width=6,
            maximum=1,
        ),
        Panel(
            "Remote prefill share",
            "Share of the decode workers' requests whose prompt a prefill worker "
            "prefilled (the rest were prefilled locally).",
            "percentunit",
            (
                Target(
                    f"sum({REMOTE_REQUESTS}) / sum({rate('diptych_worker_requests_total')})",
                    "all decode workers",
                ),
                Target(
                    "sum by (instance) "
                    f"({REMOTE_REQUESTS}) / "
                    f"sum by (instance) ({rate('diptych_worker_requests_total')})",
                    "{{instance}}",
                ),
            ),
            maximum=1,
        ),
        Panel(
            "Remote prefills",
            "Remote prefills the decode workers published, and how they ended "
            "(ok, refused, malformed, dead_letter, timeout, publish_error).",
            "ops",
            (
                Target(f"sum({rate('diptych_worker_remote_prefills_started_total')})", "started"),
                Target(
                    f"sum by (result) ({rate('diptych_worker_remote_prefills_finished_total')})",
                    "finished: {{result}}",
                ),
            ),
        ),
        latency(
            "Remote prefill latency",
            "From publishing a remote prefill to adopting its KV.",
            "diptych_worker_remote_prefill_seconds_bucket",
        ),
        Panel(
            "KV tiers: held",
            "Bytes of KV blocks each worker's host and disk tiers hold (--kv-host-memory, "
            "--kv-disk-dir): blocks its device pool evicted, kept for a later prefix hit.",
            "bytes",
            (Target(f"sum by (tier) ({sel('diptych_worker_kv_tier_bytes')})", "{{tier}}"),),
        ),
        Panel(
            "KV tiers: traffic",
            "Blocks a second the device pools evicted into a tier, copied back for a prefix "
            "hit, read back from disk, and let go of by the lowest tier (lost: computed "
            "again if asked for).",
            "ops",
            (
                Target(f"sum({rate('diptych_worker_kv_tier_offloaded_blocks_total')})",
                       "offloaded"),
                Target(f"sum({rate('diptych_worker_kv_tier_restored_blocks_total')})",
                       "restored"),
                Target(f"sum({rate('diptych_worker_kv_tier_disk_reads_total')})", "disk reads"),
                Target(f"sum({rate('diptych_worker_kv_tier_dropped_blocks_total')})", "dropped"),
            ),
        ),
        Panel(
            "KV prefix pulls",
            "Prefix pulls a second between decode workers, by outcome (ok: the holder wrote "
            "the blocks; refused: it held none; timeout: no answer in --peer-pull-timeout), "
            "and the blocks written: a prompt's history reused on another worker instead of "
            "prefilled again.",
            "ops",
            (
                Target(f"sum by (result) ({rate('diptych_worker_kv_peer_pulls_total')})",
                       "{{result}}"),
                Target(f"sum({rate('diptych_worker_kv_peer_pulled_blocks_total')})",
                       "blocks pulled"),
            ),
        ),
    ),
)

TRANSFER = Row(
    "KV transfer",
    (
        Panel(
            "KV transfer throughput",
            "KV bytes each prefill worker wrote and each decode worker received.",
            "binBps",
            (
                Target(
                    f"sum by (instance) ({rate('diptych_transfer_sent_bytes_total')})",
                    "sent {{instance}}",
                ),
                Target(
                    f"sum by (instance) ({rate('diptych_transfer_received_bytes_total')})",
                    "received {{instance}}",
                ),
            ),
            width=12,
        ),
        Panel(
            "KV handoff failures",
            "Prefills that failed or were refused on the prefill workers, remote prefills "
            "that ended other than ok on the decode workers, and prefill notices that did "
            "not decode.",
            "ops",
            (
                Target(
                    f"sum by (result) ({PREFILL_FAILURES})",
                    "prefill: {{result}}",
                ),
                Target(
                    f"sum by (result) ({REMOTE_PREFILL_FAILURES})",
                    "decode: {{result}}",
                ),
                Target(
                    f"sum({rate('diptych_worker_malformed_prefill_notices_total')})",
                    "malformed notices",
                ),
            ),
            width=12,
        ),
        Panel(
            "Transfer-layer failures",
            "The transfer agents' own counts: transfers that failed, peer connections "
            "lost, and connections or messages refused (unknown or stale peer, bad "
            "secret, out of bounds, malformed, replayed).",
            "ops",
            (
                Target(
                    f"sum by (reason) ({rate('diptych_transfer_failures_total')}) > 0",
                    "{{reason}}",
                ),
            ),
            width=24,
        ),
        latency(
            "KV write latency (prefill side)",
            "One KV write into a decode worker, on the prefill worker's clock.",
            "diptych_transfer_write_seconds_bucket",
            role="prefill",
            width=12,
        ),
        latency(
            "KV write to notice (decode side)",
            "From a KV write's start (prefill worker's clock) to the decode worker "
            "receiving its notice.",
            "diptych_transfer_write_seconds_bucket",
            role="decode",
            width=12,
        ),
    ),
)

ROUTING = Row(
    "KV-aware routing",
    (
        Panel(
            "Routing decisions / s",
            "The frontends' routing decisions by what decided them: prefix (the chosen "
            "worker holds part of the prompt), session (the sticky hint), load.",
            "ops",
            (
                Target(
                    f"sum by (reason) ({rate('diptych_frontend_router_decisions_total')})",
                    "{{reason}}",
                ),
            ),
            stacked=True,
        ),
        Panel(
            "Prompt tokens cached: predicted vs actual",
            "Of the prompt tokens routed, the share the router expected the chosen worker "
            "to hold, and the share its prefix cache really held (the same requests).",
            "percentunit",
            (
                Target(
                    f"sum({rate('diptych_frontend_router_predicted_cached_tokens_total')}) / "
                    f"sum({rate('diptych_frontend_router_prompt_tokens_total')})",
                    "predicted",
                ),
                Target(
                    f"sum({rate('diptych_frontend_router_actual_cached_tokens_total')}) / "
                    f"sum({rate('diptych_frontend_router_prompt_tokens_total')})",
                    "actual",
                ),
            ),
            maximum=1,
        ),
        latency(
            "Routing decision time",
            "Wall time of one decision: hashing the prompt, matching it, pricing every "
            "worker.",
            "diptych_frontend_router_decision_seconds_bucket",
        ),
        Panel(
            "Indexed blocks",
            "Block entries in each frontend's prefix index (a block two workers hold "
            "counts twice).",
            "short",
            (Target(sel("diptych_frontend_router_indexed_blocks"), "{{instance}}"),),
            width=12,
        ),
        Panel(
            "Remote prefills by first offer / s",
            "Remote prefills offered first to the prefill worker holding most of the "
            "prompt (holder) or to the shared queue (any), and preferences released to "
            "every prefill worker (not taken in time, or the worker left).",
            "ops",
            (
                Target(
                    f"sum by (to) ({rate('diptych_worker_remote_prefills_routed_total')})",
                    "{{to}}",
                ),
                Target(
                    f"sum by (why) ({rate('diptych_worker_remote_prefills_released_total')})",
                    "released: {{why}}",
                ),
            ),
            width=12,
        ),
    ),
)

PLANNER = Row(
    "Planner",
    (
        Panel(
            "Replicas",
            "Per pool: the replicas the planner asks for, those ready at its last tick, "
            "and its policy's proposal before constraints.",
            "short",
            (
                Target(
                    f"max by (pool) ({sel('diptych_planner_desired_replicas')})",
                    "{{pool}} desired",
                ),
                Target(
                    f"max by (pool) ({sel('diptych_planner_ready_replicas')})", "{{pool}} ready"
                ),
                Target(
                    f"max by (pool) ({sel('diptych_planner_proposed_replicas')})",
                    "{{pool}} proposed",
                ),
            ),
            width=12,
        ),
        Panel(
            "Request rate: observed vs predicted",
            "The request rate the planner observed over its last interval and the rate "
            "it predicts for the next.",
            "reqps",
            (
                Target(f"max({sel('diptych_planner_observed_request_rate')})", "observed"),
                Target(f"max({sel('diptych_planner_predicted_request_rate')})", "predicted"),
            ),
            width=12,
        ),
        Panel(
            "Scaling decisions / min",
            "Changes of a pool's target, by pool, direction and the rule that set it.",
            "short",
            (
                Target(
                    per_minute(
                        "sum by (pool, direction, rule) "
                        f"({rate('diptych_planner_decisions_total')})"
                    ),
                    "{{pool}} {{direction}} ({{rule}})",
                ),
            ),
            width=12,
            bars=True,
        ),
        Panel(
            "Planner ticks and errors / min",
            "Planner ticks, and ticks or scale calls that failed, by kind.",
            "short",
            (
                Target(per_minute(f"sum({rate('diptych_planner_ticks_total')})"), "ticks"),
                Target(
                    per_minute(f"sum by (kind) ({rate('diptych_planner_errors_total')})"),
                    "error: {{kind}}",
                ),
            ),
            width=12,
        ),
    ),
)

ROWS = (FRONTEND, ROUTING, PREFILL, DECODE, TRANSFER, PLANNER)

"""OBSERVE, the pure half: Prometheus text from the frontend and the workers in, one
`Observation` of the interval between two scrapes out.

The caller fetches `/metrics` of the frontend and of every worker it found in
discovery (the HTTP half lives with the planner process); `Snapshot.parse` reads one
exposition, `observe` compares two rounds of them:

    request rate      requests admitted per second (finished ones, from the E2E
                      histogram's count, where the frontend exports no admissions)
    input / output    prompt tokens per admitted request, with the mean of their
                      squares from the prompt-length histogram's buckets (each taken
                      at its bucket's middle); generation tokens per finished one
    TTFT, ITL         p50 / p99 of the interval, from the histograms' bucket deltas,
                      interpolated inside a bucket as PromQL's histogram_quantile
    queue             remote prefills pending in the shared queue (each decode worker
                      reports its depth; the largest)
    queue age         the oldest remote prefill any decode worker waits for
    KV usage          the mean fraction of blocks in use, per pool
    running, waiting  requests in the decode workers' batches, and queued for one
                      (not those waiting for a remote prefill)
    in flight         requests the frontends hold (the concurrency decode must carry)
    held              of those, waiting for a decode worker to join
    refused           requests/s the generation endpoints answered 429 (shed) or 503
                      (no worker, too many held), from requests_total by status
    attainment        with an `Slo`: the share of the interval's requests whose TTFT,
                      and of its token gaps whose ITL, was within the target, counted
                      up to the largest bucket bound not above it (a lower bound when
                      the target falls inside a bucket)
    ready             workers that answered this round, per pool
    workers           each one's running, waiting, KV use, start time, time to ready

A counter that went backwards (a restarted process) counts from zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from planner.observation import POOLS, Observation, Slo, WorkerState

Labels = tuple[tuple[str, str], ...]

FRONTEND = "diptych_frontend_"
WORKER = "diptych_worker_"
# the endpoints whose refusals are requests turned away (not probes that say 503)
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class Snapshot:
    """Every sample of one exposition: name -> labels -> value."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        samples: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return cls(samples)

    def total(self, name: str) -> float:
        """The sum over every label set (0 when absent)."""
        return sum(self.samples.get(name, {}).values())

    def total_where(self, name: str, **allowed: Sequence[str]) -> float:
        """The sum over the label sets whose every label in `allowed` has an allowed value."""
        return sum(
            v
            for labels, v in self.samples.get(name, {}).items()
            if all(dict(labels).get(k) in vs for k, vs in allowed.items())
        )

    def value(self, name: str) -> float | None:
        """The sum over every label set, None when the metric is absent."""
        return self.total(name) if name in self.samples else None

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of a histogram, summed over its other labels."""
        out: dict[float, float] = {}
        for labels, v in self.samples.get(histogram + "_bucket", {}).items():
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + v
        return sorted(out.items())


def _delta(new: float, old: float) -> float:
    return new - old if new >= old else new  # a restart starts the counter again


def quantile(
    q: float, new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]
) -> float | None:
    """The q-quantile of the observations between two cumulative bucket lists."""
    before = dict(old)
    counts = [(le, _delta(c, before.get(le, 0.0))) for le, c in new]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, c in counts:
        if c >= rank:
            if le == float("inf"):
                return lower_bound  # above the largest finite bucket: its bound
            if c == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (c - lower_count)
        lower_bound, lower_count = le, c
    return lower_bound


def attainment(
    target: float, new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]
) -> float | None:
    """The share of the observations between two cumulative bucket lists that fell in
    buckets bounded by at most `target` (None when there were none)."""
    before = dict(old)
    counts = [(le, _delta(c, before.get(le, 0.0))) for le, c in new]
    if not counts or counts[-1][1] <= 0:
        return None
    within = max((c for le, c in counts if le <= target), default=0.0)
    return within / counts[-1][1]


def _mean_square(new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]) -> float:
    """E[x^2] of the observations between two cumulative bucket lists, each taken at
    the middle of its bucket (the last, unbounded one at its lower bound)."""
    before = dict(old)
    total, acc, lower, below = 0.0, 0.0, 0.0, 0.0
    for le, c in new:
        cum = _delta(c, before.get(le, 0.0))
        n = cum - below
        x = lower if le == float("inf") else (lower + le) / 2
        acc += n * x * x
        total += n
        lower, below = le, cum
    return acc / total if total > 0 else 0.0


def observe(
    time: float,
    interval_s: float,
    frontend: tuple[Snapshot, Snapshot],
    workers: Mapping[str, Mapping[str, tuple[Snapshot, Snapshot]]],
    slo: Slo | None = None,
) -> Observation:
    """The interval ending at `time`, from (previous, current) snapshots of the frontend
    and of each pool's workers (pool -> worker id -> snapshots) that answered both
    rounds; with `slo`, how much of the interval met it."""
    old, new = frontend
    dt = max(interval_s, 1e-9)

    def d(name: str) -> float:
        return _delta(new.total(FRONTEND + name), old.total(FRONTEND + name))

    finished = d("request_duration_seconds_count")
    prompt, generated = d("prompt_tokens_total"), d("generation_tokens_total")
    admitted = d("generation_requests_total")
    if FRONTEND + "generation_requests_total" not in new.samples:
        admitted = finished  # an older frontend: finished requests stand in
    lengths = d("request_prompt_tokens_count")
    if lengths:
        mean_in = d("request_prompt_tokens_sum") / lengths
        mean_sq = _mean_square(new.buckets(FRONTEND + "request_prompt_tokens"),
                               old.buckets(FRONTEND + "request_prompt_tokens"))  # fmt: skip
    else:
        mean_in, mean_sq = (prompt / finished if finished else 0.0), 0.0

    def q(hist: str, p: float) -> float | None:
        return quantile(p, new.buckets(FRONTEND + hist), old.buckets(FRONTEND + hist))

    def within(hist: str, target: float) -> float | None:
        return attainment(target, new.buckets(FRONTEND + hist), old.buckets(FRONTEND + hist))

    def refused(status: str) -> float:
        name, match = FRONTEND + "requests_total", {"endpoint": GENERATION, "status": (status,)}
        return _delta(new.total_where(name, **match), old.total_where(name, **match)) / dt

    rows = [_worker(pool, wid, cur) for pool in POOLS
            for wid, (_, cur) in sorted(workers.get(pool, {}).items())]  # fmt: skip
    kv: dict[str, float] = {}
    for pool in POOLS:
        usages = [w.kv_usage for w in rows if w.pool == pool and w.kv_usage is not None]
        if usages:
            kv[pool] = sum(usages) / len(usages)
    decode = [cur for _, cur in workers.get("decode", {}).values()]
    thinking = sum(_delta(cur.total(WORKER + "reasoning_tokens_total"),
                          prev.total(WORKER + "reasoning_tokens_total"))
                   for prev, cur in workers.get("decode", {}).values())  # fmt: skip
    return Observation(
        time=time,
        request_rate=admitted / dt,
        mean_input_tokens=mean_in,
        mean_output_tokens=generated / finished if finished else 0.0,
        mean_input_tokens_sq=mean_sq,
        ttft_p50_s=q("time_to_first_token_seconds", 0.5),
        ttft_p99_s=q("time_to_first_token_seconds", 0.99),
        itl_p50_s=q("inter_token_latency_seconds", 0.5),
        itl_p99_s=q("inter_token_latency_seconds", 0.99),
        ttft_attainment=within("time_to_first_token_seconds", slo.ttft_s) if slo else None,
        itl_attainment=within("inter_token_latency_seconds", slo.itl_s) if slo else None,
        # every decode worker reports the one shared queue's depth: the freshest, max
        prefill_queue_depth=int(
            max((s.total(WORKER + "prefill_queue_depth") for s in decode), default=0)
        ),
        prefill_queue_age_s=max(
            (s.total(WORKER + "remote_prefill_oldest_seconds") for s in decode), default=0.0
        ),
        kv_usage=kv,
        running_requests=int(sum(s.total(WORKER + "running_requests") for s in decode)),
        waiting_requests=int(sum(s.total(WORKER + "waiting_requests") for s in decode)),
        in_flight=int(new.total(FRONTEND + "requests_in_flight")),
        held=int(new.total(FRONTEND + "requests_held")),
        refused_429_rate=refused("429"),
        refused_503_rate=refused("503"),
        reasoning_tokens_per_s=thinking / dt,
        ready={pool: len(workers.get(pool, {})) for pool in POOLS},
        workers=tuple(rows),
    )


def _worker(pool: str, worker_id: str, snap: Snapshot) -> WorkerState:
    """One worker's row from its current exposition."""
    total = snap.total(WORKER + "kv_total_blocks")
    ready = snap.value(WORKER + "ready_seconds")
    running = "running_requests" if pool == "decode" else "prefills_in_flight"
    return WorkerState(
        worker_id,
        pool,
        running=int(snap.total(WORKER + running)),
        waiting=int(snap.total(WORKER + "waiting_requests")),
        kv_usage=snap.total(WORKER + "kv_used_blocks") / total if total > 0 else None,
        started=snap.value(WORKER + "start_time_seconds"),
        ready_s=ready if ready else None,  # 0: not registered yet
    )

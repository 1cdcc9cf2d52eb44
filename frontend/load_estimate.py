"""A router's estimate of each decode worker's load: its reports plus this router's own
requests the reports cannot include yet.

A worker reports its load (``LoadReport``) after every engine step and whenever it
admits or finishes a request, to every router subscribed, so routers in several
frontends see each other's requests one network hop after they reach the worker. A
report cannot include what this router sent after it was written, so the estimate is

    reported + this router's requests sent to the worker since the last report arrived

taken no lower than this router's own requests on the worker (a report written before
a burst of ours reached the worker must not hide the burst). Without reports, the
estimate is this router's own requests alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.rpc.types import LoadReport


@dataclass
class Load:
    requests: int = 0  # admitted and not finished
    prefill_tokens: int = 0  # prompt tokens still to prefill
    tokens: int = 0  # context of those requests: what each decode step reads

    def add(self, other: Load, sign: int = 1) -> None:
        self.requests += sign * other.requests
        self.prefill_tokens += sign * other.prefill_tokens
        self.tokens += sign * other.tokens


@dataclass
class Routed:
    """One attempt this router sent to a worker, and what it adds to the worker's load."""

    worker_id: str
    load: Load
    predicted_cached: int  # prompt tokens the router expected the worker to hold
    hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks


@dataclass
class WorkerLoad:
    block_size: int = 16
    report: LoadReport | None = None
    own: Load = field(default_factory=Load)  # every attempt of ours in flight there
    since_report: dict[str, Routed] = field(default_factory=dict)  # sent after it arrived
    _since: Load = field(default_factory=Load)
    _estimate: Load | None = None  # until the next change (most decisions change one worker)

    def sent(self, key: str, routed: Routed) -> None:
        self.own.add(routed.load)
        self.since_report[key] = routed
        self._since.add(routed.load)
        self._estimate = None

    def prefilled(self, key: str, routed: Routed) -> None:
        """Its prompt is prefilled: it no longer adds prefill work."""
        tokens = routed.load.prefill_tokens
        routed.load.prefill_tokens = 0
        self.own.prefill_tokens -= tokens
        if key in self.since_report:
            self._since.prefill_tokens -= tokens
        self._estimate = None

    def finished(self, key: str, routed: Routed) -> None:
        self.own.add(routed.load, -1)
        if self.since_report.pop(key, None) is not None:
            self._since.add(routed.load, -1)
        self._estimate = None

    def reported(self, report: LoadReport) -> None:
        self.report = report
        self.since_report.clear()
        self._since = Load()
        self._estimate = None

    def estimate(self) -> Load:
        """The estimate (do not change it: it is kept until the next event)."""
        if self._estimate is None:
            self._estimate = self._compute()
        return self._estimate

    def _compute(self) -> Load:
        r, own = self.report, self.own
        if r is None:
            return Load(own.requests, own.prefill_tokens, own.tokens)
        s = self._since
        # a worker that predates active_requests reports only what its engine holds
        requests = max(r.active_requests, r.running_requests + r.waiting_requests)
        return Load(
            max(requests + s.requests, own.requests),
            max(r.prefill_tokens_pending + s.prefill_tokens, own.prefill_tokens),
            # a worker that predates active_tokens: its KV in use
            max((r.active_tokens or r.kv_used_blocks * self.block_size) + s.tokens, own.tokens),
        )

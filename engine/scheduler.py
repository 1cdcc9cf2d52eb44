"""Continuous batching under one token budget per step.

Each step the scheduler closes, for as many requests as fit, the gap between
`num_computed_tokens` and `num_tokens`:

1. Running requests first, in order: a decode needs 1 token, a prompt still being
   prefilled needs the rest of it (cut to the remaining budget: chunked prefill).
   When the KV pool cannot give a running request its blocks, the lowest-priority
   running request (the newest under FCFS) is preempted: its blocks are freed and
   it goes back to the front of the queue, to be recomputed later.
2. Then waiting requests, in queue order (FCFS, or priority then arrival), each
   after a prefix-cache lookup, while budget, sequence slots and blocks last.
   When nothing runs and the head cannot get its blocks, queued requests behind it
   that hold some give them back (the last first) and are recomputed later: no
   step would ever free a block otherwise.

**Lanes** (reasoning models, `long_thinking_tokens`): a request whose thinking budget
has at least that many tokens left is in the long lane, the rest in the short lane. A
queued short-lane request is admitted before long-lane ones (a long-lane head is
passed over at most `LANE_MAX_SKIPS` times), the step that admits it runs without the
long lane's decodes (one step of a long stream, for a prompt's first token), the long
lane holds at most three quarters of the sequence slots, and when every slot is taken a
waiting short-lane request preempts the long-lane one with the most thinking left (its
blocks stay in the prefix cache), so short requests are never stuck behind long
thinking streams.

Requests whose KV is being written by a remote prefill worker sit in
`remote_waiting`, outside both lists: they cost nothing per step until
`remote_kv_ready` queues them ahead of new arrivals, holding their blocks, for a
batch slot.

A step can find nothing to run: nothing runs and the head of the queue cannot get
its blocks, which requests waiting for remote KV pin (or, without chunked prefill,
it exceeds the token budget). Only an event from outside (a request arrives, ends
or is aborted, remote KV lands or fails, held blocks are released) can change
that, so until one does `has_work` is False and the caller's loop waits for it
instead of stepping through empty steps.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.config import SCHEDULING_POLICIES
from engine.kv_cache import KVCacheManager, PrefixHit
from engine.kv_cache.sessions import SessionHolds
from engine.request import Request, RequestStatus
from engine.spec.lookup import Speculator
from protocol.logprobs import TokenLogprob
from protocol.lora import AdapterRef
from protocol.sampling import MAX_SPECULATIVE_TOKENS


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request` from position `start` are computed this step.

    `samples` is True when they include the last known token, so the step yields the
    logits of the request's next token. A decode may carry `draft` tokens (speculative
    decoding): they follow its last token in `num_new_tokens`, and the step verifies
    them, emitting 1 to len(draft) + 1 tokens.

        positions:  | ... computed | last token | d_1 ... d_k |     num_new_tokens = 1 + k
    """

    request: Request
    num_new_tokens: int
    start: int
    samples: bool
    draft: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return cls(req, n, start, start + n == req.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) when `by_priority`."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[Request] = []

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        """The queue in admission order."""
        return iter(sorted(self._heap) if self.by_priority else list(self._fifo))

    def add(self, req: Request) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, req)
        else:
            self._fifo.append(req)

    def add_front(self, req: Request) -> None:
        """Re-queue a preempted request ahead of newer ones."""
        if self.by_priority:
            heapq.heappush(self._heap, req)
        else:
            self._fifo.appendleft(req)

    def peek(self) -> Request:
        return self._heap[0] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap) if self.by_priority else self._fifo.popleft()

    def remove(self, req: Request) -> None:
        if self.by_priority:
            self._heap.remove(req)
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(req)


# admissions a request at the head of the queue, waiting for a LoRA slot, lets others
# overtake it before it blocks the queue for its own adapter
LORA_MAX_SKIPS = 64
# admissions a long-lane request at the head of the queue lets short-lane ones overtake it
LANE_MAX_SKIPS = 256
LONG_LANE_SHARE = 0.75  # of max_num_seqs, the most the long lane runs at once

# how a turn ends that its session holds (not an abort or an error)
_TURN_ENDS = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        speculator: Speculator | None = None,
        session_ttl_s: float = 0.0,
        max_loras: int = 0,
        on_lora_wait: Callable[[Request], None] | None = None,
        long_thinking_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}"
            )
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.speculator = speculator  # None: no speculative decoding
        # LoRA adapters the running requests may use at once (the device slots; 0: no
        # adapters served); `on_lora_wait` hears of each request that waits for one
        self.max_loras = max_loras
        self.on_lora_wait = on_lora_wait
        self.clock = clock
        # lanes: the thinking budget left from which a request is in the long lane (0: off)
        self.long_thinking_tokens = long_thinking_tokens
        self.max_long = max(1, int(max_num_seqs * LONG_LANE_SHARE))
        self.lane_yields = 0  # steps whose long-lane decodes waited for a short prompt
        # finished turns of sessions, kept between turns (engine/kv_cache/sessions.py)
        self.sessions = SessionHolds(kv, session_ttl_s)
        self.waiting = WaitingQueue(policy == "priority")
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        # finished hold_blocks requests whose blocks someone still reads
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        # the last schedule() could run nothing, and nothing has happened since
        self.stalled = False
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        """Something a step can compute now: False while nothing runs or waits, and
        while `stalled` (the queue cannot move until a request or remote KV event)."""
        return bool(self.running or self.waiting) and not self.stalled

    # -- admission and removal --------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request for local prefill (ids are checked by
        `EngineCore.submit`, the one way in)."""
        self.stalled = False
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_request(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        self.stalled = False
        if request_id in self.remote_waiting:
            # Its blocks may still receive a remote write: they stay pinned until the
            # caller reports, through remote_kv_ready/failed, that no write can land.
            req.status = RequestStatus.FINISHED_ABORTED
            return req
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req.hold_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held[req.request_id] = req
        elif (
            status not in _TURN_ENDS
            or req.session_id is None
            or not self.sessions.keep(req, self.clock())
        ):
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.remote_waiting.pop(req.request_id, None)

    def kv_freed(self) -> None:
        """Blocks went back to the pool (or into the prefix cache) outside a step: a
        peer's copy or pull let go of them. A queue stalled for want of blocks may move."""
        self.stalled = False

    def release_held(self, request_id: str) -> None:
        req = self.held.pop(request_id, None)
        if req is None:
            raise KeyError(f"no held blocks for request id {request_id!r}")
        self.stalled = False
        self.kv.free(req)

    # -- remote prefill ---------------------------------------------------------

    def park_for_remote_kv(self, req: Request, hit: PrefixHit | None = None) -> int:
        """Allocate and pin blocks for the whole prompt; return the cached prefix length.

        `hit` is the prefix match the caller already made (looked up here otherwise).
        The request waits outside the batch until `remote_kv_ready`. Raises
        RuntimeError when the pool cannot hold the prompt now.
        """
        if hit is None:
            hit = self.kv.find_prefix(req)
        while not self.kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit):
            if not self.sessions.release_oldest():  # holds yield first
                raise RuntimeError("not enough free KV blocks to receive a remote prefill")
            hit = self.kv.find_prefix(req)
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_tokens = hit.num_tokens
        self._count_prefix(req, hit.num_tokens)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        self.remote_waiting[req.request_id] = req
        return hit.num_tokens

    def remote_kv_ready(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None
    ) -> Request:
        """The prompt's KV has landed: adopt it and the first token.

        The request rejoins the queue ahead of new arrivals holding its blocks, so
        admission (and its max_num_seqs cap) puts it into the batch for its decodes.
        """
        req = self.remote_waiting.pop(request_id)
        self.stalled = False
        if req.status == RequestStatus.FINISHED_ABORTED:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            return req
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.append_token(first_token)
        if logprob is not None and req.sampling_params.logprobs is not None:
            req.logprobs.append(logprob)
        status = self._stop_status(req)
        if status is not None:
            self._finish(req, status)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.add_front(req)
        return req

    def remote_kv_failed(self, request_id: str) -> Request:
        """No write can land any more: free the pinned blocks and prefill locally."""
        req = self.remote_waiting.pop(request_id)
        self.stalled = False
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = -1
        if req.status == RequestStatus.FINISHED_ABORTED:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.add_front(req)
        return req

    # -- the step -------------------------------------------------------------

    def long_lane(self, req: Request) -> bool:
        return 0 < self.long_thinking_tokens <= req.thinking_left

    def _short_prompt_waits(self) -> bool:
        """A short-lane request waits for its first step (and a slot is free for it)."""
        if not self.long_thinking_tokens or len(self.running) >= self.max_num_seqs:
            return False
        return any(r.num_computed_tokens == 0 and not self.long_lane(r) for r in self.waiting)

    def schedule(self) -> SchedulerOutput:
        if self.sessions.ttl_s:  # (off: no per-step work)
            self.sessions.expire(self.clock())
        yielding = self._short_prompt_waits() and any(map(self.long_lane, self.running))
        out = self._schedule(yielding)
        if yielding:
            if out.scheduled or out.preempted:
                self.lane_yields += 1
            else:  # the short prompt could not start: the long lane runs after all
                out = self._schedule(False)
        return out

    def _schedule(self, yielding: bool) -> SchedulerOutput:
        """One step's batch; `yielding`: the long lane's running requests sit it out."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if yielding and self.long_lane(req):
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            draft = self._draft(req, budget) if n == 1 else []
            if draft and self.kv.allocate_slots(req, 1 + len(draft)):
                out.scheduled.append(ScheduledRequest(req, 1 + len(draft), req.num_computed_tokens,
                                                      True, draft))  # fmt: skip
                budget -= 1 + len(draft)
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                if self.sessions.release_oldest():  # holds yield before a request does
                    continue
                victim = max(self.running) if self.policy == "priority" else self.running[-1]
                vi = self.running.index(victim)
                budget += self._preempt(victim, out)
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest.of(req, n))
                budget -= n
                i += 1
        if out.preempted:
            return out
        if self.long_thinking_tokens and len(self.running) >= self.max_num_seqs:
            budget += self._make_room_for_short(out)
        loras = {r.lora for r in self.running if r.lora is not None} if self.max_loras else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if self.long_thinking_tokens and self.long_lane(req):
                found = self._lane_next(req)
                if found is None:
                    break
                req = found
            if loras is not None and not self._lora_fits(req, loras):
                found = self._lora_fitting(req, loras)
                if found is None:
                    break
                req = found
            hit = self.kv.find_prefix(req) if req.num_computed_tokens == 0 else None
            computed = req.num_computed_tokens + (hit.num_tokens if hit else 0)
            n = req.num_tokens - computed
            if n > budget:
                if not self.chunked:
                    break
                n = budget
            if not self.kv.allocate_slots(req, n, hit):
                if self.sessions.release_oldest():  # holds yield: look the prefix up again
                    continue
                # Nothing runs, so no step will ever free a block: take them back from
                # the requests queued behind this one that hold some, or it waits forever.
                if self.running or not self._reclaim(req, out):
                    break
                continue
            if req is self.waiting.peek():
                self.waiting.pop()
            else:  # it overtook requests waiting for a LoRA slot or in the long lane
                self.waiting.remove(req)
            if loras is not None and req.lora is not None:
                loras.add(req.lora)
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
                self._count_prefix(req, computed)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, n))
            budget -= n
        self.stalled = not out.scheduled
        return out

    def _make_room_for_short(self, out: SchedulerOutput) -> int:
        """Every slot is taken and a short-lane request waits: preempt the long-lane
        request with the most thinking left (its blocks stay in the prefix cache, so it
        recomputes little when it comes back); returns the budget it gave back."""
        if not any(not self.long_lane(r) for r in self.waiting):
            return 0
        long = [r for r in self.running if self.long_lane(r)]
        if not long:
            return 0
        return self._preempt(max(long, key=lambda r: r.thinking_left), out)

    def _lane_next(self, head: Request) -> Request | None:
        """What to admit when a long-lane request heads the queue: the first short-lane
        one behind it (the head passed over at most LANE_MAX_SKIPS times while it could
        run), else the head while the long lane has slots left, else nothing."""
        short = next((r for r in self.waiting if not self.long_lane(r)), None)
        if sum(map(self.long_lane, self.running)) >= self.max_long:
            return short  # the rest of the slots are the short lane's
        if short is not None and head.lane_skips < LANE_MAX_SKIPS:
            head.lane_skips += 1
            return short
        return head

    def _lora_fits(self, req: Request, loras: set[AdapterRef]) -> bool:
        return req.lora is None or req.lora in loras or len(loras) < self.max_loras

    def _lora_fitting(self, head: Request, loras: set[AdapterRef]) -> Request | None:
        """The first queued request whose adapter fits the running ones', passing over
        those that wait for a slot (each counted once). The head is passed over for at
        most `LORA_MAX_SKIPS` admissions; after that nothing overtakes it, so the
        running adapters drain and its own gets a slot."""
        for req in self.waiting:
            if self._lora_fits(req, loras):
                if head.lora_skips >= LORA_MAX_SKIPS:
                    return None
                head.lora_skips += 1
                return req
            if req.lora_skips == 0 and self.on_lora_wait is not None:
                self.on_lora_wait(req)
            req.lora_skips = max(req.lora_skips, 1)
        return None

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Speculative draft tokens for a decoding request: its own draft length or the
        speculator's default, within what the budget, its max_tokens and the context
        window leave room to emit. A request that does not draft costs two reads."""
        sp = self.speculator
        if sp is None:
            return []
        want = req.sampling_params.num_speculative_tokens
        k = sp.num_tokens if want is None else want
        if k <= 0:
            return []
        k = min(
            k,
            MAX_SPECULATIVE_TOKENS,
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        # never take blocks the other running requests may need for this step
        if k <= 0 or not req.may_draft or self.kv.pool.num_free <= len(self.running):
            return []
        return sp.propose(req, k)

    def _count_prefix(self, req: Request, hit_tokens: int) -> None:
        self.prefix_queried_tokens += req.num_prompt_tokens
        self.prefix_hit_tokens += hit_tokens

    def _reclaim(self, head: Request, out: SchedulerOutput) -> bool:
        """Free the blocks of the last queued request other than `head` that holds some
        (its remote KV adopted, waiting for a batch slot): it recomputes when its turn
        comes, as a preempted request does. False when no such request is left.

        `head` then fits once enough are freed, or waits only for blocks that parked
        requests pin, which their remote KV landing or failing gives back.
        """
        holders = [r for r in self.waiting if r is not head and r.request_id in self.kv.req_blocks]
        if not holders:
            return False
        req = holders[-1]
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        out.preempted.append(req)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and requeue it; return budget it gave back."""
        given_back = 0
        for j, s in enumerate(out.scheduled):
            if s.request is req:
                given_back = s.num_new_tokens
                del out.scheduled[j]
                break
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.add_front(req)
        self.num_preemptions += 1
        out.preempted.append(req)
        return given_back

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance counters after the forward pass; append sampled tokens; finish.

        `sampled` maps request id -> token for the requests whose step sampled;
        `accepted` the draft tokens verification accepted (emitted before that token).
        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.finished:
                continue
            req.num_computed_tokens += s.num_new_tokens - len(s.draft)
            if s.draft:
                kept = (accepted or {}).get(req.request_id, [])
                if self.speculator is not None:
                    self.speculator.record(len(s.draft), len(kept))
                for drafted in kept:  # their KV was computed from the right inputs
                    self.record_sampled(req, drafted, finished)
                    if req.finished:
                        break
                    req.num_computed_tokens += 1
                if req.finished:
                    continue
            self.kv.cache_blocks(req, req.num_computed_tokens)
            token = sampled.get(req.request_id)
            if token is not None:
                self.record_sampled(req, token, finished)
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished

    def record_sampled(self, req: Request, token: int, finished: list[Request]) -> None:
        """Append a sampled token; finish the request (into `finished`) if it stops."""
        req.append_token(token)
        status = self._stop_status(req)
        if status is not None:
            self._finish(req, status)
            finished.append(req)

    def _stop_status(self, req: Request) -> RequestStatus | None:
        status = req.check_stop()
        if status is None and req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        return status

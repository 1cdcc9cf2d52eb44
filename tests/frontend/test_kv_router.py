"""The KV-aware router as a plain object: prefix against load, no pile-up, predictions,
sessions, two routers sharing load through the workers' reports."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from frontend.config import KvRouterConfig
from frontend.router import (
    Decision,
    KvRouter,
    PullHint,
    RouteRequest,
    RouterObserver,
    WorkerView,
)
from protocol.kv_layout import KvTier, hash_blocks
from runtime.rpc import KvRemoved, KvSnapshot, KvStored, LoadReport, LoadUpdate
from runtime.rpc.types import HOST_COST
from runtime.worker_info import KvLayout, WorkerInfo

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Seen(RouterObserver):
    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.hits: list[tuple[int, int, int]] = []

    def decided(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def prefilled(self, predicted: int, cached: int, prompt: int) -> None:
        self.hits.append((predicted, cached, prompt))


def info(wid: str, num_blocks: int = 4096) -> WorkerInfo:
    layout = KvLayout(num_blocks, 2, BS, 2, 64, "bfloat16")
    return WorkerInfo(wid, "decode", "m", grpc_address="h:1", kv_layout=layout)


def fleet(router: KvRouter, n: int) -> list[WorkerView]:
    views = [WorkerView(f"w{i}", info(f"w{i}"), 0, None) for i in range(n)]
    for v in views:
        router.worker_joined(v.info)
    return views


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(50_000) for _ in range(n))


def holds(router: KvRouter, wid: str, prompt: tuple[int, ...], seq: int = 1) -> None:
    router.on_event(wid, KvStored("inc", seq, tuple(hash_blocks(prompt, BS))))


def test_prefers_the_worker_holding_the_prefix() -> None:
    seen = Seen()
    r = KvRouter(KvRouterConfig(seed=0), observer=seen)
    views = fleet(r, 4)
    history = tokens(1000, 1)
    holds(r, "w2", history)
    req = RouteRequest("a", (*history, *tokens(40, 2)), session_id=None)
    assert r.select(req, views) == "w2"
    d = seen.decisions[-1]
    assert (d.reason, d.predicted_cached_tokens, d.best_cached_tokens) == ("prefix", 992, 992)
    r.on_prefilled(req, "w2", 992)
    assert seen.hits == [(992, 992, 1040)]
    r.on_finished(req, "w2", [1, 2, 3])
    assert r.in_flight == 0 and r.loads["w2"].own.requests == 0


def test_a_busy_holder_loses_to_an_idle_worker_past_the_prefix_value() -> None:
    # (workers that cannot pull from each other: the prefix moves only by prefill)
    r = KvRouter(KvRouterConfig(seed=0, peer_pull=False))
    views = fleet(r, 2)
    prefix = tokens(320, 3)  # 20 blocks
    holds(r, "w0", prefix)
    req = RouteRequest("a", (*prefix, 7))
    # w0 saves 320 tokens of prefill, worth 4 x 320 tokens of context (overlap_weight 4)
    for context, want in ((100, "w0"), (1270, "w0"), (1290, "w1"), (9000, "w1")):
        r.on_event("w0", LoadUpdate("inc", 1, LoadReport(active_tokens=context)))
        assert r.select(req, views) == want, context
        r.on_finished(req, want, ())
    # the weight moves the balance point: 0 ignores the cache
    r0 = KvRouter(KvRouterConfig(overlap_weight=0.0, seed=0, peer_pull=False))
    views = fleet(r0, 2)
    holds(r0, "w0", prefix)
    r0.on_event("w0", LoadUpdate("inc", 1, LoadReport(active_tokens=16)))
    assert r0.select(req, views) == "w1"


def test_a_pull_from_the_holder_prices_its_blocks_at_a_share_of_their_prefill() -> None:
    """With pulls, an idle worker that lacks the prefix costs its prefill less what the
    pull saves (1 - peer_pull_cost of it): the balance point moves from 4 x 320 tokens of
    the holder's context to 4 x 320 x peer_pull_cost, and the decision names the pull."""
    seen = Seen()
    r = KvRouter(KvRouterConfig(seed=0), observer=seen)  # peer_pull_cost 0.25
    views = fleet(r, 3)
    prefix = tokens(320, 3)  # 20 blocks
    holds(r, "w0", prefix)
    holds(r, "w1", prefix[:64])  # 4 of them
    req = RouteRequest("a", (*prefix, 7))
    for context, want in ((100, "w0"), (300, "w0"), (340, "w2"), (9000, "w2")):
        r.on_event("w0", LoadUpdate("inc", 1, LoadReport(active_tokens=context)))
        r.on_event("w1", LoadUpdate("inc", 1, LoadReport(active_tokens=context)))
        assert r.select(req, views) == want, context
        hint = r.pull_hint(req)
        if want == "w0":
            assert hint is None and seen.decisions[-1].reason == "prefix"
        else:  # the whole prefix from w0, not w1's four blocks
            assert hint == PullHint("w0", 20) and seen.decisions[-1].reason == "pull"
        assert r.pull_hint(req) is None  # asked once
        r.on_finished(req, want, ())
    # fewer blocks to gain than peer_pull_min_blocks: no pull, the prefill is priced whole
    r = KvRouter(KvRouterConfig(seed=0, peer_pull_min_blocks=21))
    views = fleet(r, 2)
    holds(r, "w0", prefix)
    r.on_event("w0", LoadUpdate("inc", 1, LoadReport(active_tokens=340)))
    assert r.select(req, views) == "w0" and r.pull_hint(req) is None


def test_a_hit_in_a_tier_is_priced_by_its_restore_cost() -> None:
    """Blocks a worker holds only in its host or disk tier (KV events say which) cost
    their copy back: a device hit beats a host hit beats a disk hit at equal load, by
    the share of prefill each costs (config defaults 0.1 and 0.5, or the worker's own
    measured figure from its load reports); a block restored moves back to free."""
    seen = Seen()
    r = KvRouter(KvRouterConfig(seed=0, peer_pull=False), observer=seen)
    views = fleet(r, 3)
    prefix = tokens(320, 3)  # 20 blocks
    hashes = tuple(hash_blocks(prefix, BS))
    for w in ("w0", "w1", "w2"):
        holds(r, w, prefix)
    r.on_event("w1", KvStored("inc", 2, hashes, tier=KvTier.HOST))
    r.on_event("w2", KvStored("inc", 2, hashes, tier=KvTier.DISK))
    req = RouteRequest("a", (*prefix, 7))
    # w0's device hit is free: it wins until its load outweighs w1's restore (0.1 x 4 x 320)
    for context, want in ((100, "w0"), (120, "w0"), (140, "w1")):
        r.on_event("w0", LoadUpdate("inc", 3, LoadReport(active_tokens=context)))
        assert r.select(req, views) == want, context
        r.on_finished(req, want, ())
    # w0 busy; w1 measures its host tier dearer than w2's disk default: w2 wins
    r.on_event("w0", LoadUpdate("inc", 3, LoadReport(active_tokens=10_000)))
    extra = {HOST_COST: 0.9}
    r.on_event("w1", LoadUpdate("inc", 3, LoadReport(extra=extra)))
    assert r.select(req, views) == "w2"
    assert seen.decisions[-1].predicted_cached_tokens == 320  # (the hit is still a hit)
    r.on_finished(req, "w2", ())
    # w2's blocks come back into its pool: free again
    r.on_event("w2", KvStored("inc", 3, hashes))
    assert r.select(req, views) == "w2"
    r.on_finished(req, "w2", ())
    # a snapshot says where each block is
    r.on_event("w0", LoadUpdate("inc", 3, LoadReport(active_tokens=100)))
    assert r.select(req, views) == "w2"
    r.on_finished(req, "w2", ())
    r.on_event("w2", KvSnapshot("inc", 4, frozenset(hashes), {h: KvTier.DISK for h in hashes}))
    assert r.select(req, views) == "w0"


def test_shared_system_prompt_does_not_pile_up() -> None:
    """Half the requests share one system prompt; workers cache what they serve (the
    prefill and its events are done before the next request comes). Requests stay spread
    evenly: the holders of the prompt are no magnet."""
    r = KvRouter(KvRouterConfig(seed=0))
    views = fleet(r, 8)
    system = tokens(800, 4)
    seq: Counter[str] = Counter()
    routed: list[tuple[RouteRequest, str]] = []
    for i in range(200):
        prompt = (*system, *tokens(100, 100 + i)) if i % 2 == 0 else tokens(900, 100 + i)
        req = RouteRequest(f"r{i}", prompt)
        wid = r.select(req, views)
        seq[wid] += 1
        holds(r, wid, prompt, seq[wid])
        r.on_prefilled(req, wid, None)
        routed.append((req, wid))
        if len(routed) > 40:  # requests end in arrival order: 40 in flight
            old, owner = routed.pop(0)
            r.on_finished(old, owner, ())
    counts = Counter(w for _, w in routed)
    assert max(counts.values()) <= 1.3 * 40 / 8
    # and the shared prompt spread to more than one worker, but not to every one
    sys_hashes = hash_blocks(system, BS)
    holders = [v.worker_id for v in views if r.index.holds(v.worker_id, sys_hashes[-1])]
    assert len(holders) > 1


def test_events_keep_the_index_true() -> None:
    r = KvRouter(KvRouterConfig(seed=0))
    fleet(r, 2)
    a = hash_blocks(tokens(64, 5), BS)
    r.on_event("w0", KvSnapshot("inc", 3, frozenset(a)))
    assert r.index.match(a) == {"w0": 4}
    r.on_event("w0", KvRemoved("inc", 4, tuple(a[2:])))
    assert r.index.match(a) == {"w0": 2}
    r.on_event("w0", KvSnapshot("inc", 9, frozenset()))
    assert r.index.match(a) == {}
    r.on_event("w1", KvStored("inc", 1, tuple(a)))
    r.worker_left("w1")
    assert r.index.match(a) == {} and "w1" not in r.loads
    r.on_event("w1", KvStored("inc", 2, tuple(a)))  # late, after it left: ignored
    assert r.index.match(a) == {}


def test_approximate_mode_predicts_from_its_own_routing() -> None:
    clock = Clock()
    r = KvRouter(KvRouterConfig(kv_events=False, predict_ttl_s=60, seed=0), clock=clock)
    views = fleet(r, 4)
    turn1 = tokens(500, 6)
    req1 = RouteRequest("t1", turn1)
    first = r.select(req1, views)
    reply = tokens(40, 7)
    r.on_finished(req1, first, reply)
    # the next turn holds turn 1 and its reply: it goes back, even though no event came
    r.on_event(first, KvStored("inc", 1, tuple(hash_blocks(tokens(99, 8), BS))))  # ignored
    clock.now = 30.0
    req2 = RouteRequest("t2", (*turn1, *reply, *tokens(30, 9)))
    assert r.select(req2, views) == first
    r.on_finished(req2, first, ())
    clock.now = 30.0 + 61
    picks = {r.select(RouteRequest(f"t{i}", (*turn1, 1)), views) for i in range(3, 12)}
    assert len(picks) > 1  # the prediction expired: the turn is no longer tied to `first`


def test_session_affinity_is_a_sticky_hint() -> None:
    clock = Clock()
    r = KvRouter(KvRouterConfig(kv_events=True, session_affinity=True, seed=0), clock=clock)
    views = fleet(r, 4)
    turn1 = RouteRequest("s1", tokens(600, 10), session_id="chat-1")
    w = r.select(turn1, views)
    r.on_finished(turn1, w, ())
    # a template that rewrites the history: the index holds nothing of the new prompt,
    # the hint still brings the session back
    turn2 = RouteRequest("s2", tokens(700, 11), session_id="chat-1")
    assert r.select(turn2, views) == w
    r.on_finished(turn2, w, ())
    clock.now = 10_000.0  # the session expired
    picks = {r.select(RouteRequest(f"s{i}", tokens(700, 11), session_id="chat-1"), views)
             for i in range(3, 15)}  # fmt: skip
    assert len(picks) > 1


def test_temperature_samples_but_prefers_cheap_workers() -> None:
    r = KvRouter(KvRouterConfig(temperature=0.3, seed=1))
    views = fleet(r, 3)
    for wid, context in (("w0", 0), ("w1", 800), ("w2", 8000)):
        r.on_event(wid, LoadUpdate("inc", 0, LoadReport(active_tokens=context)))
    picks: Counter[str] = Counter()
    for i in range(300):
        req = RouteRequest(f"r{i}", (1, 2, 3))
        picks[r.select(req, views)] += 1
        r.on_finished(req, "x", ())  # keep own load out of it
    assert picks["w0"] > picks["w1"] > picks["w2"] >= 0 and picks["w1"] > 0


def test_two_routers_see_each_others_load_through_reports() -> None:
    """Router A sends a burst; B hears of it only through the worker's reports, and then
    routes around it."""
    a, b = KvRouter(KvRouterConfig(seed=0)), KvRouter(KvRouterConfig(seed=1))
    va, vb = fleet(a, 2), fleet(b, 2)
    sent = [a.select(RouteRequest(f"a{i}", tokens(64, i)), va) for i in range(6)]
    assert Counter(sent) == {"w0": 3, "w1": 3}  # A spreads its own burst
    load = {w: sent.count(w) for w in ("w0", "w1")}
    busy = LoadReport(active_requests=5, active_tokens=320)
    a.on_event("w0", LoadUpdate("inc", 0, busy))
    b.on_event("w0", LoadUpdate("inc", 0, busy))
    b.on_event("w1", LoadUpdate("inc", 0, LoadReport(active_requests=1, active_tokens=64)))
    assert load and b.select(RouteRequest("b0", tokens(64, 99)), vb) == "w1"
    # A's own requests since the report still count on top of it
    est = a.loads["w0"].estimate()
    assert est.requests == 5 and est.tokens == 320
    a.select(RouteRequest("a9", tokens(64, 50)), va)
    assert sum(a.loads[w].estimate().requests for w in ("w0", "w1")) == 5 + 3 + 1


@pytest.mark.parametrize("bad", [{"overlap_weight": -1}, {"temperature": -0.1},
                                 {"predict_ttl_s": 0}])  # fmt: skip
def test_config_checks(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        KvRouterConfig(**bad)  # type: ignore[arg-type]


def test_an_adapter_prefers_the_worker_holding_it_in_a_slot_and_hashes_apart() -> None:
    """A LoRA adapter's request costs a worker without the adapter in a device slot
    `lora_load_tokens` of prefill; its prompt's blocks are the adapter's own (the base
    model's cached prefix is no hit for it)."""
    from protocol.lora import AdapterRef

    r = KvRouter(KvRouterConfig(seed=0, peer_pull=False))
    views = fleet(r, 2)
    sql = AdapterRef("sql", "/adapters/sql")
    r.on_event("w1", LoadUpdate("inc", 1, LoadReport(active_tokens=100, lora_resident=("sql",))))
    r.on_event("w0", LoadUpdate("inc", 1, LoadReport(active_tokens=100)))
    prompt = tokens(40, 9)
    adapted = RouteRequest("a", prompt, lora=sql)
    assert r.select(adapted, views) == "w1"
    r.on_finished(adapted, "w1", ())
    # the base model's request: the adapter does not steer it (a tie, either worker)
    assert {r.select(RouteRequest(f"b{i}", prompt), views) for i in range(20)} == {"w0", "w1"}
    # w0 holds the base model's prefix: no hit for the adapter, which stays with w1
    holds(r, "w0", prompt)
    assert r.select(RouteRequest("c", prompt), views) == "w0"
    assert r.select(RouteRequest("d", prompt, lora=sql), views) == "w1"
    # and one that holds the adapter's own prefix wins despite loading it
    r.on_event("w0", KvStored("inc", 2, tuple(hash_blocks(prompt, BS, adapter=sql))))
    assert r.select(RouteRequest("e", prompt, lora=sql), views) == "w0"
    # 0 load tokens: residence does not matter
    flat = KvRouter(KvRouterConfig(seed=0, peer_pull=False, lora_load_tokens=0.0))
    views = fleet(flat, 2)
    flat.on_event("w1", LoadUpdate("inc", 1, LoadReport(lora_resident=("sql",))))
    picks = {flat.select(RouteRequest(f"f{i}", prompt, lora=sql), views) for i in range(20)}
    assert picks == {"w0", "w1"}

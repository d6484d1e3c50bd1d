"""Scoring: longest consecutive prefix weighted by tier, shared tiers, speculative TTL, load, balance."""

from __future__ import annotations

import random

from kvtier.route.config import EngineSpec, RouteConfig
from kvtier.route.index import PrefixIndex, chunk_keys
from kvtier.route.score import LoadTracker, Scorer, Speculative

BS = 4
ENGINES = ["http://a", "http://b"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scorer(**kw) -> tuple[Scorer, Clock]:
    cfg = RouteConfig(engines=tuple(EngineSpec(u) for u in ENGINES), block_size=BS, **kw)
    clock = Clock()
    index = PrefixIndex(1000, BS)
    return Scorer(cfg, index, LoadTracker(), Speculative(cfg.speculative_ttl_s, 1000, clock)), clock


def _store(s: Scorer, engine: str, toks: list[int], medium: str = "GPU", tag: int = 0) -> None:
    n = len(toks) // BS
    s.index.apply_stored(engine, [(tag, engine, medium, i) for i in range(n)], None, toks, BS, medium)


def test_longest_consecutive_prefix_wins():
    s, _ = _scorer()
    doc = list(range(40))
    _store(s, "http://a", doc[:16])
    _store(s, "http://b", doc[:32])
    d = s.choose(ENGINES, chunk_keys(doc, BS), len(doc))
    assert d.engine == "http://b"
    by = {x.engine: x for x in d.scores}
    assert by["http://a"].matched_blocks == 4 and by["http://b"].matched_blocks == 8
    assert abs(by["http://b"].prefix - 0.8) < 1e-9


def test_a_hole_ends_the_prefix():
    s, _ = _scorer()
    doc = list(range(16))
    keys = chunk_keys(doc, BS)
    s.index.apply_stored("http://a", [1, 2], None, doc[:8], BS, "GPU")
    s.index.apply_removed("http://a", [1], "GPU")  # block 0 gone: block 1 alone is worthless
    d = s.choose(ENGINES, keys, len(doc))
    assert all(x.matched_blocks == 0 for x in d.scores)


def test_tier_weights_order_engine_pool_over_ram_over_disk():
    s, _ = _scorer()
    doc = list(range(16))
    _store(s, "http://a", doc, "DISK")
    _store(s, "http://b", doc, "CPU")
    d = s.choose(ENGINES, chunk_keys(doc, BS), len(doc))
    assert d.engine == "http://b"
    _store(s, "http://a", doc, "GPU", tag=1)
    assert s.choose(ENGINES, chunk_keys(doc, BS), len(doc)).engine == "http://a"


def test_shared_medium_counts_for_every_engine_at_its_weight():
    s, _ = _scorer()
    doc = list(range(16))
    _store(s, "http://a", doc, "REDIS")
    d = s.choose(ENGINES, chunk_keys(doc, BS), len(doc))
    by = {x.engine: x for x in d.scores}
    assert by["http://a"].matched_blocks == by["http://b"].matched_blocks == 4
    assert abs(by["http://b"].prefix - s.config.weight_of("REDIS")) < 1e-9
    # a longer local copy beats the shared one
    _store(s, "http://b", doc[:8], "CPU", tag=2)
    by = {x.engine: x for x in s.choose(ENGINES, chunk_keys(doc, BS), len(doc)).scores}
    assert by["http://b"].prefix > by["http://a"].prefix


def test_speculative_entries_pull_a_burst_together_then_expire():
    s, clock = _scorer(speculative_ttl_s=2.0, balance_ratio=0)
    doc = list(range(16))
    keys = chunk_keys(doc, BS)
    first = s.choose(ENGINES, keys, len(doc))
    s.commit(first, keys)
    assert s.choose(ENGINES, keys, len(doc)).engine == first.engine
    clock.now += 2.5
    d = s.choose(ENGINES, keys, len(doc))
    assert all(x.matched_blocks == 0 for x in d.scores)


def test_load_breaks_ties_and_queued_prefill_counts():
    s, _ = _scorer(balance_ratio=0)
    t = s.load.start("http://a", 4000)
    d = s.choose(ENGINES, [], 0)
    assert d.engine == "http://b"
    by = {x.engine: x for x in d.scores}
    assert by["http://a"].load == 0.0 and by["http://b"].load == 1.0
    s.load.finish(t)
    assert s.load.in_flight("http://a") == 0 and s.load.queued_prefill("http://a") == 0
    s.load.finish(t)  # idempotent
    assert s.load.in_flight("http://a") == 0


def test_a_busy_engine_holding_most_of_a_long_prompt_keeps_it_until_its_queue_is_as_long():
    """Load is measured against the request's own prefill: one request decoding on the engine that
    holds 7 of a prompt's 12 blocks is a shorter wait than recomputing 11 blocks on an idle engine
    that holds only the shared first one (relative load sent it there: a tie, broken by load);
    a queue longer than the prompt itself is not."""
    s, _ = _scorer(balance_ratio=0, prefill_norm_tokens=16)
    prompt = list(range(48))  # 12 blocks: P = 48 / 16 = 3
    keys = chunk_keys(prompt, BS)
    _store(s, "http://a", prompt[:28])  # 7 blocks
    _store(s, "http://b", prompt[:4], tag=1)  # the shared first block
    decoding = s.load.start("http://a", 20)
    s.load.first_byte(decoding)  # prefilled, now decoding: L(a) = 1
    d = s.choose(ENGINES, keys, len(prompt))
    by = {x.engine: x for x in d.scores}
    assert d.engine == "http://a", d
    assert abs(by["http://a"].load - (1 - 1 / 3)) < 1e-9 and by["http://b"].load == 1.0
    prefilling = s.load.start("http://a", 200)  # L(a) = 2 + 200 / 16: longer than the prompt
    assert s.choose(ENGINES, keys, len(prompt)).engine == "http://b"
    for t in (decoding, prefilling):
        s.load.finish(t)


def test_equally_busy_engines_leave_it_to_the_prefix_and_a_longer_queue_repels_short_prompts():
    s, _ = _scorer(balance_ratio=0, prefill_norm_tokens=16)
    doc = list(range(32))
    _store(s, "http://a", doc)
    tickets = [s.load.start(e, 0) for e in ENGINES for _ in range(5)]
    d = s.choose(ENGINES, chunk_keys(doc, BS), len(doc))
    assert d.engine == "http://a" and all(x.load == 1.0 for x in d.scores)
    tickets.append(s.load.start("http://a", 0))  # a: one request more
    short = list(range(500, 508))  # 8 tokens nobody holds: P = 0.5, a's extra request is longer
    d = s.choose(ENGINES, chunk_keys(short, BS), len(short))
    assert d.engine == "http://b" and {x.engine: x.load for x in d.scores} == {"http://a": 0.0, "http://b": 1.0}
    assert s.choose(ENGINES, [], 0).engine == "http://b"  # unknown length: any difference counts fully
    for t in tickets:
        s.load.finish(t)


def test_balance_guard_spreads_one_hot_prefix():
    s, _ = _scorer()
    hot = list(range(32))
    keys = chunk_keys(hot, BS)
    _store(s, "http://a", hot)
    counts = {e: 0 for e in ENGINES}
    for _ in range(60):
        d = s.choose(ENGINES, keys, len(hot))
        s.commit(d, keys)
        counts[d.engine] += 1
    assert max(counts.values()) / min(counts.values()) <= 1.5
    # without the guard, affinity alone piles everything on the holder
    s2, _ = _scorer(balance_ratio=0)
    _store(s2, "http://a", hot)
    assert {s2.choose(ENGINES, keys, len(hot)).engine for _ in range(10)} == {"http://a"}


def test_zipf_workload_keeps_documents_on_their_engine():
    """Simulated: events follow decisions; most requests land where their document is held."""
    s, _ = _scorer()
    rng = random.Random(0)
    docs = [list(range(d * 1000, d * 1000 + 32)) for d in range(8)]
    weights = [1 / (k + 1) ** 1.1 for k in range(8)]
    hits = 0
    for i in range(200):
        doc = docs[rng.choices(range(8), weights)[0]]
        keys = chunk_keys(doc, BS)
        d = s.choose(ENGINES, keys, len(doc))
        hits += d.matched_blocks() == len(keys)
        s.commit(d, keys)
        _store(s, d.engine, doc, tag=i)
    assert hits >= 170


def _fill_window(s, n: int, engines=ENGINES) -> None:
    """``n`` decisions of distinct cold prompts, alternating over ``engines`` (a measured window)."""
    for i in range(n):
        cold = list(range(10_000 + 100 * i, 10_000 + 100 * i + 8))
        keys = chunk_keys(cold, BS)
        d = s.choose([engines[i % len(engines)]], keys, len(cold))
        s.commit(d, keys)


def test_balance_guard_leaves_small_differences_to_affinity():
    s, _ = _scorer(balance_slack=2)
    _fill_window(s, 16)  # 8:8
    doc = list(range(32))
    keys = chunk_keys(doc, BS)
    engines = []
    for _ in range(3):  # a burst of one prefix: speculative entries keep it together
        d = s.choose(ENGINES, keys, len(doc))
        s.commit(d, keys)
        engines.append(d.engine)
    assert engines == [engines[0]] * 3  # 11:8 is within 1.5x
    d = s.choose(ENGINES, keys, len(doc))
    s.commit(d, keys)
    assert d.engine == engines[0]  # 12:8 still is
    d = s.choose(ENGINES, keys, len(doc))  # 13:8 would not be: the burst's fifth moves
    assert d.engine != engines[0]


def test_balance_guard_waits_for_half_a_window_of_decisions():
    """A share measured over a few decisions is noise: below half a window the guard never acts,
    so a burst of one prefix stays together on one engine."""
    s, _ = _scorer(balance_slack=2, balance_window=32)
    doc = list(range(32))
    keys = chunk_keys(doc, BS)
    engines = set()
    for _ in range(16):
        d = s.choose(ENGINES, keys, len(doc))
        assert not any(x.held_back for x in d.scores)
        s.commit(d, keys)
        engines.add(d.engine)
    assert len(engines) == 1
    d = s.choose(ENGINES, keys, len(doc))  # the 17th decision: 16:0 is measured, and over the share
    assert {x.engine for x in d.scores if x.held_back} == engines


def test_a_prefix_nobody_holds_goes_where_it_evens_out_the_shares():
    """Equal scores and equal load: the engine with fewer decisions in the window wins, not the
    one listed first (the guard is off here: this is the tie-break alone)."""
    s, _ = _scorer(balance_ratio=0)
    held = list(range(32))
    _store(s, "http://a", held)
    for _ in range(2):
        d = s.choose(ENGINES, chunk_keys(held, BS), len(held))
        assert d.engine == "http://a"
        s.commit(d, chunk_keys(held, BS))
    cold = list(range(500, 532))
    d = s.choose(ENGINES, chunk_keys(cold, BS), len(cold))
    assert {x.score for x in d.scores} == {d.scores[0].score}  # a tie
    assert d.engine == "http://b"
    s.commit(d, chunk_keys(cold, BS))
    other = list(range(900, 932))  # shares 2:1 -> still b; then 2:2 -> back to the first listed
    d = s.choose(ENGINES, chunk_keys(other, BS), len(other))
    assert d.engine == "http://b"
    s.commit(d, chunk_keys(other, BS))
    last = list(range(1300, 1332))
    assert s.choose(ENGINES, chunk_keys(last, BS), len(last)).engine == "http://a"


def test_guard_copies_the_dominant_prefix_not_a_lukewarm_one():
    """Two prefixes held by engine a only, one hot (3 of 4 requests) and one lukewarm; events
    follow decisions. The guard spreads the load by copying the hot prefix to b (once moved it
    moves for free); the lukewarm one is never recomputed on b."""
    s, _ = _scorer()
    hot, warm = list(range(32)), list(range(1000, 1032))
    _store(s, "http://a", hot)
    _store(s, "http://a", warm, tag=1)
    counts = {e: 0 for e in ENGINES}
    warm_on_b = 0
    for i in range(64):
        doc = warm if i % 4 == 3 else hot
        keys = chunk_keys(doc, BS)
        d = s.choose(ENGINES, keys, len(doc))
        s.commit(d, keys)
        _store(s, d.engine, doc, tag=100 + i)
        counts[d.engine] += 1
        warm_on_b += doc is warm and d.engine == "http://b"
    assert warm_on_b == 0
    assert counts["http://b"] > 0 and max(counts.values()) / min(counts.values()) <= 1.5, counts



def test_over_share_engine_keeps_lukewarm_requests_and_gives_up_the_dominant_prefix():
    """a is over its share with 12 requests of a hot prefix and 4 of a lukewarm one, both held by a
    only: a lukewarm request stays on a (moving it would recompute it), a hot one goes to b; with
    the dominance rule switched off (fault injection) the lukewarm one would move too."""
    def setup():
        s, _ = _scorer(balance_slack=2)
        hot, warm = list(range(32)), list(range(1000, 1032))
        _store(s, "http://a", hot)
        _store(s, "http://a", warm, tag=1)
        for doc in [hot] * 12 + [warm] * 4:  # half a window: the guard is measuring
            s.commit(s.choose(["http://a"], chunk_keys(doc, BS), len(doc)), chunk_keys(doc, BS))
        s.speculative.clear_engine("http://a")
        return s, hot, warm

    s, hot, warm = setup()
    assert s.shares() == {"http://a": 16}
    assert s.choose(ENGINES, chunk_keys(warm, BS), len(warm)).engine == "http://a"
    d = s.choose(ENGINES, chunk_keys(hot, BS), len(hot))
    assert d.engine == "http://b" and {x.engine for x in d.scores if x.held_back} == {"http://a"}
    s, hot, warm = setup()
    s._dominant = lambda engine, identity: True  # noqa: SLF001
    assert s.choose(ENGINES, chunk_keys(warm, BS), len(warm)).engine == "http://b"


def test_placements_even_out_the_distinct_prefixes_per_engine():
    """New documents (only a shared system prompt held, by both) arriving while engine a is
    always the idle one: placed by load alone they would all go to a; placed by working set they
    split evenly, and each document's re-reads then stay on its home (events follow decisions)."""
    s, _ = _scorer()
    system = list(range(8))
    for e in ENGINES:
        _store(s, e, system)
    docs = [system + list(range(1000 * (d + 1), 1000 * (d + 1) + 24)) for d in range(8)]
    busy = s.load.start("http://b", 0)  # b is always busy, a always idle
    home = {}
    for d, doc in enumerate(docs):
        keys = chunk_keys(doc, BS)
        decision = s.choose(ENGINES, keys, len(doc))
        assert decision.placement
        s.commit(decision, keys)
        _store(s, decision.engine, doc, tag=d)
        home[d] = decision.engine
    assert sorted(home.values()) == ["http://a"] * 4 + ["http://b"] * 4
    for d, doc in enumerate(docs):  # re-reads: affinity, not placement
        keys = chunk_keys(doc, BS)
        decision = s.choose(ENGINES, keys, len(doc))
        assert not decision.placement and decision.engine == home[d]
    s.load.finish(busy)


def test_a_placement_yields_to_load_when_the_roomy_engine_is_swamped():
    """The engine with the smaller working set is busier than the other by more than
    ``balance_slack`` + the prompt's own prefill (requests in flight + queued prefill /
    prefill_norm_tokens): load decides the placement."""
    s, _ = _scorer(balance_slack=2)
    for d in range(2):  # a already serves two prompts, b none
        doc = list(range(100 * d, 100 * d + 16))
        s.commit(s.choose(["http://a"], chunk_keys(doc, BS), len(doc)), chunk_keys(doc, BS))
    cold = list(range(5000, 5016))
    long_prefills = [s.load.start("http://b", 32_000) for _ in range(2)]  # 2 in flight, 64k tokens queued
    assert s.choose(ENGINES, chunk_keys(cold, BS), len(cold)).engine == "http://a"
    for t in long_prefills:
        s.load.finish(t)
    tickets = [s.load.start("http://b", 0) for _ in range(3)]
    decision = s.choose(ENGINES, chunk_keys(cold, BS), len(cold))
    assert decision.placement and decision.engine == "http://a"
    assert not any(x.crowded for x in decision.scores)
    s.load.finish(tickets[0])  # 2 beyond a: within the slack, the roomy engine takes it
    decision = s.choose(ENGINES, chunk_keys(cold, BS), len(cold))
    assert decision.engine == "http://b"
    assert {x.engine: x.crowded for x in decision.scores} == {"http://a": True, "http://b": False}


def test_placement_balance_is_off_with_the_guard_and_forgets_an_engine_that_left():
    """``balance_ratio=0`` turns placement by working set off (load alone places); ``forget``
    (an ejected engine) drops that engine's working set, so it gets placements again."""
    off, _ = _scorer(balance_ratio=0)
    on, _ = _scorer()
    for s in (off, on):
        for d in range(3):  # a serves three prompts
            doc = list(range(100 * d, 100 * d + 16))
            s.commit(s.choose(["http://a"], chunk_keys(doc, BS), len(doc)), chunk_keys(doc, BS))
    busy = [s.load.start("http://b", 0) for s in (off, on)]
    cold = list(range(7000, 7016))
    assert off.choose(ENGINES, chunk_keys(cold, BS), len(cold)).engine == "http://a"  # b is busy
    assert on.choose(ENGINES, chunk_keys(cold, BS), len(cold)).engine == "http://b"  # a's set is larger
    on.forget("http://a")
    assert on.choose(ENGINES, chunk_keys(cold, BS), len(cold)).engine == "http://a"
    assert on.shares() == {}
    del busy


def test_the_working_set_follows_the_window():
    """Decisions leaving the window leave the working set too (counted, not rebuilt)."""
    s, _ = _scorer(balance_window=4)
    docs = [list(range(100 * d, 100 * d + 16)) for d in range(6)]
    for doc in docs:
        s.commit(s.choose(["http://a"], chunk_keys(doc, BS), len(doc)), chunk_keys(doc, BS))
    assert set(s._working["http://a"]) == {k for doc in docs[2:] for k in chunk_keys(doc, BS)}

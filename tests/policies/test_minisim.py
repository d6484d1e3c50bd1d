"""The miniature simulations that choose the adaptive W-TinyLFU's window share (pure), and the
policy they drive."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.policies._minisim import SHARES, MiniSims, key_hash, min_entries, sample_rate
from kvtier.policies.registry import make_policy


def test_key_hash_is_reproducible_for_ints_salted_for_bytes_and_spreads_structured_keys():
    # ints (the simulator's keys) hash the same in another interpreter; bytes and str (the
    # store's) with Python's per-process salt, so a client cannot know which keys are sampled
    code = "from kvtier.policies._minisim import key_hash; print(key_hash(7), key_hash(b'k' * 32), key_hash('s'))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split() for seed in ("1", "2")]
    assert runs[0][0] == runs[1][0] == str(key_hash(7))
    assert runs[0][1] != runs[1][1] and runs[0][2] != runs[1][2]
    assert key_hash(b"k" * 32) == key_hash(bytes(b"k" * 32))
    for keys in (range(20_000), [i.to_bytes(32, "big") for i in range(20_000)], [f"k{i}" for i in range(20_000)]):
        buckets = [0] * 16
        for k in keys:
            buckets[key_hash(k) % 16] += 1
        assert min(buckets) > 0.8 * 20_000 / 16 and max(buckets) < 1.2 * 20_000 / 16


def test_sample_rate_keeps_miniatures_useful_and_cheap():
    assert min_entries(8) == 128  # smaller caches keep their window: no miniatures
    assert sample_rate(100_000, 8) == 100_000 // 128  # large caches: miniatures of ~128 entries
    assert sample_rate(1000, 8) == sample_rate(128, 8) == 16  # small: half a miniature update per request
    with pytest.raises(ValueError, match="at least 128 entries"):
        MiniSims(capacity=1000, entries=100)
    policy = make_policy("wtinylfu_adaptive", capacity_hint=100)
    for key in range(300):  # a 100-entry cache under the owner loop: never any miniatures
        if key not in policy:
            policy.miss(key)
            if len(policy) == 100:
                policy.remove(policy.victim())
            policy.insert(key, 1)
    assert policy.sample_rate is None and policy.window_share == 0.01


def _replay(sims: MiniSims, keys, periods: int) -> list[float]:
    """Feed ``keys`` in ``periods`` equal periods; the share chosen after each."""
    share, out, n = 0.01, [], len(keys) // periods
    for p in range(periods):
        for k in keys[p * n:(p + 1) * n]:
            sims.request(k, 1)
        share = sims.choose(share)
        out.append(share)
    return out


def _recency(n: int, seed: int, span: int = 400) -> list[int]:
    rng = random.Random(seed)
    keys, fresh = [], 0
    for _ in range(n):
        if fresh == 0 or rng.random() < 0.3:
            keys.append(fresh)
            fresh += 1
        else:
            keys.append(max(0, fresh - 1 - int(rng.expovariate(1 / span))))
    return keys


def test_the_first_period_only_warms_the_miniatures_then_recency_picks_the_largest_window():
    sims = MiniSims(capacity=500, entries=500)
    shares = _replay(sims, _recency(60_000, 4), 6)
    assert shares[0] == 0.01  # warm-up: the miniatures were empty
    assert shares[-1] == max(SHARES)  # re-reads of recent keys: an LRU-like window wins


def test_a_loop_larger_than_the_cache_keeps_the_smallest_window():
    sims = MiniSims(capacity=500, entries=500)
    loop = [i % 1500 for i in range(60_000)]
    assert max(_replay(sims, loop, 6)) <= 0.05  # frequency only: the window is useless
    assert sims.scores[-1] == min(sims.scores) < max(sims.scores)  # an LRU-like window thrashes


def test_a_near_tie_keeps_the_current_share_and_a_share_no_miniature_measures_moves():
    sims = MiniSims(capacity=200, entries=200, shares=(0.0, 0.01, 0.5))
    same = [i % 100 for i in range(20_000)]  # fits in every miniature: equal hits
    assert _replay(sims, same, 4) == [0.01] * 4
    assert sims.scores[0] == sims.scores[1] == sims.scores[2] > 0
    only = MiniSims(capacity=200, entries=200, shares=(1.0,))  # 0.01 is not measured: it moves
    assert _replay(only, same, 4)[-1] == 1.0


@pytest.mark.parametrize("shares", [(), (0.5, 1.5), (-0.1,), ("x",)])
def test_bad_shares_are_config_errors_at_construction(shares):
    with pytest.raises(ConfigError, match="window shares"):
        MiniSims(capacity=100, entries=10, shares=shares)
    with pytest.raises(ConfigError, match="window shares"):
        make_policy("wtinylfu_adaptive", capacity_hint=100, shares=shares)


def test_same_requests_give_same_choices():
    keys = [os.urandom(32) for _ in range(2000)]
    rng = random.Random(3)
    trace = [keys[min(int(rng.expovariate(1 / 300)), 1999)] for _ in range(40_000)]
    runs = [_replay(MiniSims(capacity=400, entries=400), trace, 8) for _ in range(2)]
    assert runs[0] == runs[1]


# -- the adaptive policy --------------------------------------------------------------------
class _Owner:
    """The owner loop of ``policies.base`` over a ``capacity``-byte cache; ``first_full``: the
    entries resident at the first eviction."""

    def __init__(self, policy, capacity: int):
        self.policy, self.capacity = policy, capacity
        self.used, self.resident, self.first_full = 0, {}, 0

    def request(self, key, size: int) -> None:
        policy = self.policy
        if key in policy:
            policy.access(key)
            return
        policy.miss(key)
        while self.used + size > self.capacity:
            self.first_full = self.first_full or len(policy)
            out = policy.victim()
            policy.remove(out)
            self.used -= self.resident.pop(out)
        policy.insert(key, size)
        self.resident[key] = size
        self.used += size

    def fill(self, sizes) -> None:
        for key, size in enumerate(sizes):
            self.request(key, size)


def test_adaptive_window_moves_once_full_and_keeps_its_byte_limit():
    """Sized entries under the owner loop: the share moves only once the cache is full, once per
    period, and after each move the window holds no more bytes than its share (plus one entry)."""
    from kvtier.sim import recency_trace

    capacity = 4000
    policy = make_policy("wtinylfu_adaptive", capacity_hint=capacity, min_period=500, period_factor=1)
    assert policy.sample_rate is None  # no miniatures before the first insert
    owner, checked, periods = _Owner(policy, capacity), 0, 0
    for key in recency_trace(0.3, 600, 30_000, 8):  # re-reads of recent keys: the window grows
        owner.request(key, 1 + key % 7)
        if len(policy.window_history) != periods:
            periods = len(policy.window_history)
            assert policy._bytes["window"] <= max(1, int(capacity * policy.window_share)) + 7
            checked += 1
    seen = [s for s, _ in policy.window_history]
    assert seen[0] > capacity // 7 and seen == sorted(seen) and checked >= 20
    assert len({share for _, share in policy.window_history}) > 1  # it did move
    # built at the first insert (key 0, 1 byte: 4,000 entries estimated), rebuilt when the cache
    # was first full with about a quarter of that (sizes 1-7)
    assert owner.first_full < capacity // 2 and policy.sample_rate == sample_rate(owner.first_full, len(SHARES))
    assert policy.window_share >= 0.5


def test_miniatures_built_at_the_first_insert_are_kept_when_the_estimate_holds():
    policy = make_policy("wtinylfu_adaptive", capacity_hint=64 * 1000)
    owner = _Owner(policy, 64 * 1000)
    owner.request(0, 64)
    sims = policy._sims
    owner.fill([64] * 3000)  # uniform sizes: the first entry's size gave the count exactly
    assert policy._sims is sims and sims.entries == 1000 and policy.sample_rate == sample_rate(1000, len(SHARES))


def test_miniatures_are_rebuilt_from_the_full_cache_when_the_first_entry_or_the_hint_misjudged_it():
    # a first entry 100 x the others: 10 entries estimated (too few for miniatures), 1,000 held
    big_first = _Owner(make_policy("wtinylfu_adaptive", capacity_hint=64_000), 64_000)
    big_first.fill([6400] + [64] * 3000)
    held, big_first = big_first.first_full, big_first.policy
    assert big_first.sample_rate == sample_rate(held, len(SHARES)) and big_first._sims.capacity > 60_000
    # a hint 16 x the real budget (a coded RAM arena's): the miniatures take the bytes really held
    over = make_policy("wtinylfu_adaptive", capacity_hint=16 * 64_000)
    _Owner(over, 64_000).fill([64] * 3000)
    assert 60_000 < over._sims.capacity <= 64_000


def test_a_policy_with_no_or_a_zero_hint_never_raises_from_the_owner_loop():
    for hint in (None, 0, 5):
        policy = make_policy("wtinylfu_adaptive", capacity_hint=hint)
        policy.insert("a", 0)
        assert policy.victim() == "a"
        policy.remove("a")
        assert policy.victim() is None

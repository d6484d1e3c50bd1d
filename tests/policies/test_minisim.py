"""The miniature simulations that choose the adaptive W-TinyLFU's window share (pure), and the
policy they drive."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.policies._minisim import SHARES, MiniSims, key_hash, sample_rate
from kvtier.policies.registry import make_policy


def test_key_hash_is_stable_and_spreads_structured_keys_over_buckets():
    assert key_hash(b"k" * 32) == key_hash(bytes(b"k" * 32)) == key_hash(bytearray(b"k" * 32))
    # no per-process salt (Python's own hash of bytes and str has one): another interpreter agrees
    code = "from kvtier.policies._minisim import key_hash; print(key_hash(b'k' * 32), key_hash('s'), key_hash(7))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.split() == [str(key_hash(b"k" * 32)), str(key_hash("s")), str(key_hash(7))]
    for keys in (range(20_000), [i.to_bytes(32, "big") for i in range(20_000)], [f"k{i}" for i in range(20_000)]):
        buckets = [0] * 16
        for k in keys:
            buckets[key_hash(k) % 16] += 1
        assert min(buckets) > 0.8 * 20_000 / 16 and max(buckets) < 1.2 * 20_000 / 16


def test_sample_rate_keeps_miniatures_useful_and_cheap():
    assert sample_rate(100_000, 8) == 100_000 // 128  # large caches: miniatures of ~128 entries
    assert sample_rate(1000, 8) == 16  # small: at most half a miniature update per request
    assert sample_rate(40, 8) == 5  # tiny: never fewer than 8 entries per miniature
    assert sample_rate(3, 8) == 1


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


def test_a_near_tie_keeps_the_current_share():
    sims = MiniSims(capacity=100, entries=100, shares=(0.0, 0.5))
    same = [i % 50 for i in range(10_000)]  # fits in every miniature: equal hits
    assert _replay(sims, same, 4) == [0.01] * 4
    assert sims.scores[0] == sims.scores[1] > 0


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
def test_adaptive_window_moves_once_full_and_keeps_its_byte_limit():
    """Sized entries under the owner loop: the share moves only once the cache is full, once per
    period, and after each move the window holds no more bytes than its share (plus one entry)."""
    from kvtier.sim import recency_trace

    capacity = 4000
    keys = recency_trace(0.3, 600, 30_000, 8)  # re-reads of recent keys: the window grows
    policy = make_policy("wtinylfu_adaptive", capacity_hint=capacity, min_period=500, period_factor=1)
    assert policy.sample_rate is None  # no miniatures before the first insert
    used = checked = 0
    resident: dict[int, int] = {}
    periods = 0
    for key in keys:
        size = 1 + key % 7
        if key in policy:
            policy.access(key)
        else:
            policy.miss(key)
            while used + size > capacity:
                out = policy.victim()
                policy.remove(out)
                used -= resident.pop(out)
            policy.insert(key, size)
            resident[key] = size
            used += size
        if len(policy.window_history) != periods:
            periods = len(policy.window_history)
            assert policy._bytes["window"] <= max(1, int(capacity * policy.window_share)) + 7
            checked += 1
    seen = [s for s, _ in policy.window_history]
    assert seen[0] > capacity // 7 and seen == sorted(seen) and checked >= 20
    assert len({share for _, share in policy.window_history}) > 1  # it did move
    # built at the first insert (key 0, 1 byte): entries estimated as capacity / that size
    assert policy.sample_rate == sample_rate(capacity // 1, len(SHARES))
    assert policy.window_share >= 0.5

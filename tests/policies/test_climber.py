"""The window hill climber's steps (pure) and the adaptive W-TinyLFU that it drives."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import ConfigError
from kvtier.policies._climber import HillClimber
from kvtier.policies.registry import make_policy

N = 10_000  # requests per period in the pure tests: band = sqrt(2 p (1 - p) / N), ~0.007 at p = 0.5


def test_first_period_moves_by_the_first_step_and_clamps_at_the_bounds():
    up = HillClimber(share=0.1, step=0.05)
    assert up.climb(0.5, N) == pytest.approx(0.15)
    down = HillClimber(share=0.01, step=-0.05)
    assert down.climb(0.5, N) == 0.0  # clamped at min_share
    top = HillClimber(share=0.78, step=0.05, max_share=0.8)
    assert top.climb(0.5, N) == 0.8


def test_better_keeps_the_direction_worse_reverses_it():
    c = HillClimber(share=0.3, step=0.1, decay=0.5, shrink=0.5, min_step=0.001)
    assert c.climb(0.40, N) == pytest.approx(0.4)  # first move: +0.1
    assert c.climb(0.44, N) == pytest.approx(0.45)  # better (+0.04 > band): same way, x decay
    assert c.climb(0.41, N) == pytest.approx(0.425)  # worse: reversed, x shrink
    assert c.next_step == pytest.approx(-0.025)
    assert c.climb(0.43, N) == pytest.approx(0.4125)  # better again: keeps going down


def test_a_change_inside_the_noise_band_shrinks_the_window():
    c = HillClimber(share=0.3, step=0.1, decay=1.0, min_step=0.001)
    c.climb(0.5, N)  # share 0.4, the move was upwards
    band = (2 * 0.5 * 0.5 / N) ** 0.5
    assert c.climb(0.5 + 0.5 * band, N) == pytest.approx(0.3)  # no evidence: back down
    # Fewer requests widen the band: the same change over 100 requests is noise too.
    d = HillClimber(share=0.3, step=0.1, decay=1.0, noise=1.0)
    d.climb(0.5, 100)
    assert d.climb(0.54, 100) == pytest.approx(0.3)
    e = HillClimber(share=0.3, step=0.1, decay=1.0, noise=0.0)  # no band: any gain counts
    e.climb(0.5, 100)
    assert e.climb(0.5001, 100) == pytest.approx(0.5)


def test_steps_decay_to_the_floor_and_a_jump_restarts_them():
    c = HillClimber(share=0.5, step=0.1, decay=0.5, shrink=0.5, min_step=0.02, restart=0.05)
    rate = 0.3
    c.climb(rate, N)
    for _ in range(6):  # steady gains of 0.02 (> band, < restart): the step halves to the floor
        rate += 0.02
        c.climb(rate, N)
    assert c.next_step == pytest.approx(0.02)
    c.climb(rate - 0.2, N)  # a new workload: reversed, full size again
    assert c.next_step == pytest.approx(-0.1)


def test_same_rates_give_same_shares():
    rng = random.Random(5)
    rates = [rng.random() for _ in range(200)]
    runs = []
    for _ in range(2):
        c = HillClimber(share=0.01, step=-0.0625)
        runs.append([c.climb(r, 5000) for r in rates])
    assert runs[0] == runs[1]
    assert all(0.0 <= s <= 0.8 for s in runs[0])


@pytest.mark.parametrize("kwargs, message", [
    ({"share": 0.9, "max_share": 0.8}, "window shares"),
    ({"min_share": -0.1}, "window shares"),
    ({"step": 0.0}, "window step"),
    ({"step": 0.001, "min_step": 0.01}, "window step"),
    ({"shrink": 0.0}, "window climb"),
    ({"noise": -1.0}, "window climb"),
])
def test_bad_settings_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HillClimber(**kwargs)


def test_bad_hit_rates_are_refused():
    c = HillClimber()
    for rate, requests in ((1.5, N), (-0.1, N), (0.5, 0)):
        with pytest.raises(ValueError, match="hit rate"):
            c.climb(rate, requests)


# -- the adaptive policy --------------------------------------------------------------------
def test_adaptive_window_climbs_once_full_and_keeps_its_byte_limit():
    """Sized entries under the owner loop: the share moves only once the cache is full, once per
    period, and after each move the window holds no more bytes than its share (plus one entry)."""
    rng = random.Random(8)
    capacity = 4000
    keys = [rng.randrange(3000) if rng.random() < 0.5 else rng.randrange(200) for _ in range(30_000)]
    policy = make_policy("wtinylfu_adaptive", capacity_hint=capacity, min_period=500, period_factor=1)
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

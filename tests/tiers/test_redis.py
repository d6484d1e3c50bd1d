"""Redis tier beyond the contract: server faults and reconnection, corruption, budget, TTL, secrets."""

from __future__ import annotations

import os
import time

import pytest

redis = pytest.importorskip("redis", reason="redis-py not installed (pip install kvtier[redis])")

from kvtier.bench.services import ServiceUnavailable, redis_server  # noqa: E402
from kvtier.tiers.redis import RedisTier  # noqa: E402

pytestmark = pytest.mark.redis


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make(url: str, **options) -> RedisTier:
    return RedisTier(RedisTier.Config(url=url, **options), name="redis")


@pytest.fixture
def own_server(tmp_path):
    """A private redis-server this test may stop and restart."""
    try:
        with redis_server(tmp_path) as srv:
            yield srv
    except ServiceUnavailable as exc:
        pytest.skip(f"redis-server unavailable: {exc}")


def test_server_down_gives_counted_misses_then_hits_resume(own_server):
    data = os.urandom(100_000)
    with make(own_server.url, backoff_ms=50, max_backoff_ms=200, connect_timeout_s=0.5) as tier:
        assert tier.put(key(1), data) and tier.get(key(1)) == data
        own_server.stop()
        started = time.monotonic()
        for _ in range(50):
            assert tier.get_into(key(1), bytearray(len(data))) is None
            assert tier.put(key(2), data) is False
            assert tier.contains_many([key(1), key(2)]) == [False, False]
        assert time.monotonic() - started < 5.0  # the breaker keeps a dead server cheap
        assert tier.stats.errors >= 150 and tier.stats.misses >= 50 and tier.stats.dropped >= 50
        own_server.start()  # same port; data is gone (no persistence)
        deadline = time.monotonic() + 10
        while not (tier.put(key(3), data) and tier.get(key(3)) == data):
            assert time.monotonic() < deadline, "tier did not reconnect"
        assert tier.contains(key(3))


def test_corrupt_value_is_a_counted_miss_and_removed(redis_url):
    raw = redis.Redis.from_url(redis_url)
    with make(redis_url, prefix="c:") as tier:
        assert tier.put(key(1), b"a" * 5000)
        value = bytearray(raw.get(b"c:" + key(1)))
        value[-1] ^= 0xFF
        raw.set(b"c:" + key(1), bytes(value))
        assert tier.get_into(key(1), bytearray(5000)) is None
        assert tier.stats.corrupt == 1 and tier.stats.misses == 1
        assert not raw.exists(b"c:" + key(1))
        raw.set(b"c:" + key(2), b"not an entry")
        assert tier.get(key(2)) is None and tier.stats.corrupt == 2
    raw.close()


def test_budget_evicts_oldest_written_across_instances(redis_url):
    with make(redis_url, capacity=10_000) as a, make(redis_url, capacity=10_000) as b:
        for i in range(5):
            assert (a if i % 2 else b).put(key(i), bytes([i]) * 4000)
        assert a.used_bytes() <= 10_000
        assert a.stats.evictions + b.stats.evictions >= 3
        assert not a.contains(key(0)) and a.contains(key(4))
        assert set(b.keys()) <= {key(i) for i in range(5)}


def test_ttl_is_set(redis_url):
    raw = redis.Redis.from_url(redis_url)
    with make(redis_url, prefix="t:", ttl_s=30) as tier:
        assert tier.put(key(1), b"x" * 10)
        assert 0 < raw.pttl(b"t:" + key(1)) <= 30_000
    raw.close()


def test_many_keys_in_one_round_trip(redis_url):
    with make(redis_url) as tier:
        for i in range(10):
            tier.put(key(i), bytes([i]) * 1000)
        outs = [bytearray(1000) for _ in range(12)]
        got = tier.get_many_into([key(i) for i in range(12)], outs)
        assert got == [1000] * 10 + [None, None]
        assert all(outs[i] == bytes([i]) * 1000 for i in range(10))


def test_password_stays_out_of_repr():
    config = RedisTier.Config(url="redis://:hunter2@127.0.0.1:1/0", password="hunter3")
    assert "hunter" not in repr(config)
    tier = RedisTier(config, name="r")
    assert "hunter" not in repr(tier)
    tier.close()

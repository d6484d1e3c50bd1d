"""Redis tier beyond the contract: server faults and reconnection, corruption, budget, TTL, secrets."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

redis = pytest.importorskip("redis", reason="redis-py not installed (pip install kvtier[redis])")

from kvtier.harness.services import BinaryMissing, redis_server  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.tiers.redis import RedisTier  # noqa: E402

pytestmark = pytest.mark.redis


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make(url: str, **options) -> RedisTier:
    return RedisTier(RedisTier.Config(url=url, **options), name="redis")


@pytest.fixture
def own_server(tmp_path):
    """A private redis-server this test may stop and restart (skips only when the binary is
    missing: an installed server that never gets ready is an error, not a skip)."""
    server = redis_server(tmp_path)
    try:
        srv = server.__enter__()
    except BinaryMissing as exc:
        pytest.skip(f"redis-server unavailable: {exc}")
    try:
        yield srv
    finally:
        server.__exit__(None, None, None)


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


def test_password_stays_out_of_repr():
    config = RedisTier.Config(url="redis://:hunter2@127.0.0.1:1/0", password="hunter3")
    assert "hunter" not in repr(config)
    tier = RedisTier(config, name="r")
    assert "hunter" not in repr(tier)
    tier.close()


# --- a hung server (SIGSTOP): deadlines, one probe at a time, recovery ------------------------

LOOKUP_S, DATA_S, SLACK_S = 0.2, 0.5, 0.5


@contextmanager
def hung(server):
    """SIGSTOP the redis-server process for the block (it accepts connections, never answers)."""
    pid = server.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _timed(fn, *args):
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


def test_hung_server_every_call_ends_within_its_deadline_then_recovers(own_server):
    data = os.urandom(200_000)
    with make(own_server.url, lookup_timeout_s=LOOKUP_S, timeout_s=DATA_S,
              backoff_ms=200, max_backoff_ms=400) as tier:
        assert tier.put(key(1), data)
        with hung(own_server):
            for i in range(10):
                found, took = _timed(tier.contains_many, [key(1), key(2)])
                assert found == [False, False] and took < LOOKUP_S + SLACK_S
                got, took = _timed(tier.get_into, key(1), bytearray(len(data)))
                assert got is None and took < DATA_S + SLACK_S
                stored, took = _timed(tier.put, key(100 + i), data)
                assert stored is False and took < DATA_S + SLACK_S
                assert tier.contains(key(1)) is False and tier.size_of(key(1)) is None
            assert tier.stats.errors >= 40 and tier.stats.dropped >= 10
        resumed = time.monotonic()
        while tier.get(key(1)) != data:  # the acknowledged put survived the hang
            assert time.monotonic() - resumed < 0.4 + DATA_S + 2.0, "no recovery after SIGCONT"
            time.sleep(0.02)
        recovered = time.monotonic() - resumed
        assert tier.contains(key(1)) and tier.put(key(2), data) and tier.get(key(2)) == data
        print(f"redis recovered {recovered:.2f} s after SIGCONT")


def test_hung_server_concurrent_callers_probe_one_at_a_time(own_server):
    callers, run_s = 8, 2.5
    with make(own_server.url, lookup_timeout_s=LOOKUP_S, timeout_s=DATA_S, max_connections=callers,
              backoff_ms=200, max_backoff_ms=400) as tier:
        assert tier.contains_many([key(1)]) == [False]  # connections are up
        durations: list[float] = []
        lock = threading.Lock()

        def caller():
            end = time.monotonic() + run_s
            while time.monotonic() < end:
                found, took = _timed(tier.contains_many, [key(1), key(2), key(3)])
                assert found == [False] * 3
                with lock:
                    durations.append(took)
                time.sleep(0.005)

        with hung(own_server):
            threads = [threading.Thread(target=caller) for _ in range(callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        waited = [d for d in durations if d >= 0.9 * LOOKUP_S]  # calls that reached the hung server
        assert max(durations) < LOOKUP_S + SLACK_S
        # the callers in flight when it hung, then one probe per window: not every caller each time
        assert len(waited) <= callers + tier._breaker.probes + 2, (len(waited), tier._breaker.probes)
        assert tier._breaker.probes <= run_s / 0.2 + 1
        assert len(durations) > 10 * len(waited)  # everyone else failed fast
        print(f"redis hung {run_s} s, {callers} callers: {len(durations)} calls, "
              f"{len(waited)} waited for the server, {tier._breaker.probes} probes")
        resumed = time.monotonic()
        while not tier.put(key(1), b"x" * 100):
            assert time.monotonic() - resumed < 0.4 + DATA_S + 2.0, "no recovery after SIGCONT"
            time.sleep(0.02)
        assert tier.contains_many([key(1)]) == [True]


def test_deadlines_are_validated():
    for bad in ({"lookup_timeout_s": 0}, {"timeout_s": -1.0}, {"timeout_s": float("nan")},
                {"connect_timeout_s": 1e9}, {"backoff_ms": 500, "max_backoff_ms": 100}):
        with pytest.raises(ConfigError, match="lookup_timeout_s|timeout_s|backoff_ms"):
            make("redis://127.0.0.1:1/0", **bad)

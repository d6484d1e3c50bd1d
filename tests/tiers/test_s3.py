"""S3 tier beyond the contract: unreachable and slow endpoints, corruption, budget, secrets."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("boto3", reason="boto3 not installed (pip install kvtier[s3])")

from kvtier.bench.services import free_port  # noqa: E402
from kvtier.tiers.s3 import S3Tier  # noqa: E402

pytestmark = pytest.mark.s3


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make(endpoint: str, bucket: str = "b", **options) -> S3Tier:
    options.setdefault("access_key", "k")
    options.setdefault("secret_key", "s")
    return S3Tier(S3Tier.Config(bucket=bucket, endpoint_url=endpoint, **options), name="s3")


@pytest.fixture
def silent_endpoint():
    """A fake endpoint that accepts connections and never answers (a hung S3 server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for s in held:
        s.close()
    listener.close()


def _exercise(tier: S3Tier, calls: int) -> None:
    for i in range(calls):
        assert tier.put(key(i), b"x" * 1000) is False
        assert tier.get_into(key(i), bytearray(1000)) is None
        assert tier.contains(key(i)) is False


def test_unreachable_endpoint_gives_counted_misses_quickly():
    tier = make(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5, max_attempts=2, backoff_ms=200)
    started = time.monotonic()
    _exercise(tier, 20)
    assert time.monotonic() - started < 10
    assert tier.stats.errors >= 40 and tier.stats.misses >= 20 and tier.stats.dropped >= 20
    tier.close()


def test_slow_endpoint_times_out_into_counted_misses(silent_endpoint):
    tier = make(silent_endpoint, read_timeout_s=0.3, connect_timeout_s=0.3, max_attempts=1, backoff_ms=1000)
    started = time.monotonic()
    _exercise(tier, 10)
    assert time.monotonic() - started < 10  # one timeout, then the breaker skips the rest
    assert tier.stats.errors >= 20 and tier.stats.misses >= 10
    tier.close()


def test_corrupt_object_is_a_counted_miss_and_deleted(s3_server, s3_bucket):
    client = s3_server.client()
    with make(s3_server.endpoint_url, s3_bucket, prefix="c/") as tier:
        assert tier.put(key(1), b"a" * 5000)
        name = "c/" + key(1).hex()
        body = bytearray(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
        body[-1] ^= 0xFF
        client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(body))
        assert tier.get_into(key(1), bytearray(5000)) is None
        assert tier.stats.corrupt == 1 and tier.stats.misses == 1
        assert client.list_objects_v2(Bucket=s3_bucket, Prefix="c/").get("KeyCount", 0) == 0


def test_budget_evicts_oldest_by_listing(s3_server, s3_bucket):
    with make(s3_server.endpoint_url, s3_bucket, capacity=10_000) as tier:
        for i in range(5):
            assert tier.put(key(i), bytes([i]) * 4000)
        assert tier.used_bytes() <= 10_000
        assert tier.stats.evictions >= 3
        assert tier.contains(key(4))


def test_parallel_put_and_get_many(s3_server, s3_bucket):
    with make(s3_server.endpoint_url, s3_bucket) as tier:
        items = [(key(i), bytes([i]) * 20_000) for i in range(16)]
        assert tier.put_many(items) == [True] * 16
        outs = [bytearray(20_000) for _ in range(17)]
        got = tier.get_many_into([k for k, _ in items] + [key(99)], outs)
        assert got == [20_000] * 16 + [None]
        assert all(outs[i] == items[i][1] for i in range(16))


def test_another_node_sees_objects_after_listing(s3_server, s3_bucket):
    a = make(s3_server.endpoint_url, s3_bucket, access_key=s3_server.access_key)
    b = make(s3_server.endpoint_url, s3_bucket, list_interval_s=0)
    assert a.put(key(1), b"z" * 300)
    assert b.contains(key(1)) and b.get(key(1)) == b"z" * 300
    assert b.delete(key(1))
    a.close()
    b.close()


def test_secret_stays_out_of_repr():
    config = S3Tier.Config(bucket="b", endpoint_url="http://127.0.0.1:1", access_key="AK", secret_key="hunter2")
    assert "hunter2" not in repr(config)
    tier = S3Tier(config, name="s3")
    assert "hunter2" not in repr(tier)
    tier.close()

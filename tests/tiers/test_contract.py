"""The tier contract (``kvtier.tiers.base``), run against every factory in ``conftest.FACTORIES``."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

SIZES = [0, 1, 4095, 4096, 4097, 300_001, 1 << 20]


def key(i: int | None = None) -> bytes:
    return os.urandom(32) if i is None else i.to_bytes(4, "little") * 8


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_bit_exact(tier, size):
    k, data = key(), payload(size, size)
    assert tier.put(k, data)
    assert tier.contains(k)
    assert tier.size_of(k) == size
    assert tier.get(k) == data
    out = bytearray(size + 10)
    assert tier.get_into(k, out) == size
    assert bytes(out[:size]) == data


def test_put_accepts_numpy_with_dtype_and_shape(tier):
    k = key()
    arr = np.arange(2 * 3 * 128, dtype=np.float16).reshape(2, 3, 128)
    assert tier.put(k, arr, dtype="float16", shape=arr.shape)
    out = np.empty_like(arr)
    assert tier.get_into(k, out) == arr.nbytes
    assert np.array_equal(out, arr)


def test_miss_is_none(tier):
    k = key()
    assert not tier.contains(k)
    assert tier.size_of(k) is None
    assert tier.get(k) is None
    assert tier.get_into(k, bytearray(16)) is None


def test_overwrite_leaves_one_complete_entry(tier):
    k = key()
    assert tier.put(k, payload(5000, 1))
    assert tier.put(k, payload(7000, 2))
    assert tier.get(k) == payload(7000, 2)
    assert list(tier.keys()).count(k) == 1
    assert tier.used_bytes() == 7000


def test_delete(tier):
    k = key()
    assert tier.put(k, b"x" * 100)
    assert tier.delete(k)
    assert not tier.contains(k)
    assert tier.get(k) is None
    assert not tier.delete(k)


def test_keys_and_contains_many(tier):
    ks = [key() for _ in range(5)]
    for i, k in enumerate(ks[:3]):
        assert tier.put(k, payload(100 + i, i))
    assert set(tier.keys()) == set(ks[:3])
    assert tier.contains_many(ks) == [True, True, True, False, False]


def test_used_bytes_accounting(tier):
    assert tier.used_bytes() == 0
    a, b = key(), key()
    tier.put(a, payload(1000))
    tier.put(b, payload(3000))
    assert tier.used_bytes() == 4000
    tier.delete(a)
    assert tier.used_bytes() == 3000
    tier.delete(b)
    assert tier.used_bytes() == 0


def test_put_beyond_capacity_is_refused_and_counted(tier_factory):
    tier = tier_factory(capacity=64 * 1024)
    if tier.self_managed:
        pytest.skip("self-managed tiers evict instead of refusing")
    assert tier.put(key(), payload(40 * 1024))
    assert not tier.put(key(), payload(40 * 1024))
    assert tier.stats.dropped == 1
    assert tier.used_bytes() <= tier.capacity_bytes


def test_too_small_buffer_is_a_counted_miss(tier):
    k = key()
    tier.put(k, payload(1000))
    errors = tier.stats.errors
    assert tier.get_into(k, bytearray(999)) is None
    assert tier.stats.errors == errors + 1
    assert tier.get(k) == payload(1000)  # the entry is unharmed


def test_stats_count_operations(tier):
    k = key()
    tier.put(k, payload(100))
    tier.get_into(k, bytearray(100))
    tier.get_into(key(), bytearray(100))
    tier.delete(k)
    stats = tier.stats.as_dict()
    assert (stats["puts"], stats["hits"], stats["misses"], stats["deletes"]) == (1, 1, 1, 1)
    assert stats["bytes_written"] == 100 and stats["bytes_read"] == 100


def test_concurrent_put_get_without_lost_or_mixed_entries(tier):
    # Each writer owns its keys; every payload is derived from (key, version), so a reader can
    # tell a mixed or foreign payload from a legitimate older or newer version.
    writers, per_writer, versions, size = 4, 8, 3, 20_000
    errors: list[str] = []

    def expected(k: bytes, version: int) -> bytes:
        return payload(size, int.from_bytes(k[:4], "little") * 10 + version)

    def write(w: int) -> None:
        for version in range(versions):
            for i in range(per_writer):
                k = key(w * 1000 + i)
                if not tier.put(k, expected(k, version)):
                    errors.append(f"put refused {w}/{i}")

    def read() -> None:
        out = bytearray(size)
        for _ in range(versions):
            for w in range(writers):
                for i in range(per_writer):
                    k = key(w * 1000 + i)
                    n = tier.get_into(k, out)
                    if n is not None and bytes(out) not in {expected(k, v) for v in range(versions)}:
                        errors.append(f"mixed bytes for {w}/{i}")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for w in range(writers):
        for i in range(per_writer):
            k = key(w * 1000 + i)
            assert tier.get(k) == expected(k, versions - 1)
    assert tier.used_bytes() == writers * per_writer * size
    assert tier.stats.corrupt == 0

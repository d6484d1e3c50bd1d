"""One contract, both store implementations (``KVStore``): the in-process TieredStore and the
ServerStore client of a real ``kvtier serve``. Whatever the connector or a tool does through
the interface behaves the same on either."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from kvtier.errors import InvalidKey
from kvtier.store import KVStore, StoreEvent


def key(i: int, ns: bytes = b"contract") -> bytes:
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


def payload(i: int, n: int = 100_000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_is_a_kvstore(store):
    assert isinstance(store, KVStore)
    assert store.tier_names and all(isinstance(n, str) for n in store.tier_names)


@pytest.mark.parametrize("size", [1, 4096, 65_536, 100_001, 300_000])
def test_put_then_get_and_get_into_are_bit_exact(store, size):
    data = payload(size, size)
    assert store.put(key(size), data)
    assert store.get(key(size)) == data
    out = bytearray(size + 10)
    assert store.get_into(key(size), out) == size and bytes(out[:size]) == data


def test_read_hands_segments_and_names_the_tier(store):
    assert store.put(key(1), payload(1))
    seen = []
    tier = store.read(key(1), lambda segs: seen.append(b"".join(bytes(memoryview(s)) for s in segs)))
    assert tier in store.tier_names and seen == [payload(1)]


def test_a_miss_is_a_value(store):
    assert store.get(key(404)) is None
    assert store.get_into(key(404), bytearray(10)) is None
    assert store.read(key(404), lambda segs: pytest.fail("consume called on a miss")) is None
    assert key(404) not in store


def test_a_buffer_too_small_is_a_miss_that_leaves_it_untouched(store):
    assert store.put(key(2), payload(2))
    out = bytearray(b"\x07" * 1000)
    assert store.get_into(key(2), out) is None
    assert out == bytearray(b"\x07" * 1000)
    assert store.get(key(2)) == payload(2)  # the store is unharmed


def test_write_fills_segments_of_exactly_nbytes(store):
    data = np.frombuffer(payload(3, 200_000), dtype=np.uint8)
    sizes = []

    def fill(segs):
        sizes.append(sum(s.size for s in segs))
        pos = 0
        for s in segs:
            s[:] = data[pos : pos + s.size]
            pos += s.size

    assert store.write(key(3), data.size, fill)
    assert sizes == [data.size] and store.get(key(3)) == data.tobytes()
    assert store.write(key(3), data.size, lambda segs: pytest.fail("filled twice"))  # held already


def test_a_failing_fill_propagates_and_stores_nothing(store):
    def fill(segs):
        raise RuntimeError("engine fault")

    with pytest.raises(RuntimeError, match="engine fault"):
        store.write(key(4), 10_000, fill)
    assert store.get(key(4)) is None
    assert store.put(key(4), payload(4)) and store.get(key(4)) == payload(4)


def test_lookup_counts_the_leading_chunks_only(store):
    chain = [key(10 + i) for i in range(5)]
    for i, k in enumerate(chain[:3]):
        assert store.put(k, payload(i, 5000), parent=chain[i - 1] if i else None, chunk_index=i)
    assert store.lookup(chain) == 3
    assert store.lookup(chain[1:]) == 2
    assert store.lookup([chain[3], *chain[:3]]) == 0
    assert store.lookup([]) == 0
    assert chain[0] in store and chain[4] not in store


def test_delete_removes_from_every_tier(store):
    assert store.put(key(5), payload(5))
    assert store.flush(10)
    assert store.delete(key(5)) is True
    assert store.flush(10)
    assert store.get(key(5)) is None and store.lookup([key(5)]) == 0


def test_invalid_keys_never_store_and_never_hit(store):
    for bad in (b"", b"x" * 31):
        try:
            stored = store.put(bad, payload(6, 100))
        except InvalidKey:
            stored = False
        assert stored is False
        assert store.get(bad) is None
    assert store.lookup([b"x" * 31]) == 0


def test_events_are_typed_and_handed_out_once(store):
    store.enable_events()
    assert store.put(key(7), payload(7))
    assert store.flush(10)
    events = store.take_events()
    assert all(isinstance(e, StoreEvent) for e in events)
    assert StoreEvent("stored", key(7), "CPU") in events
    kind, k, medium = events[0]  # still unpacks as a plain triple
    assert kind in ("stored", "removed") and len(k) == 32 and isinstance(medium, str)
    assert store.take_events() == []


def test_in_top_tier_answers_per_key_without_side_effects(store):
    assert store.put(key(8), payload(8))
    before = store.stats()
    near = store.in_top_tier([key(8), key(9)])
    assert len(near) == 2 and near[1] is False and all(isinstance(b, bool) for b in near)
    after = store.stats()
    assert before.get("hits") == after.get("hits")


def test_stats_and_flush(store):
    assert store.put(key(11), payload(11))
    assert store.flush(10) is True
    stats = store.stats()
    assert isinstance(stats, dict) and stats


def test_concurrent_writers_and_readers(store):
    errors: list[str] = []

    def worker(w: int) -> None:
        for i in range(10):
            k = key(1000 * w + i)
            data = payload(1000 * w + i, 20_000)
            if not store.put(k, data):
                errors.append(f"put {w}/{i}")
            elif store.get(k) != data:
                errors.append(f"get {w}/{i}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

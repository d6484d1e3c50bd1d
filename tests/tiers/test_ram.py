"""RAM tier specifics: capacity in pages, flat memory, the zero-copy path."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.ram import RamTier
from kvtier.tiers.registry import make_tier

PAGE = 4096


def make(capacity: int, **kw) -> RamTier:
    return RamTier(RamTier.Config(capacity=capacity, page_size=PAGE, **kw), name="ram")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_config_from_dict_accepts_sizes_and_rejects_unknown_keys():
    tier = make_tier({"type": "ram", "capacity": "1MiB", "page_size": "64KiB", "pin_memory": False})
    assert tier.capacity_bytes == 1024 * 1024 and not tier.pinned
    with pytest.raises(ConfigError, match="valid keys"):
        make_tier({"type": "ram", "capacity": "1MiB", "pages": 3})


def test_capacity_is_respected_in_whole_pages():
    tier = make(10 * PAGE)
    assert tier.footprint(PAGE + 1) == 2 * PAGE
    stored = [k for k in map(key, range(20)) if tier.put(k, b"x" * (PAGE + 1))]
    assert len(stored) == 5  # 2 pages each
    assert tier.stats.dropped == 15
    assert tier.free_bytes() == 0
    tier.delete(stored[0])
    assert tier.put(key(99), b"y" * (2 * PAGE))
    assert not tier.put(key(100), b"z" * (11 * PAGE))  # larger than the arena


def test_fragmented_entry_round_trips_across_extents():
    tier = make(8 * PAGE)
    for i in range(8):
        tier.put(key(i), bytes([i]) * PAGE)
    for i in (1, 3, 6):  # free pages 1, 3, 6: no two adjacent
        tier.delete(key(i))
    data = np.random.default_rng(0).integers(0, 256, 3 * PAGE - 7, dtype=np.uint8).tobytes()
    assert tier.put(key(50), data)
    assert len(tier.views(key(50))) == 3
    assert tier.get(key(50)) == data
    assert all(tier.get(key(i)) == bytes([i]) * PAGE for i in (0, 2, 4, 5, 7))


def test_resident_memory_stays_flat_across_put_delete_cycles():
    capacity = 32 * 1024 * 1024
    tier = RamTier(RamTier.Config(capacity=capacity, page_size=64 * 1024), name="ram")
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in (100_000, 700_000, 3_000_000)]
    out = np.empty(3_000_000, dtype=np.uint8)
    proc = psutil.Process()

    def cycle(start: int) -> None:
        keys = []
        for i in range(start, start + 40):
            k = key(i)
            if tier.put(k, payloads[i % 3]):
                keys.append(k)
            else:  # full: evict the oldest, as the store would
                tier.delete(keys.pop(0))
        for k in keys:
            tier.get_into(k, out)
            tier.delete(k)

    cycle(0)  # touch the arena once
    before = proc.memory_info().rss
    for n in range(1, 60):
        cycle(n * 40)
    growth = proc.memory_info().rss - before
    assert growth < 4 * 1024 * 1024, f"RSS grew by {growth} bytes"
    assert tier.used_bytes() == 0 and tier.free_bytes() == tier.capacity_bytes


def test_reserve_commit_abort():
    tier = make(16 * PAGE)
    k = key(1)
    views = tier.reserve(k, 3 * PAGE + 5)
    assert sum(v.nbytes for v in views) == 3 * PAGE + 5
    assert not tier.contains(k) and tier.get(k) is None and list(tier.keys()) == []
    assert tier.used_bytes() == 3 * PAGE + 5
    assert tier.reserve(k, 10) is None  # one open reservation per key
    pos = 0
    for v in views:
        v[:] = np.arange(pos, pos + v.nbytes) % 251
        pos += v.nbytes
    assert tier.commit(k)
    assert tier.get(k) == (np.arange(3 * PAGE + 5) % 251).astype(np.uint8).tobytes()
    assert not tier.commit(k)

    other = key(2)
    assert tier.reserve(other, 5 * PAGE) is not None
    assert tier.abort(other)
    assert not tier.abort(other)
    assert not tier.contains(other)
    assert tier.used_bytes() == 3 * PAGE + 5
    assert tier.free_bytes() == 12 * PAGE


def test_views_are_read_only_and_borrow_keeps_pages_until_released():
    tier = make(2 * PAGE)
    a = key(1)
    tier.put(a, b"a" * (2 * PAGE))
    views = tier.views(a)
    with pytest.raises(ValueError):
        views[0][0] = 0
    with tier.borrow(a) as borrowed:
        tier.delete(a)
        assert not tier.put(key(2), b"b" * PAGE)  # a's pages are still lent out
        assert b"".join(v.tobytes() for v in borrowed) == b"a" * (2 * PAGE)
    assert tier.put(key(2), b"b" * PAGE)
    with tier.borrow(key(3)) as missing:
        assert missing is None


def test_borrow_many_pins_a_batch_as_borrow_pins_one_and_counts_alike():
    """Hits and misses mixed, a key twice: each hit's bytes, pages kept through a delete until
    the block ends, and the same hit/miss/byte counts as one ``borrow`` per key."""
    tier = make(4 * PAGE)
    tier.put(key(1), b"a" * PAGE)
    tier.put(key(2), b"b" * (2 * PAGE))
    before = tier.stats.as_dict()
    with tier.borrow_many([key(1), key(9), key(2), key(1)]) as views:
        tier.delete(key(1))
        tier.delete(key(2))
        assert not tier.put(key(3), b"c" * (2 * PAGE))  # every page is still lent out
        assert [None if v is None else b"".join(x.tobytes() for x in v) for v in views] == [
            b"a" * PAGE, None, b"b" * (2 * PAGE), b"a" * PAGE]
        with pytest.raises(ValueError):
            views[0][0][0] = 0
    after = tier.stats.as_dict()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (3, 1)
    assert after["bytes_read"] - before["bytes_read"] == 4 * PAGE
    assert tier.free_bytes() == 4 * PAGE and tier.put(key(3), b"c" * (4 * PAGE))


def test_shared_arena_that_cannot_be_reserved_leaves_no_file(tmp_path, monkeypatch):
    """A full tmpfs (``reserve_file`` refuses) raises OutOfSpace and removes the half-made file."""
    from kvtier.errors import OutOfSpace
    from kvtier.tiers import ram

    def full(fd, size, path, what):
        raise OutOfSpace(f"{what}: no space for {size} bytes in {path}")

    monkeypatch.setattr(ram, "reserve_file", full)
    path = tmp_path / "arena"
    with pytest.raises(OutOfSpace):
        ram._map_shared(str(path), 16 * PAGE, "ram")
    assert not path.exists()

"""The store lock's contract (``kvtier/store/tiered.py``): no tier method runs while the store's
lock is held, except the top arena's page operations (memcpys).

Every tier of a real mix (RAM, two disk tiers, fs, redis-server) is wrapped in a probe that
records any method that runs on a thread holding the store's lock; the store is then driven
through puts, gets, deletes, evictions, demotions (also from a disk tier to the next, whose
bytes are read back), promotions, prefetch and stats from several threads at once.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import traceback

import numpy as np
import pytest

from kvtier.policies.lru import LRUPolicy
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.fs import FsConfig, FsTier
from kvtier.tiers.ram import RamConfig, RamTier

PAGE = 4096
CHECKED = ("contains", "contains_many", "size_of", "get_into", "get", "put", "delete", "keys", "used_bytes",
           "close", "views", "borrow", "borrow_many", "reserve", "commit", "abort", "footprint", "free_bytes")
ARENA = frozenset({"views", "borrow", "borrow_many", "reserve", "commit", "abort", "footprint", "free_bytes",
                   "delete"})


class LockProbe:
    """Wraps tiers' methods (on the instance) to record calls made while ``lock`` is held by
    the calling thread."""

    def __init__(self) -> None:
        self.lock = None  # the store's RLock, set once the store exists
        self.violations: list[str] = []
        self.calls: collections.Counter = collections.Counter()
        self._guard = threading.Lock()

    def wrap(self, tier, allowed: frozenset = frozenset()):
        for name in CHECKED:
            method = getattr(tier, name, None)
            if method is not None:
                setattr(tier, name, self._checked(tier.name, name, method, name in allowed))
        return tier

    def _checked(self, tier_name: str, name: str, method, allowed: bool):
        def call(*args, **kwargs):
            held = self.lock is not None and self.lock._is_owned()
            with self._guard:
                self.calls[(tier_name, name)] += 1
                if held and not allowed:
                    stack = "".join(traceback.format_stack(limit=8)[:-1])
                    self.violations.append(f"{tier_name}.{name} ran under the store lock:\n{stack}")
            return method(*args, **kwargs)
        return call


def key(i: int, ns: bytes = b"k") -> bytes:
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


def payload(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def build(tmp_path, redis_url: str, prefix: str, top: str, write_through: bool):
    """A probed store: ``top`` "ram" (an arena) or "disk" (no arena: every call is checked)."""
    from kvtier.tiers.redis import RedisConfig, RedisTier

    probe = LockProbe()
    levels = []
    if top == "ram":
        ram = RamTier(RamConfig(capacity=4 * PAGE, page_size=PAGE, pin_memory=False), name="ram")
        levels.append((probe.wrap(ram, ARENA), LRUPolicy()))
    else:
        top_disk = DiskTier(DiskConfig(path=str(tmp_path / "top"), capacity=4 * PAGE, drop_cache=False), name="top")
        levels.append((probe.wrap(top_disk), LRUPolicy()))
    disk = DiskTier(DiskConfig(path=str(tmp_path / "d1"), capacity=8 * PAGE, drop_cache=False), name="disk")
    disk2 = DiskTier(DiskConfig(path=str(tmp_path / "d2"), capacity=4 << 20, drop_cache=False), name="disk2")
    fs = FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=4 << 20), name="fs")
    redis = RedisTier(RedisConfig(url=redis_url, capacity=4 << 20, prefix=prefix), name="redis")
    levels += [(probe.wrap(disk), LRUPolicy()), (probe.wrap(disk2), LRUPolicy()), (probe.wrap(fs), None),
               (probe.wrap(redis), None)]
    store = TieredStore(levels, StoreConfig(write_through=write_through, write_queue_depth=256))
    probe.lock = store._lock
    return store, probe


def drive(store: TieredStore, t: int, errors: list[str]) -> None:
    """One client: chains of puts (evicting down the levels), reads of old chunks (lower-tier
    hits, promoted), prefetch, deletes (some while copies are queued), lookups, stats."""
    ns = bytes([t])
    keys = [key(i, ns) for i in range(24)]
    for i, k in enumerate(keys):
        store.put(k, payload(1000 * t + i), parent=keys[i - 1] if i % 4 else None, chunk_index=i % 4)
        if i % 5 == 4:
            store.delete(keys[i - 1])  # its copies may still be queued or under way
    store.flush(30)
    store.stats()
    for i in range(0, 24, 3):  # old chunks: most live in lower tiers now
        got = store.get(keys[i])
        if got is not None and got != payload(1000 * t + i):
            errors.append(f"client {t}: wrong bytes for chunk {i}")
    store.prefetch(keys[:4])
    store.lookup(keys)
    store.locate(keys[5])
    store.in_top_tier(keys)
    with store.borrow_top(keys[:6]) as entries:
        for i, segments in enumerate(entries):
            if segments is not None and b"".join(bytes(s) for s in segments) != payload(1000 * t + i):
                errors.append(f"client {t}: wrong pinned bytes for chunk {i}")
    for i in range(0, 24, 4):
        store.delete(keys[i])
    store.stats()


def read_from_disk(store: TieredStore) -> None:
    """A read served by the ``disk`` tier, whatever the clients' interleaving left there: fresh
    chunks are put until one lives in ``disk`` (not above it), then read back."""
    for i in range(64):
        k = key(i, b"tail")
        store.put(k, payload(5000 + i))
        store.flush(30)
        for j in range(i + 1):
            old = key(j, b"tail")
            if store.locate(old) == "disk":
                assert store.get(old) == payload(5000 + j)
                return
    raise AssertionError("no chunk reached the disk tier")


@pytest.mark.parametrize("top, write_through", [("ram", False), ("ram", True), ("disk", False)])
def test_no_tier_method_runs_under_the_store_lock(tmp_path, redis_url, key_prefix, top, write_through):
    store, probe = build(tmp_path, redis_url, key_prefix, top, write_through)
    errors: list[str] = []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            store.stats()
            stop.wait(0.01)

    scraper = threading.Thread(target=scrape, daemon=True)
    clients = [threading.Thread(target=drive, args=(store, t, errors), daemon=True) for t in range(3)]
    scraper.start()
    for th in clients:
        th.start()
    for th in clients:
        th.join(120)
    stop.set()
    scraper.join(10)
    assert not any(th.is_alive() for th in clients)
    assert store.flush(30)
    read_from_disk(store)
    stats = store.stats()
    store.close()
    assert not errors, errors
    assert not probe.violations, probe.violations[0]
    # The paths were really taken (the probe saw them).
    assert stats["evictions"] > 0 and stats["promotions"] > 0
    if not write_through:
        assert stats["demotions"] > 0
    for name in ("disk", "disk2", "fs", "redis"):
        if write_through or name.startswith("disk"):  # demotions go to managed tiers only
            assert probe.calls[(name, "put")] > 0, name
        assert probe.calls[(name, "delete")] > 0, name
    assert probe.calls[("fs", "used_bytes")] > 0 and probe.calls[("redis", "used_bytes")] > 0
    assert probe.calls[("disk", "get_into")] > 0, "no read from disk"  # hits, and demotions to disk2
    if top == "ram":
        assert probe.calls[("ram", "borrow_many")] > 0, "no batched pin of the arena (borrow_top)"
    assert store._ledger.idle()


def test_the_probe_catches_a_tier_call_under_the_lock(tmp_path, redis_url, key_prefix):
    """The probe is not vacuous: a tier method called with the store's lock held is recorded."""
    store, probe = build(tmp_path, redis_url, key_prefix, "ram", True)
    try:
        with store._lock:
            store.tiers[3].used_bytes()  # what stats() did before issue 25
        assert len(probe.violations) == 1 and "fs.used_bytes" in probe.violations[0]
    finally:
        store.close()


def test_a_write_through_copy_reads_the_entry_after_the_lock(tmp_path, monkeypatch):
    """A write-through copy gathered the top entry's pages into a snapshot with the store lock
    held: a memcpy of the whole entry (4 MiB chunks: ~0.4 ms) that every RAM hit waited behind,
    on the writer's thread. Now the writer pins the pages under the lock and copies after it;
    the lower tier still gets the exact bytes."""
    import kvtier.store.tiered as tiered

    ram = RamTier(RamConfig(capacity=64 * PAGE, page_size=PAGE, pin_memory=False), name="ram")
    fs = FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=4 << 20, usage_refresh_s=0), name="fs")
    store = TieredStore([(ram, LRUPolicy()), (fs, None)], StoreConfig(write_queue_depth=64))
    under_lock = []
    real_gather = tiered.gather_into

    def gather(segments, out):
        if threading.current_thread().name.startswith("kvtier-writer"):
            under_lock.append(store._lock._is_owned())
        return real_gather(segments, out)

    monkeypatch.setattr(tiered, "gather_into", gather)
    try:
        for i in range(60):  # one page each, then every other one deleted: the arena's free pages are apart
            assert store.put(key(i, b"small"), payload(i))
        assert store.flush(30)
        for i in range(0, 60, 2):
            store.delete(key(i, b"small"))
        for i in range(6):
            assert store.put(key(i), payload(i, 3 * PAGE + 100))  # four pages apart: gathered
        assert store.flush(30)
        assert not any(under_lock), "the writer copied an entry with the store lock held"
        assert len(under_lock) >= 6  # the copies of the large entries were gathered, after the lock
        for i in range(6):
            assert fs.get(key(i)) == payload(i, 3 * PAGE + 100)
    finally:
        store.close()

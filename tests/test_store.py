"""TieredStore against real tiers: RAM + disk under a temp dir.

Fakes appear only to inject faults (a tier that raises, a tier held behind a gate to fill a
queue). Waits poll with a deadline; nothing sleeps a fixed time. Policy targets (hit ratios) are
tested in tests/policies; here the policy is LRU so eviction order is predictable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import numpy as np
import psutil
import pytest

from kvtier.errors import ConfigError
from kvtier.policies.lru import LRUPolicy
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.disk import DiskConfig, DiskTier, entry_path
from kvtier.tiers.ram import RamConfig, RamTier

PAGE = 4096


def key(i: int, ns: bytes = b"k") -> bytes:
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


def payload(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def wait_for(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred`` until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.002)
    return True


def config(tmp_path, ram_pages: int = 4, disk: str = "4MiB", **store) -> dict:
    return {
        "tiers": [
            {"type": "ram", "capacity": ram_pages * PAGE, "page_size": PAGE, "policy": "lru"},
            {"type": "disk", "path": str(tmp_path / "disk"), "capacity": disk, "policy": "lru",
             "drop_cache": False},
        ],
        **store,
    }


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(**kw) -> TieredStore:
        store = TieredStore.from_config(config(tmp_path, **kw))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def tier_stats(store: TieredStore, name: str) -> dict:
    return next(t for t in store.stats()["tiers"] if t["name"] == name)


def assert_accounting(store: TieredStore) -> None:
    """The store's used bytes per tier agree with what the tier itself holds (self-managed
    tiers, which report their own figures, are left out)."""
    for t, tier in zip(store.stats()["tiers"], store.tiers):
        if tier.self_managed:
            continue
        assert t["used_bytes"] == tier.used_bytes(), t["name"]
        assert t["entries"] == len(list(tier.keys())), t["name"]


# ------------------------------------------------------------------------------------ fault fakes


class GatedRam(RamTier):
    """A slow lower tier: ``put`` waits until the gate opens."""

    def __init__(self, capacity: int, name: str = "gated"):
        super().__init__(RamConfig(capacity=capacity, page_size=PAGE, pin_memory=False), name=name)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, key, data, dtype="uint8", shape=None) -> bool:
        self.entered.set()
        self.gate.wait(30)
        return super().put(key, data, dtype, shape)


class FaultyDisk(DiskTier):
    """A disk tier whose reads and/or writes raise (a tier must not, but a buggy one may)."""

    fail_get = False
    fail_put = False

    def get_into(self, key, out):
        if self.fail_get:
            raise OSError("injected read fault")
        return super().get_into(key, out)

    def put(self, key, data, dtype="uint8", shape=None) -> bool:
        if self.fail_put:
            raise OSError("injected write fault")
        return super().put(key, data, dtype, shape)


def ram(pages: int) -> RamTier:
    return RamTier(RamConfig(capacity=pages * PAGE, page_size=PAGE, pin_memory=False), name="ram")


def store_over(levels, **cfg) -> TieredStore:
    return TieredStore([(tier, LRUPolicy()) for tier in levels], StoreConfig(**cfg))


# ------------------------------------------------------------------------------------ lookups, reads


def test_lookup_counts_leading_chunks_in_any_tier_without_side_effects(make_store):
    store = make_store(ram_pages=2)
    keys = [key(i) for i in range(4)]
    for i, k in enumerate(keys):
        assert store.put(k, payload(i), parent=keys[i - 1] if i else None, chunk_index=i)
    assert store.flush()
    where = [store.locate(k) for k in keys]
    assert "disk" in where and "ram" in where  # the chain spans both tiers
    before = (store.stats()["tiers"], where)

    assert store.lookup(keys) == 4
    assert store.lookup(keys[:2] + [key(99)] + keys[2:]) == 2
    assert store.lookup([key(99)] + keys) == 0
    assert store.lookup([]) == 0

    after = (store.stats()["tiers"], [store.locate(k) for k in keys])
    assert after == before  # no promotion, no tier reads, no counters moved


def test_lookup_does_not_refresh_recency(make_store):
    store = make_store(ram_pages=2, write_through=False)
    a, b, c = key(1), key(2), key(3)
    store.put(a, payload(1))
    store.put(b, payload(2))
    assert store.lookup([a]) == 1  # a lookup is not a use: a stays the LRU victim
    store.put(c, payload(3))
    assert store.locate(a) != "ram" and store.locate(b) == "ram"


@pytest.mark.parametrize("size", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 7])
def test_get_and_get_into_are_bit_exact_from_each_tier(make_store, size):
    store = make_store(ram_pages=8)
    data = payload(size, size)
    k = key(size)
    assert store.put(k, data)
    assert store.get(k) == data
    out = bytearray(size + 100)
    assert store.get_into(k, out) == size
    assert bytes(out[:size]) == data
    assert store.flush()
    # Push it out of RAM (write-through already copied it to disk).
    for i in range(8):
        store.put(key(i, b"filler"), payload(i))
    assert store.locate(k) == "disk"
    arr = np.zeros(size, dtype=np.uint8)
    assert store.get_into(k, arr) == size
    assert arr.tobytes() == data
    assert store.get(k) == data
    assert store.get(key(12345)) is None
    assert store.get_into(key(12345), bytearray(8)) is None


def test_lower_tier_hit_is_promoted_to_the_top_tier(make_store):
    store = make_store(ram_pages=2, write_through=False)
    for i in range(4):
        store.put(key(i), payload(i))
    assert store.flush()
    assert store.locate(key(0)) == "disk"
    seen = []
    assert store.read(key(0), lambda segs: seen.append(b"".join(bytes(s) for s in segs))) == "disk"
    assert seen == [payload(0)]
    assert store.locate(key(0)) == "ram"
    assert store.stats()["promotions"] == 1
    assert store.read(key(0), lambda segs: None) == "ram"
    assert store.get(key(0)) == payload(0)
    assert_accounting(store)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_a_chunk_key_of_another_bytes_type_is_the_same_key_everywhere(make_store, kind):
    """A 32-byte bytearray or memoryview is a chunk key (``is_valid_key``): put, read, locate
    and delete take it as the bytes it holds, never fail on it (a bytearray is not hashable)."""
    store = make_store()
    k = kind(key(1))
    assert store.put(k, payload(1), parent=kind(key(0)))
    seen = []
    assert store.read(k, lambda segs: seen.append(b"".join(bytes(x) for x in segs))) == "ram"
    assert seen == [payload(1)] and store.get(key(1)) == payload(1) and store.locate(k) == "ram"
    assert store.delete(k) and key(1) not in store
    assert_accounting(store)


def test_borrow_top_pins_the_top_tiers_entries_at_once_and_leaves_the_others_to_read(make_store):
    """One call pins every top-tier entry asked for (counted as hits); an entry in a lower tier,
    an absent key or an invalid one is None there (not promoted, not a miss). An entry deleted,
    or evicted, while pinned keeps its bytes until the block ends."""
    store = make_store(ram_pages=2, write_through=False)
    for i in range(3):
        store.put(key(i), payload(i))
    assert store.flush() and store.locate(key(0)) == "disk"
    hits = store.stats()["hits"]
    asked = [key(1), key(0), key(2), key(9), b"short"]
    with store.borrow_top(asked) as entries:
        assert [e is not None for e in entries] == [True, False, True, False, False]
        assert store.delete(key(1))
        store.put(key(5), payload(5))  # needs room: evicts a pinned entry
        store.put(key(6), payload(6))
        assert [b"".join(bytes(s) for s in entries[i]) for i in (0, 2)] == [payload(1), payload(2)]
    assert store.stats()["hits"] == hits + 2
    assert store.locate(key(0)) == "disk" and key(1) not in store
    assert_accounting(store)


# ------------------------------------------------------------------------------------ eviction


@pytest.mark.parametrize("write_through", [False, True])
def test_eviction_from_the_top_tier_demotes_to_the_next(make_store, write_through):
    store = make_store(ram_pages=4, write_through=write_through)
    for i in range(10):
        assert store.put(key(i), payload(i))
        # Each put waits for the copies before it: a victim's pages still pinned by its
        # write-through copy are not free yet, and the put would evict one entry more.
        assert store.flush()
    for i in range(6):
        assert store.locate(key(i)) == "disk", i
    for i in range(6, 10):
        assert store.locate(key(i)) == "ram", i
    disk = store.tiers[1]
    for i in range(6):  # straight from the disk tier: really there, bit-exact
        assert disk.get(key(i)) == payload(i)
    stats = store.stats()
    assert stats["evictions"] == 6
    if write_through:
        assert all(disk.contains(key(i)) for i in range(10))
        assert stats["demotions"] == 0  # the copies were already on their way down
    else:
        assert not any(disk.contains(key(i)) for i in range(6, 10))
        assert stats["demotions"] == 6
    assert stats["write_drops"] == 0
    assert_accounting(store)


def test_within_a_chain_the_tail_is_evicted_before_the_head(make_store):
    store = make_store(ram_pages=4, write_through=False)
    chain = [key(i, b"a") for i in range(4)]
    for i, k in enumerate(chain):
        store.put(k, payload(i), parent=chain[i - 1] if i else None, chunk_index=i)
    # LRU alone would evict a0 then a1; chain-aware eviction takes the tail instead.
    store.put(key(0, b"b"), payload(10))
    store.put(key(1, b"b"), payload(11), parent=key(0, b"b"), chunk_index=1)
    assert store.flush()
    assert [store.locate(k) for k in chain] == ["ram", "ram", "disk", "disk"]
    assert store.lookup(chain) == 4  # still all present, now across tiers
    assert [store.get(k) for k in chain] == [payload(i) for i in range(4)]


def test_a_cyclic_parent_link_does_not_hang_eviction(make_store):
    store = make_store(ram_pages=2, write_through=False)
    a, b = key(1), key(2)
    store.put(a, payload(1), parent=a)  # a caller bug: a chunk named as its own parent
    store.put(b, payload(2), parent=b)
    done = threading.Event()

    def fill():
        for i in range(3, 8):
            store.put(key(i), payload(i))
        done.set()

    threading.Thread(target=fill, daemon=True).start()
    assert done.wait(10), "eviction loops on a cyclic chain"
    assert store.flush()
    assert store.get(a) == payload(1)


def test_entries_that_are_not_page_multiples_still_fit_after_making_room(make_store):
    # Each entry takes 2 pages of a 4-page arena while its payload is barely over one page:
    # making room by payload bytes alone would leave the arena without free pages.
    store = make_store(ram_pages=4, write_through=False)
    size = PAGE + 1
    for i in range(8):
        assert store.put(key(i), payload(i, size)), i
        assert store.locate(key(i)) == "ram"
    assert tier_stats(store, "ram")["dropped"] == 0
    for i in range(8):  # each promotion evicts (demotes) another: let that land before its read
        assert store.flush()
        assert store.get(key(i)) == payload(i, size), i
    assert_accounting(store)


def test_entry_larger_than_the_top_tier_is_refused(make_store):
    store = make_store(ram_pages=2)
    assert not store.put(key(1), payload(1, 2 * PAGE + 1))
    assert store.lookup([key(1)]) == 0
    assert store.put(key(2), payload(2, 2 * PAGE))


# ------------------------------------------------------------------------------------ background writes


def test_full_write_queue_drops_and_counts_without_blocking():
    lower = GatedRam(64 * PAGE)
    store = store_over([ram(16), lower], write_queue_depth=2)
    try:
        assert store.put(key(0), payload(0))
        assert lower.entered.wait(10)  # the worker holds item 0 behind the gate
        done = threading.Event()

        def burst():
            for i in range(1, 10):
                store.put(key(i), payload(i))
            done.set()

        threading.Thread(target=burst, daemon=True).start()
        assert done.wait(10), "put blocked on a full queue"
        stats = store.stats()
        assert stats["write_drops"] == 7  # 2 fit in the queue
        assert tier_stats(store, "gated")["dropped"] == 7
        assert tier_stats(store, "gated")["queue_depth"] == 2
        assert all(store.get(key(i)) == payload(i) for i in range(10))  # the top tier has all
        lower.gate.set()
        assert store.flush()
        assert sorted(lower.keys()) == sorted(key(i) for i in range(3))
    finally:
        lower.gate.set()
        store.close()


@pytest.mark.skipif(not hasattr(os, "getpriority") or not os.uname().sysname == "Linux",
                    reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("nice", [0, 10])
def test_lower_tier_writers_run_nicer_than_the_engine(nice):
    """``writer_nice``: the writer thread of a lower tier runs that many steps nicer than the
    thread that built the store (which, in the connector, is the engine's), and the engine's
    own thread is left as it was."""
    lower = GatedRam(64 * PAGE)
    me = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, me)
    if nice and before + nice > 19:
        pytest.skip(f"this test runs at nice {before}: no room to be {nice} nicer")
    store = store_over([ram(16), lower], writer_nice=nice)
    try:
        assert store.put(key(0), payload(0))
        assert lower.entered.wait(10)  # the writer is running
        writer = next(t for t in threading.enumerate() if t.name == "kvtier-writer-gated")
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, before + nice)
        assert os.getpriority(os.PRIO_PROCESS, me) == before
        lower.gate.set()
        assert store.flush() and lower.get(key(0)) == payload(0)
    finally:
        lower.gate.set()
        store.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.uname().sysname == "Linux",
                    reason="SCHED_IDLE is Linux's")
def test_idle_writers_run_under_sched_idle_and_the_engine_thread_is_left_alone():
    """``writer_idle``: the lower tier's writer thread runs under SCHED_IDLE (a core only when
    no other thread wants one), still carries its copies out, and the thread that built the
    store keeps its policy."""
    lower = GatedRam(64 * PAGE)
    me = threading.get_native_id()
    before = os.sched_getscheduler(me)
    store = store_over([ram(16), lower], writer_idle=True)
    try:
        assert store.put(key(0), payload(0))
        assert lower.entered.wait(10)
        writer = next(t for t in threading.enumerate() if t.name == "kvtier-writer-gated")
        assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
        assert os.sched_getscheduler(me) == before != os.SCHED_IDLE
        lower.gate.set()
        assert store.flush() and lower.get(key(0)) == payload(0)
    finally:
        lower.gate.set()
        store.close()


def test_idle_and_nice_writers_are_one_choice():
    with pytest.raises(ConfigError, match="writer_idle and store.writer_nice 5: set one"):
        StoreConfig(tiers=[{"type": "ram", "capacity": "1MiB"}], writer_idle=True, writer_nice=5)


def test_top_entry_evicted_before_its_lower_write_ran_still_reaches_the_lower_tier():
    lower = GatedRam(64 * PAGE)
    store = store_over([ram(2), lower], write_queue_depth=64)
    try:
        store.put(key(0), payload(0))
        assert lower.entered.wait(10)
        for i in range(1, 8):  # evicts 0..5 from the top while their writes wait
            store.put(key(i), payload(i))
        # neither tier's index has it now: its pages, kept for the waiting copy, still serve it
        assert not store.in_top_tier([key(1)])[0] and store.locate(key(1)) == "ram"
        assert store.get(key(1)) == payload(1)
        lower.gate.set()
        assert store.flush()
        for i in range(8):
            assert lower.get(key(i)) == payload(i), i
            assert store.get(key(i)) == payload(i), i
        assert store._ledger.idle()  # no bytes kept past their writes
    finally:
        lower.gate.set()
        store.close()


def _top_with_a_dirty_victim():
    """A store over a gated lower tier whose top (4 pages, LRU) holds two entries already
    written below (0, 1, used last) and two whose lower copies wait (10 in flight at the gate,
    11 queued behind it): the LRU victims are the waiting ones."""
    lower = GatedRam(64 * PAGE)
    store = store_over([ram(4), lower], write_queue_depth=64)
    lower.gate.set()
    for i in (0, 1):
        assert store.put(key(i), payload(i))
    assert store.flush()
    lower.gate.clear()
    lower.entered.clear()
    assert store.put(key(10), payload(10))
    assert lower.entered.wait(10)  # 10's copy holds its pages at the gate
    assert store.put(key(11), payload(11))  # 11's copy is queued behind it
    assert store.get(key(0)) == payload(0) and store.get(key(1)) == payload(1)  # 10, 11 are LRU now
    return store, lower


def test_evicting_an_entry_whose_lower_copy_waits_pins_its_pages_instead_of_copying_them():
    """The first pass of an engine over a RAM tier and a slower one: an eviction of a top entry
    whose write-through copy has not read it yet keeps its arena pages pinned for that copy (no
    copy on the evicting thread, which is the engine's), evicts a clean entry for the room, and
    the arena gets the pages back once the copy is done."""
    from kvtier.store.writeback import Orphan

    store, lower = _top_with_a_dirty_victim()
    top = store.tiers[0]
    try:
        assert store.put(key(12), payload(12))
        orphan = store._ledger.orphan(key(11))
        assert isinstance(orphan, Orphan)
        assert np.shares_memory(orphan.hold()[0], top._arena)  # the arena's own pages, not a copy
        orphan.drop()
        assert store.in_top_tier([key(0), key(1), key(12)]) == [False, True, True]  # a clean entry made the room
        assert store.get(key(1)) == payload(1) and store.get(key(12)) == payload(12)
        lower.gate.set()
        assert store.flush()
        for i in (0, 1, 10, 11, 12):
            assert lower.get(key(i)) == payload(i), i
        assert store._ledger.idle()
        assert top.free_bytes() + top.used_bytes() == top.capacity_bytes  # every pinned page came back
    finally:
        lower.gate.set()
        store.close()


def test_a_delete_releases_the_pinned_pages_of_an_evicted_entry_and_its_copy_is_skipped():
    store, lower = _top_with_a_dirty_victim()
    top = store.tiers[0]
    try:
        assert store.put(key(12), payload(12))
        assert store._ledger.orphan(key(11)) is not None
        store.delete(key(11))
        assert store._ledger.orphan(key(11)) is None
        lower.gate.set()
        assert store.flush()
        assert lower.get(key(11)) is None and store.get(key(11)) is None
        assert lower.get(key(10)) == payload(10)
        assert store._ledger.idle()
        assert top.free_bytes() + top.used_bytes() == top.capacity_bytes
    finally:
        lower.gate.set()
        store.close()


def test_prefetch_promotes_in_the_background(make_store):
    store = make_store(ram_pages=4, write_through=False)
    chain = [key(i) for i in range(6)]
    for i, k in enumerate(chain):
        store.put(k, payload(i))
    for i in range(4):
        store.put(key(i, b"other"), payload(100 + i))
    assert store.flush()
    assert all(store.locate(k) == "disk" for k in chain)
    store.prefetch(chain[:3])
    assert wait_for(lambda: all(store.locate(k) == "ram" for k in chain[:3]))
    assert store.stats()["promotions"] == 3
    assert [store.get(k) for k in chain[:3]] == [payload(i) for i in range(3)]

    misses = store.stats()["misses"]
    store.prefetch([key(999), chain[4]])  # stops at the first missing chunk
    assert wait_for(lambda: store.stats()["misses"] == misses + 1)
    assert store.locate(chain[4]) == "disk"


def test_prefetch_is_one_worker_with_a_bounded_queue(make_store):
    """Requests queue for one prefetch thread (not a thread per call); while it is busy, a full
    queue drops requests and counts them, and the caller never waits."""
    store = make_store(ram_pages=4, write_queue_depth=2)
    store.put(key(0), payload(0))
    threads = threading.active_count()
    with store._lock:  # the worker blocks on its first request
        answers = [store.prefetch([key(0)]) for _ in range(10)]
        assert threading.active_count() <= threads + 1
    assert answers[0] and not all(answers)
    assert store.stats()["prefetch_drops"] == answers.count(False) >= 10 - 3


def test_stats_per_tier(make_store):
    store = make_store(ram_pages=4, disk="1MiB")
    sizes = [100, PAGE, 3000, PAGE + 5, 17, 2 * PAGE]
    for i, n in enumerate(sizes):
        store.put(key(i), payload(i, n))
    assert store.flush()
    store.get(key(len(sizes) - 1))  # a RAM hit
    store.get(key(0))  # evicted from RAM: a disk hit
    store.get(key(777))  # a miss
    stats = store.stats()
    assert stats["hits"] == 2 and stats["misses"] == 1
    ram_t, disk_t = stats["tiers"]
    assert (ram_t["name"], ram_t["medium"], ram_t["type"]) == ("ram", "CPU", "RamTier")
    assert (disk_t["name"], disk_t["medium"], disk_t["type"]) == ("disk", "DISK", "DiskTier")
    assert ram_t["capacity_bytes"] == 4 * PAGE and disk_t["capacity_bytes"] == 1024**2
    assert disk_t["entries"] == len(sizes) and disk_t["used_bytes"] == sum(sizes)
    assert disk_t["puts"] == len(sizes) and disk_t["bytes_written"] == sum(sizes)
    assert disk_t["hits"] >= 1 and disk_t["bytes_read"] >= sizes[0]
    assert ram_t["hits"] == 1 and ram_t["evictions"] >= 1  # write-through copies are not hits
    assert disk_t["queue_depth"] == 0
    assert_accounting(store)


def entry_size(i: int) -> int:
    return 1 + (i * 7919) % (3 * PAGE)


def test_concurrent_put_get_from_threads_loses_and_mixes_nothing(make_store):
    store = make_store(ram_pages=32, disk="16MiB", write_queue_depth=10_000)
    nthreads, per_thread = 4, 60
    errors: list[str] = []

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        mine = []
        for j in range(per_thread):
            i = t * 1000 + j
            size = entry_size(i)
            if not store.put(key(i), payload(i, size)):
                errors.append(f"thread {t}: put of entry {i} refused")
            mine.append((i, size))
            for i2, size2 in (mine[int(rng.integers(len(mine)))], mine[-1]):
                got = store.get(key(i2))  # may miss while in flight, never wrong
                if got is not None and got != payload(i2, size2):
                    errors.append(f"thread {t}: wrong bytes for entry {i2}")
            shared = key(int(rng.integers(8)), b"shared")
            got = store.get(shared)
            if got is None:
                store.put(shared, payload(7_000_000 + shared[0], PAGE))
            elif got != payload(7_000_000 + shared[0], PAGE):
                errors.append(f"thread {t}: wrong shared bytes")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert store.flush()
    assert store.stats()["write_drops"] == 0
    for t in range(nthreads):
        for j in range(per_thread):
            i = t * 1000 + j
            assert store.get(key(i)) == payload(i, entry_size(i)), i
    assert_accounting(store)


# ------------------------------------------------------------------------------------ faults, config


def test_disk_tier_that_cannot_start_leaves_a_degraded_store(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    cfg = config(tmp_path)
    cfg["tiers"][1]["path"] = str(blocker / "disk")
    with caplog.at_level(logging.WARNING, logger="kvtier.store"):
        store = TieredStore.from_config(cfg)
    with store:
        assert [t.name for t in store.tiers] == ["ram"]
        assert any("disk" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)
        assert store.put(key(1), payload(1))
        assert store.get(key(1)) == payload(1)
        assert store.lookup([key(1)]) == 1


def test_lower_tier_faults_are_counted_misses_and_drops(tmp_path):
    disk = FaultyDisk(DiskConfig(path=str(tmp_path / "d"), drop_cache=False))
    store = store_over([ram(2), disk], write_through=True)
    with store:
        disk.fail_put = True
        store.put(key(0), payload(0))
        assert store.flush()
        assert tier_stats(store, "disk")["errors"] == 1
        disk.fail_put = False  # the worker survived the fault
        for i in range(1, 4):
            store.put(key(i), payload(i))
        assert store.flush()
        assert store.locate(key(1)) == "disk"
        disk.fail_get = True
        assert store.get(key(1)) is None  # a fault: a miss, not an exception
        assert tier_stats(store, "disk")["errors"] == 2
        assert_accounting(store)
        disk.fail_get = False
        assert store.get(key(1)) == payload(1)  # a transient fault does not lose the entry


@pytest.mark.parametrize(
    "cfg, needles",
    [
        ({"tierz": []}, ["'tierz'", "tiers", "write_queue_depth", "admission"]),
        ({"tiers": [{"type": "ramm"}]}, ["'ramm'", "disk", "ram", "redis", "s3", "fs"]),
        ({"tiers": [{"type": "ram", "policy": "lruu"}]}, ["'lruu'", "lru", "fifo", "s3fifo", "wtinylfu"]),
        ({"tiers": [{"type": "ram", "capcity": "1MiB"}]}, ["'capcity'", "capacity", "page_size"]),
        ({"tiers": [{"type": "ram", "capacity": "abc"}]}, ["'abc'", "capacity"]),
        ({"tiers": [{"type": "ram", "capacity": "2 GB/s"}]}, ["capacity"]),
        ({"tiers": [{"type": "ram", "capacity": "2XiB"}]}, ["'XiB'", "GiB", "MiB"]),
        ({"tiers": [{"policy": "lru"}]}, ["'type'", "disk", "ram"]),
        ({"tiers": []}, ["at least one tier"]),
        ({"write_queue_depth": 0}, ["write_queue_depth"]),
        ({"admission": {"min_prefix": 2}}, ["'min_prefix'", "min_prefix_chunks"]),
    ],
)
def test_config_mistakes_are_one_line_config_errors(cfg, needles):
    with pytest.raises(ConfigError) as info:
        TieredStore.from_config(cfg).close()
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_sizes_accept_units(tmp_path):
    cfg = config(tmp_path)
    cfg["tiers"][0]["capacity"] = "64KiB"
    cfg["tiers"][1]["capacity"] = "2 MB"
    with TieredStore.from_config(cfg) as store:
        assert [t.capacity_bytes for t in store.tiers] == [64 * 1024, 2_000_000]


# ------------------------------------------------------------------------------------ restart, corruption


def test_restart_finds_disk_entries_and_serves_them(tmp_path):
    keys = [key(i) for i in range(5)]
    with TieredStore.from_config(config(tmp_path)) as store:
        for i, k in enumerate(keys):
            store.put(k, payload(i, 1000 + i), parent=keys[i - 1] if i else None, chunk_index=i)
    # close() finished the queued writes
    with TieredStore.from_config(config(tmp_path)) as again:
        assert again.lookup(keys) == 5
        assert all(again.locate(k) == "disk" for k in keys)
        assert again.get(keys[0]) == payload(0, 1000)
        assert again.locate(keys[0]) == "ram"
        assert [again.get(k) for k in keys] == [payload(i, 1000 + i) for i in range(5)]
        assert_accounting(again)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["payload byte", "truncated"])
def test_corrupt_disk_file_is_a_counted_miss_never_wrong_bytes(tmp_path, damage):
    with TieredStore.from_config(config(tmp_path)) as store:
        store.put(key(1), payload(1, 3000))
        store.put(key(2), payload(2, 3000))
    path = entry_path(str(tmp_path / "disk"), key(1), fanout=True)
    if damage == "payload byte":
        _flip(path, os.path.getsize(path) - 10)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 10)
    with TieredStore.from_config(config(tmp_path)) as store:
        out = bytearray(3000)
        assert store.get_into(key(1), out) is None
        assert store.get(key(1)) is None
        stats = store.stats()
        assert stats["misses"] == 2
        assert tier_stats(store, "disk")["corrupt"] == 1
        assert store.lookup([key(1)]) == 0  # forgotten, not retried
        assert store.get(key(2)) == payload(2, 3000)
        assert_accounting(store)


# ------------------------------------------------------------------------------------ admission, events


def test_admission_rejects_short_prefixes(make_store):
    store = make_store(admission={"enabled": True, "min_prefix_chunks": 3})
    assert not store.put(key(0), payload(0), chunk_index=0)
    assert not store.put(key(1), payload(1), parent=key(0), chunk_index=1)
    assert store.put(key(2), payload(2), parent=key(1), chunk_index=2)
    assert store.stats()["not_admitted"] == 2
    assert store.lookup([key(0)]) == 0 and store.lookup([key(2)]) == 1
    assert store.flush()
    assert not store.tiers[1].contains(key(0))


def test_take_events_reports_stored_and_removed_with_the_medium(make_store):
    store = make_store(ram_pages=2, write_through=False)
    assert store.take_events() == []  # not enabled
    store.enable_events()
    store.put(key(0), payload(0))
    assert store.take_events() == [("stored", key(0), "CPU")]
    assert store.take_events() == []
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))  # evicts key 0 to disk
    assert store.flush()
    events = store.take_events()
    assert ("removed", key(0), "CPU") in events
    assert ("stored", key(0), "DISK") in events
    assert ("stored", key(2), "CPU") in events
    store.delete(key(0))
    assert store.take_events() == [("removed", key(0), "DISK")]


# ------------------------------------------------------------------------------------ memory, close


def test_ram_tier_memory_stays_flat_across_put_evict_cycles():
    capacity = 8 * 1024 * 1024
    top = RamTier(RamConfig(capacity=capacity, page_size=64 * 1024, pin_memory=False, prefault=True))
    store = TieredStore([(top, LRUPolicy())])
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (70_000, 300_000, 1_000_001)]
    proc = psutil.Process()
    with store:
        def cycle(start: int) -> None:
            for i in range(start, start + 300):
                blob = blobs[i % len(blobs)]
                assert store.put(key(i), blob, parent=key(i - 1) if i % 4 else None)
                if i % 7 == 0:
                    assert store.get_into(key(i), bytearray(blob.size)) == blob.size

        cycle(0)  # warm-up: scratch buffers and bookkeeping reach their steady size
        rss = proc.memory_info().rss
        for round_ in range(1, 6):
            cycle(round_ * 1000)
        growth = proc.memory_info().rss - rss
        assert store.stats()["evictions"] > 1000
        assert growth < 4 * 1024 * 1024, f"RSS grew by {growth} bytes"


def test_close_finishes_queued_writes(tmp_path):
    with TieredStore.from_config(config(tmp_path, ram_pages=64)) as store:
        for i in range(40):
            store.put(key(i), payload(i))
    with TieredStore.from_config(config(tmp_path, ram_pages=64)) as again:
        assert again.lookup([key(i) for i in range(40)]) == 40
        assert again.get(key(39)) == payload(39)
    # a closed store refuses writes without raising
    assert not store.put(key(100), payload(100))


def test_close_returns_with_a_tier_stuck_on_a_write():
    lower = GatedRam(64 * PAGE)
    store = store_over([ram(16), lower], write_queue_depth=2)
    try:
        for i in range(5):
            store.put(key(i), payload(i))
        assert lower.entered.wait(10)
        done = threading.Event()

        def close():
            store.close(timeout=0.5)
            done.set()

        threading.Thread(target=close, daemon=True).start()
        assert done.wait(10), "close() hangs on a stuck lower tier"
    finally:
        lower.gate.set()


@pytest.mark.parametrize("fraction, floor", [(0.33, 0.25), (0.67, 0.55)])
def test_default_policy_keeps_a_subset_of_a_chain_loop_larger_than_the_cache(fraction, floor):
    """The document's cliff, through the store: 10 prefix chains of page-sized chunks re-read in
    the same order, the RAM tier holding a fraction of them. LRU gets 0 hits here; the default
    policy must keep a stable subset (the issue's capacity-curve targets)."""
    from kvtier.keys import Namespace, chunk_keys

    chunk, docs_n, chunks_n = 512 << 10, 10, 39
    store = TieredStore.from_config({"tiers": [{"type": "ram", "capacity": int(fraction * docs_n * chunks_n * chunk),
                                                "page_size": 64 << 10}]})
    rng = np.random.default_rng(0)
    docs = [chunk_keys(rng.integers(0, 30000, 5000), Namespace("m"), 128)[:chunks_n] for _ in range(docs_n)]
    payload = np.zeros(chunk, np.uint8)

    def one_pass() -> float:
        hits = 0
        for keys in docs:
            n = store.lookup(keys)
            for key in keys[:n]:
                assert store.read(key, lambda segs: None) is not None
            hits += n
            for i in range(n, len(keys)):
                store.put(keys[i], payload, parent=keys[i - 1] if i else None, chunk_index=i)
        return hits / (docs_n * chunks_n)

    assert one_pass() == 0.0
    assert one_pass() >= floor
    assert one_pass() >= floor
    store.close()


# ------------------------------------------------------------------------------------ hardening (issue 9)


def test_delete_wins_over_a_write_through_copy_in_flight():
    """The lower tier's put is under way (its bytes taken) when the key is deleted: the copy
    must not land, and after flush no tier holds the key."""
    lower = GatedRam(16 * PAGE)
    store = store_over([ram(4), lower])
    try:
        store.put(key(1), payload(1))
        assert lower.entered.wait(10)
        store.delete(key(1))
        lower.gate.set()
        assert store.flush(10)
        assert not lower.contains(key(1)) and store.get(key(1)) is None and store.lookup([key(1)]) == 0
        assert store.stats()["cancelled_writes"] == 1
        assert_accounting(store)
        assert store._ledger.idle()  # no tombstone outlives its copies
    finally:
        lower.gate.set()
        store.close()


def test_delete_wins_over_a_queued_demotion():
    """An eviction queued the key's bytes for the next tier; a delete before they land wins."""
    lower = GatedRam(16 * PAGE)
    store = store_over([ram(1), lower], write_through=False)
    try:
        store.put(key(1), payload(1))
        store.put(key(2), payload(2))  # evicts key 1: its demotion waits at the gate
        assert lower.entered.wait(10)
        store.delete(key(1))
        lower.gate.set()
        assert store.flush(10)
        assert not lower.contains(key(1)) and store.get(key(1)) is None
        assert store.get(key(2)) == payload(2)
    finally:
        lower.gate.set()
        store.close()


def test_deleted_keys_stay_deleted_in_every_tier_after_flush(tmp_path):
    """Many keys written and deleted at once over ram + disk + fs: none is readable anywhere."""
    cfg = config(tmp_path, ram_pages=64)
    cfg["tiers"].append({"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB"})
    with TieredStore.from_config(cfg) as store:
        keys = [key(i, b"del") for i in range(300)]
        for batch in range(0, len(keys), 20):  # deletes land while the batch's copies are under way
            for i, k in enumerate(keys[batch : batch + 20], start=batch):
                store.put(k, payload(i))
            for k in keys[batch : batch + 20]:
                store.delete(k)
        assert store.flush(30)
        back = [k for k in keys if store.get(k) is not None or any(t.contains(k) for t in store.tiers)]
        assert back == [], f"{len(back)} of {len(keys)} deleted keys came back"
        assert store._ledger.idle()


def test_forged_entry_length_in_a_shared_tier_is_a_counted_miss(tmp_path):
    """An fs entry whose header (valid CRC) announces 2**50 bytes: TieredStore.get misses, counts
    it corrupt and removes the file; before the fix it raised MemoryError into the engine."""
    from tests.tiers.forge import forged_header

    cfg = {"tiers": [{"type": "ram", "capacity": 4 * PAGE, "page_size": PAGE},
                     {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB"}]}
    with TieredStore.from_config(cfg) as store:
        fs = store.tiers[1]
        k = key(1)
        path = os.path.join(str(tmp_path / "fs"), k[:1].hex(), k.hex())
        os.makedirs(os.path.dirname(path))
        for length in (2**50, 2**20):  # over everything; within the tier but not the file
            with open(path, "wb") as f:
                f.write(forged_header(k, length) + b"x" * 64)
            assert store.get(k) is None and store.get_into(k, bytearray(PAGE)) is None
            assert not os.path.exists(path)
        assert fs.stats.corrupt == 2


def test_entries_over_max_entry_bytes_are_corrupt_misses(tmp_path):
    """A well-formed entry larger than any chunk the store expects is not read (nor allocated)."""
    cfg = {"tiers": [{"type": "ram", "capacity": 4 * PAGE, "page_size": PAGE},
                     {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB"}],
           "max_entry_bytes": 2 * PAGE}
    with TieredStore.from_config(cfg) as store:
        fs = store.tiers[1]
        assert fs.put(key(1), payload(1, 3 * PAGE)) and fs.put(key(2), payload(2, 2 * PAGE))
        assert store.get(key(1)) is None and not fs.contains(key(1))
        assert store.stats()["corrupt"] == 1
        assert store.get(key(2)) == payload(2, 2 * PAGE)


def test_keys_that_are_not_digests_are_refused_at_every_entry_point(make_store, caplog):
    """A 3-byte or empty key: writes and deletes raise InvalidKey (nothing stored, no writer
    traceback), reads and lookups are misses; a lookup stops at the first such key."""
    from kvtier.errors import InvalidKey

    store = make_store()
    store.put(key(1), payload(1))
    for bad in (b"", b"abc", b"x" * 31, "not bytes"):
        with pytest.raises(InvalidKey):
            store.put(bad, payload(2))
        with pytest.raises(InvalidKey):
            store.write(bad, PAGE, lambda segs: None)
        with pytest.raises(InvalidKey):
            store.put(key(2), payload(2), parent=bad)
        with pytest.raises(InvalidKey):
            store.delete(bad)
        assert store.get(bad) is None and store.get_into(bad, bytearray(PAGE)) is None
        assert store.read(bad, lambda segs: None) is None and store.locate(bad) is None
        assert store.lookup([key(1), bad, key(1)]) == 1
        store.prefetch([bad])
    assert store.flush(10)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert all(len(k) == 32 for t in store.tiers for k in t.keys())
    assert store.get(key(1)) == payload(1)


def test_two_stores_never_manage_one_disk_directory(tmp_path, caplog):
    """The second store over a locked disk directory leaves the disk tier out with a warning
    naming the directory (a degraded store, as for any tier that cannot start)."""
    with TieredStore.from_config(config(tmp_path)) as first:
        with caplog.at_level(logging.WARNING, logger="kvtier.store"):
            second = TieredStore.from_config(config(tmp_path))
        try:
            assert [t.name for t in second.tiers] == ["ram"]
            assert any("in use by another kvtier store" in r.getMessage() and str(tmp_path / "disk") in r.getMessage()
                       for r in caplog.records)
        finally:
            second.close()
        assert [t.name for t in first.tiers] == ["ram", "disk"]
    with TieredStore.from_config(config(tmp_path)) as third:  # released at close
        assert [t.name for t in third.tiers] == ["ram", "disk"]


# ------------------------------------------------------------------------------------ the store lock (issue 25)


class GatedDisk(DiskTier):
    """A disk tier whose chosen methods wait at a gate (a slow link), announcing each entry."""

    gated: frozenset = frozenset()

    def __init__(self, config, name: str = "disk"):
        super().__init__(config, name=name)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _wait(self, method: str) -> None:
        if method in self.gated:
            self.entered.set()
            self.gate.wait(30)

    def get_into(self, key, out):
        self._wait("get_into")
        return super().get_into(key, out)

    def delete(self, key) -> bool:
        self._wait("delete")
        return super().delete(key)

    def used_bytes(self) -> int:
        self._wait("used_bytes")
        return super().used_bytes()


def _gated_disk(tmp_path, gated: set, name: str = "disk", capacity: int = 4 << 20) -> GatedDisk:
    disk = GatedDisk(DiskConfig(path=str(tmp_path / name), capacity=capacity, drop_cache=False), name=name)
    disk.gated = frozenset(gated)
    return disk


def _in_thread(fn) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run():
        fn()
        done.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, done


def test_a_ram_hit_does_not_wait_for_a_slow_lower_tier_in_stats_or_delete(tmp_path):
    """A self-managed tier's usage and every lower tier's delete run outside the store lock:
    while stats() and delete() are stuck on a slow lower tier, a RAM hit on another thread
    returns. Before issue 25 both held the lock across that I/O."""
    from kvtier.tiers.fs import FsConfig, FsTier

    class SlowFs(FsTier):
        gate = threading.Event()
        entered = threading.Event()

        def used_bytes(self) -> int:
            self.entered.set()
            self.gate.wait(30)
            return super().used_bytes()

    fs = SlowFs(FsConfig(path=str(tmp_path / "fs"), capacity=4 << 20), name="fs")
    disk = _gated_disk(tmp_path, {"delete"})
    store = TieredStore([(ram(8), LRUPolicy()), (disk, LRUPolicy()), (fs, None)])
    try:
        store.put(key(1), payload(1))
        store.put(key(2), payload(2))
        assert store.flush()
        _, stats_done = _in_thread(store.stats)
        assert fs.entered.wait(10) and not stats_done.is_set()
        hit = []
        _, hit_done = _in_thread(lambda: hit.append(store.get(key(1))))
        assert hit_done.wait(5), "a RAM hit waited for stats() on a slow tier"
        assert hit == [payload(1)]
        fs.gate.set()
        assert stats_done.wait(10)

        _, delete_done = _in_thread(lambda: store.delete(key(2)))
        assert disk.entered.wait(10) and not delete_done.is_set()
        hit.clear()
        _, hit_done = _in_thread(lambda: hit.append(store.get(key(1))))
        assert hit_done.wait(5), "a RAM hit waited for delete() on a slow tier"
        assert hit == [payload(1)]
        assert store.get(key(2)) is None  # being deleted: already gone as far as readers go
        disk.gate.set()
        assert delete_done.wait(10)
        assert store.flush() and not disk.contains(key(2)) and not fs.contains(key(2))
        assert_accounting(store)
    finally:
        fs.gate.set()
        disk.gate.set()
        store.close()


def test_delete_during_a_demotion_read_outside_the_lock_wins(tmp_path):
    """A disk-tier eviction reads its victim (outside the lock) to demote it to the next disk
    tier; a delete of the victim while that read is under way wins: the demotion never lands."""
    top = ram(1)
    disk = _gated_disk(tmp_path, set(), capacity=2 * PAGE)
    disk2 = _gated_disk(tmp_path, set(), name="disk2")
    store = TieredStore([(top, LRUPolicy()), (disk, LRUPolicy()), (disk2, LRUPolicy())],
                        StoreConfig(write_through=False))
    try:
        for i in range(3):  # key 0 and 1 demoted to disk, key 2 in RAM
            store.put(key(i), payload(i))
            assert store.flush()
        assert [store.locate(key(i)) for i in range(3)] == ["disk", "disk", "ram"]
        disk.gated = frozenset({"get_into"})
        store.put(key(3), payload(3))  # demotes key 2 to disk, which evicts key 0 to disk2
        assert disk.entered.wait(10)  # the writer reads key 0 for its demotion
        store.delete(key(0))
        disk.gate.set()
        assert store.flush()
        assert not disk2.contains(key(0)) and store.get(key(0)) is None
        assert store.stats()["cancelled_writes"] == 1
        assert store.get(key(1)) == payload(1)  # promoted: evicts again
        assert store.flush()
        assert_accounting(store)
        assert store._ledger.idle()
    finally:
        disk.gate.set()
        store.close()


def test_re_put_during_a_slow_lower_delete_lands_after_it(tmp_path):
    """The lower tier's delete runs outside the lock; a key written again meanwhile has its
    write-through copy wait for that delete, then land: the tier and the index agree."""
    disk = _gated_disk(tmp_path, set())
    store = TieredStore([(ram(8), LRUPolicy()), (disk, LRUPolicy())])
    try:
        store.put(key(1), payload(1))
        assert store.flush() and disk.contains(key(1))
        disk.gated = frozenset({"delete"})
        _, deleted = _in_thread(lambda: store.delete(key(1)))
        assert disk.entered.wait(10)
        assert store.put(key(1), payload(1))  # written again while the disk delete is stuck
        assert not store.flush(0.3)  # its copy waits for the delete
        disk.gated = frozenset()
        disk.gate.set()
        assert deleted.wait(10) and store.flush()
        assert disk.contains(key(1)) and disk.get(key(1)) == payload(1)
        assert store.locate(key(1)) == "ram"
        assert_accounting(store)
        assert store._ledger.idle()
    finally:
        disk.gate.set()
        store.close()


def test_a_top_tier_without_an_arena_is_written_outside_the_lock(tmp_path):
    """A disk tier on top (no arena): puts, evictions with demotion, reads and deletes work, and
    the top tier's copies reach the next tier with their bytes."""
    top = DiskTier(DiskConfig(path=str(tmp_path / "top"), capacity=2 * PAGE, drop_cache=False), name="top")
    disk = DiskTier(DiskConfig(path=str(tmp_path / "d"), capacity=4 << 20, drop_cache=False), name="disk")
    store = TieredStore([(top, LRUPolicy()), (disk, LRUPolicy())])
    try:
        for i in range(4):
            assert store.put(key(i), payload(i))
        assert store.flush()
        assert all(disk.get(key(i)) == payload(i) for i in range(4))
        assert [store.locate(key(i)) for i in range(4)] == ["disk", "disk", "top", "top"]
        assert store.get(key(0)) == payload(0) and store.locate(key(0)) == "top"  # promoted
        store.delete(key(0))
        assert store.flush() and store.get(key(0)) is None and not disk.contains(key(0))
        assert_accounting(store)
        assert store._ledger.idle()
    finally:
        store.close()


@pytest.mark.parametrize("field, value", [("writer_nice", 20), ("writer_nice", -1), ("max_entry_bytes", 0),
                                          ("write_queue_depth", 0)])
def test_a_store_config_built_by_hand_is_held_to_the_declared_ranges(field, value):
    """Before issue 25 only ``write_queue_depth`` was checked by hand outside ``build``."""
    with pytest.raises(ConfigError) as info:
        StoreConfig(**{field: value})
    assert f"store.{field}: must be in" in str(info.value) and "\n" not in str(info.value)


def test_delete_during_a_writes_fill_wins(make_store):
    """``fill`` runs outside the store lock, into reserved pages: a delete of the key while it
    runs wins (the pages are freed, nothing is published or copied down)."""
    store = make_store(ram_pages=4)
    data = np.frombuffer(payload(1), dtype=np.uint8)

    def fill(segments):
        pos = 0
        for seg in segments:
            seg[:] = data[pos : pos + seg.size]
            pos += seg.size
        store.delete(key(1))  # another thread's delete, arriving mid-fill

    assert not store.write(key(1), data.size, fill)
    assert store.flush()
    assert store.get(key(1)) is None and not store.tiers[1].contains(key(1))
    assert store.stats()["cancelled_writes"] == 1
    assert tier_stats(store, "ram")["used_bytes"] == 0
    assert_accounting(store)
    assert store._ledger.idle()
    assert store.put(key(1), payload(1)) and store.get(key(1)) == payload(1)  # written again: there

"""Hostile review of ``TieredStore.borrow_top`` and the worker's pinned top-tier batches
(``KVTierWorker._copy_top``): real stores and tiers in temp dirs; fakes only inject faults or
timing (a hook that runs other threads' writes while the pin is held).

The guarantees under attack: a pinned entry's bytes never change until the ``with`` block ends
(whatever other threads delete, evict, re-put or promote meanwhile); every pin is released when
the block ends, also by an exception; the lock is not held during the block; the store's
accounting is right afterwards; the worker loads what the top tier held, reports the blocks from
a bad chunk on, deletes a foreign entry and promotes nothing while it holds pins.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager

import numpy as np
import pytest

import kvtier.integrations.vllm.worker as worker_module
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec
from kvtier.policies.lru import LRUPolicy
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.ram import ArenaTier, RamConfig, RamTier
from tests.integration.test_connector_worker import _keys, _pages, _same, _save, _worker
from tests.test_store import PAGE, assert_accounting, key, make_store, payload  # noqa: F401 (fixture)


def joined(segments) -> bytes:
    return b"".join(bytes(s) for s in segments)


def digest(segments) -> bytes:
    return hashlib.sha256(joined(segments)).digest()


def arena_pages_consistent(store: TieredStore) -> None:
    """No page leaked: once no pin is held, the arena's free pages are its capacity less the
    pages of the entries it holds."""
    arena = store.tiers[0]
    held = sum(arena.footprint(arena.size_of(k)) for k in arena.keys())
    assert arena.free_bytes() == arena.capacity_bytes - held


# ------------------------------------------------------------------------------------ the store


def test_pinned_bytes_survive_concurrent_churn_and_accounting_holds(make_store):
    """Threads delete, re-put (other bytes, same keys), evict (puts of new keys) and promote
    (reads of disk-only keys) while the main thread holds pins: every pinned entry keeps its
    bytes to the end of its block; afterwards no page is leaked and the accounting is right."""
    store = make_store(ram_pages=6, write_through=True)
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):
        assert store.put(k, payload(i))
    assert store.flush()
    stop, errors = threading.Event(), []

    def churn(t: int) -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                k = keys[(n + t) % len(keys)]
                store.delete(k)
                store.put(k, payload(1000 + n))  # the same key, other bytes
                store.put(key(100 + t * 1000 + n % 50), payload(2000 + n))  # evicts
                store.read(key(100 + t * 1000 + (n + 25) % 50), lambda segs: None)  # promotes, when on disk
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    try:
        for _ in range(150):
            with store.borrow_top(keys + keys[:2]) as entries:
                before = [None if e is None else digest(e) for e in entries]
                threading.Event().wait(0.0005)  # let the churn run under the pins
                after = [None if e is None else digest(e) for e in entries]
                assert before == after
                for e in entries:  # a pinned entry is one whole payload of some put
                    assert e is None or len(joined(e)) == PAGE
    finally:
        stop.set()
        for th in threads:
            th.join(10)
    assert not errors, errors
    assert store.flush()
    assert_accounting(store)
    arena_pages_consistent(store)


def test_re_put_of_a_deleted_key_while_pinned(make_store):
    """Deleted and written again while pinned: the pin still reads the old bytes, a read the
    new ones; afterwards one entry, its pages alone in use."""
    store = make_store(ram_pages=4, write_through=False)
    store.put(key(1), payload(1))
    with store.borrow_top([key(1)]) as (pinned,):
        assert store.delete(key(1))
        assert store.put(key(1), payload(11))
        got = []
        assert store.read(key(1), lambda segs: got.append(joined(segs))) == "ram"
        assert got == [payload(11)] and joined(pinned) == payload(1)
    assert_accounting(store)
    arena_pages_consistent(store)
    assert store.stats()["tiers"][0]["entries"] == 1


def test_duplicate_keys_pin_the_same_entry_twice_and_release_both(make_store):
    """The same key twice: both positions carry the bytes (counted as two reads would be); the
    entry, deleted meanwhile, gives its pages back once the block ends (both pins released)."""
    store = make_store(ram_pages=2, write_through=False)
    store.put(key(1), payload(1))
    hits = store.stats()["hits"]
    with store.borrow_top([key(1), key(1)]) as entries:
        assert [joined(e) for e in entries] == [payload(1)] * 2
        assert store.delete(key(1))
        assert store.tiers[0].free_bytes() == PAGE  # the dead entry's page is still pinned
    assert store.stats()["hits"] == hits + 2
    assert store.tiers[0].free_bytes() == 2 * PAGE
    assert_accounting(store)


@pytest.mark.parametrize("bad", [b"short", b"", None, "x" * 32, 7, key(1).hex().encode()])
def test_an_invalid_key_is_none_and_counts_nothing(make_store, bad):
    store = make_store()
    store.put(key(1), payload(1))
    before = store.stats()
    with store.borrow_top([bad, key(1), bad]) as entries:
        assert entries[0] is None and entries[2] is None and joined(entries[1]) == payload(1)
    after = store.stats()
    assert (after["hits"], after["misses"]) == (before["hits"] + 1, before["misses"])


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_a_valid_key_of_another_bytes_type_is_served_not_a_crash(make_store, kind):
    """``is_valid_key`` takes a 32-byte bytearray or memoryview as a chunk key: borrow_top serves
    it as the bytes it holds, never raises from the lock-held section."""
    store = make_store()
    store.put(key(1), payload(1))
    with store.borrow_top([kind(key(1))]) as (entry,):
        assert entry is not None and joined(entry) == payload(1)


def test_a_coded_arena_yields_raw_bytes_as_read_does(tmp_path):
    """A coded (lossless) top arena: borrow_top yields the raw bytes that ``read`` gives, also
    after the entry is deleted while pinned; the coder never moves pinned pages."""
    tier = RamTier(RamConfig(capacity=64 * PAGE, page_size=PAGE, codec="lossless",
                             shm_path=str(tmp_path / "arena")), name="coded")
    store = TieredStore([(tier, LRUPolicy())])
    try:
        data = [np.arange(4 * PAGE, dtype=np.uint8).tobytes(), bytes(4 * PAGE), payload(3, 4 * PAGE)]
        for i, d in enumerate(data):
            assert store.put(key(i), d)
        assert tier.drain(10) and tier.codec_state()["entries_coded"] >= 2
        reads = []
        for i in range(3):
            store.read(key(i), lambda segs: reads.append(joined(segs)))
        assert reads == data
        with store.borrow_top([key(i) for i in range(3)]) as entries:
            for i in range(3):
                store.delete(key(i))
            store.put(key(9), payload(9, 40 * PAGE))  # reuses free pages
            assert [joined(e) for e in entries] == data
        assert tier.drain(10)
        assert_accounting(store)
    finally:
        store.close()


def test_a_top_tier_without_an_arena_yields_none_and_counts_nothing(tmp_path):
    disk = DiskTier(DiskConfig(path=str(tmp_path / "d"), capacity=1 << 20, drop_cache=False))
    store = TieredStore([(disk, LRUPolicy())])
    try:
        assert store.put(key(1), payload(1))
        assert store.in_top_tier([key(1)]) == [True]
        before = store.stats()
        with store.borrow_top([key(1), key(2)]) as entries:
            assert entries == [None, None]
        after = store.stats()
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
        got = []
        assert store.read(key(1), lambda segs: got.append(joined(segs))) == disk.name
        assert got == [payload(1)]
    finally:
        store.close()


def test_an_exception_in_the_block_releases_every_pin(make_store):
    store = make_store(ram_pages=4, write_through=False)
    for i in range(4):
        store.put(key(i), payload(i))
    with pytest.raises(RuntimeError):
        with store.borrow_top([key(i) for i in range(4)]):
            for i in range(4):
                store.delete(key(i))
            assert store.tiers[0].free_bytes() == 0
            raise RuntimeError("boom")
    assert store.tiers[0].free_bytes() == 4 * PAGE
    assert_accounting(store)


class FaultyBorrowRam(RamTier):
    """A top arena whose ``borrow`` raises for one key (a tier must not, but may), pinning a
    batch key by key (``ArenaTier``'s default ``borrow_many``)."""

    poison: bytes | None = None
    borrow_many = ArenaTier.borrow_many

    @contextmanager
    def borrow(self, key, count: bool = True):
        if key == self.poison:
            raise OSError("injected borrow fault")
        with super().borrow(key, count) as views:
            yield views


class FaultyViewsRam(RamTier):
    """A top arena whose batched ``borrow_many`` fails after its pins are taken (making the
    views raises once ``poison`` is set)."""

    poison = False

    def _readonly(self, start: int, end: int):
        if self.poison:
            raise OSError("injected view fault")
        return super()._readonly(start, end)


@pytest.mark.parametrize("arena", [FaultyBorrowRam, FaultyViewsRam])
def test_a_fault_while_pinning_releases_the_pins_taken_and_the_lock(arena):
    ram = arena(RamConfig(capacity=4 * PAGE, page_size=PAGE, pin_memory=False), name="ram")
    store = TieredStore([(ram, LRUPolicy())], StoreConfig(write_through=False))
    try:
        for i in range(3):
            store.put(key(i), payload(i))
        ram.poison = key(2) if arena is FaultyBorrowRam else True
        with pytest.raises(OSError):
            with store.borrow_top([key(0), key(1), key(2)]):
                pass  # pragma: no cover
        ram.poison = None if arena is FaultyBorrowRam else False
        for i in range(3):
            store.delete(key(i))
        assert ram.free_bytes() == 4 * PAGE  # the pins of keys 0 and 1 were released
        done = threading.Event()
        threading.Thread(target=lambda: (store.put(key(5), payload(5)), done.set())).start()
        assert done.wait(5), "the store lock stayed held"
    finally:
        store.close()


def test_the_lock_is_not_held_during_the_block(make_store):
    """Another thread's write, delete and stats run while the block is open (the store's lock
    is an RLock: the same thread's calls would pass even if it were still held)."""
    store = make_store(ram_pages=4, write_through=False)
    store.put(key(1), payload(1))
    with store.borrow_top([key(1)]) as (entry,):
        done = threading.Event()

        def other() -> None:
            store.put(key(2), payload(2))
            store.delete(key(1))
            store.stats()
            done.set()

        threading.Thread(target=other, daemon=True).start()
        assert done.wait(5), "another thread could not take the store lock during the block"
        assert joined(entry) == payload(1)
    assert key(1) not in store and key(2) in store
    assert_accounting(store)


def test_evicting_every_pinned_entry_keeps_the_accounting_and_frees_the_pages_after(make_store):
    """All of the arena pinned, then a put that needs room: whatever it evicts keeps its bytes
    to the end of the block; afterwards the index and the arena agree and a put succeeds."""
    store = make_store(ram_pages=2, write_through=True)
    store.put(key(0), payload(0))
    store.put(key(1), payload(1))
    assert store.flush()
    with store.borrow_top([key(0), key(1)]) as entries:
        stored = store.put(key(2), payload(2))  # may be dropped: the evicted pages stay pinned
        assert [joined(e) for e in entries] == [payload(0), payload(1)]
        assert_accounting(store)
    assert store.flush()
    assert_accounting(store)
    arena_pages_consistent(store)
    assert store.put(key(3), payload(3)) and store.locate(key(3)) == "ram"
    for i in [0, 1, 3] + ([2] if stored else []):  # nothing lost: evicted entries live on in the disk tier
        assert store.flush()  # a promotion's eviction may still be carrying an entry down
        got = []
        assert store.read(key(i), lambda segs: got.append(joined(segs))) is not None, i
        assert got == [payload(i)]


# ------------------------------------------------------------------------------------ the worker


def _top(worker):
    return worker.store.tiers[0]


def test_a_foreign_entry_mid_batch_loads_the_chunks_before_and_fails_from_it(tmp_path):
    """Chunk 2 of 4 holds an entry of another size, all in one pinned batch, the first block
    skipped: chunks 0 and 1 load (block 20 untouched), blocks from chunk 2 on are reported, the
    foreign entry is deleted and the good one after it kept; two chunks counted as loaded."""
    worker, kv = _worker(tmp_path)
    try:
        keys = _keys(4)
        src, dst = list(range(0, 8)), list(range(20, 28))
        _save(worker, keys, src)
        assert worker.store.delete(keys[2])
        assert worker.store.put(keys[2], b"\x07" * 100, parent=keys[1], chunk_index=2)
        assert worker.store.in_top_tier(keys) == [True] * 4
        skipped = _pages(kv, dst[:1])
        worker.take_stats()
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 1)]))
        assert worker.failed_blocks() == set(dst[4:])
        assert _same(_pages(kv, src[1:4]), _pages(kv, dst[1:4])) and _same(_pages(kv, dst[:1]), skipped)
        assert keys[2] not in worker.store and worker.store.locate(keys[3]) == "ram"
        loaded = worker.take_stats().data["tiers"]
        assert sum(c.get("loaded_chunks", 0) for c in loaded.values()) == 2
        assert worker.store.flush()  # the foreign entry's write-through may still be landing (then deleted)
        assert_accounting(worker.store)
    finally:
        worker.close()


def test_a_foreign_first_chunk_reports_from_the_skipped_block_on(tmp_path):
    worker, kv = _worker(tmp_path)
    try:
        keys = _keys(2)
        _save(worker, keys, [0, 1, 2, 3])
        assert worker.store.delete(keys[0])
        assert worker.store.put(keys[0], b"\x01" * 6144 * 2)  # twice a chunk
        before = _pages(kv, [8, 9, 10, 11])
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, [8, 9, 10, 11], 1)]))
        assert worker.failed_blocks() == {9, 10, 11}
        assert _same(_pages(kv, [8]), [t[:1] for t in before]) and keys[0] not in worker.store
    finally:
        worker.close()


def test_a_chunk_evicted_between_in_top_tier_and_the_pin_is_read_from_below(tmp_path, monkeypatch):
    """``in_top_tier`` says all four chunks are in RAM; the chain's tail (chunk 3, what the store
    evicts first) is then demoted to disk by other writes before the pin: it is read from disk
    per chunk, after the pinned batch, and every page is right."""
    worker, kv = _worker(tmp_path, ram="1MiB")  # four 256 KiB pages: four chunks
    try:
        store = worker.store
        keys = _keys(4)
        src, dst = list(range(0, 8)), list(range(20, 28))
        _save(worker, keys, src)
        real = store.in_top_tier

        def then_evict(ks):
            out = real(ks)
            assert out == [True] * 4
            assert store.put(key(0, b"filler"), payload(0, 6144))
            assert store.flush() and store.locate(keys[3]) == "disk"
            return out

        monkeypatch.setattr(store, "in_top_tier", then_evict)
        worker.take_stats()
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src), _pages(kv, dst))
        loaded = {t: c.get("loaded_chunks", 0) for t, c in worker.take_stats().data["tiers"].items()}
        assert loaded.get("ram") == 3 and loaded.get("disk") == 1, loaded
        assert store.flush()
        assert_accounting(store)
    finally:
        worker.close()


def test_bytes_rewritten_under_the_workers_pins_never_reach_its_pages(tmp_path, monkeypatch):
    """While the worker holds a batch's pins, another thread deletes every entry, writes other
    bytes under the same keys and fills the freed pages: the pages get the bytes pinned."""
    worker, kv = _worker(tmp_path)
    try:
        store = worker.store
        keys = _keys(3)
        src, dst = list(range(0, 6)), list(range(10, 16))
        _save(worker, keys, src)
        real = store.borrow_top

        @contextmanager
        def hostile(ks):
            with real(ks) as entries:
                def churn():
                    for k in ks:
                        store.delete(k)
                    for n, k in enumerate(ks):
                        store.put(k, b"\xee" * 6144)
                        store.put(key(n, b"fill"), b"\xdd" * 6144)
                t = threading.Thread(target=churn)
                t.start()
                t.join(5)
                assert not t.is_alive()
                yield entries

        monkeypatch.setattr(store, "borrow_top", hostile)
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src), _pages(kv, dst))
        assert store.flush()
        assert_accounting(store)
        arena_pages_consistent(store)
    finally:
        worker.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_load_promotes_nothing_while_it_holds_pins(tmp_path, monkeypatch, threads):
    """Chunk 0 only on disk, chunks 1-2 in RAM (one load thread: no pool, so the top-tier batch
    is pinned although a chunk is below): chunk 0 is promoted only once no pin is held, and every
    page is right."""
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.worker import KVTierWorker
    from kvtier.keys import WorkerShare
    from tests.integration.test_connector_worker import GEOMETRY, _kv_caches

    tiers = [{"type": "ram", "capacity": "4MiB"}, {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": "sync", "load_threads": threads})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    kv = _kv_caches(0)
    worker.register_kv_caches(kv)
    try:
        store = worker.store
        keys = _keys(3)
        src, dst = list(range(0, 6)), list(range(10, 16))
        _save(worker, keys, src)
        worker.close()  # a new worker over the same disk: its RAM tier empty, the disk tier holding all
        worker = KVTierWorker(config, GEOMETRY, WorkerShare())
        worker.register_kv_caches(kv)
        store = worker.store
        for i in (1, 2):
            got = []
            assert store.read(keys[i], lambda segs: got.append(1)) is not None
        assert store.locate(keys[0]) == "disk" and store.in_top_tier(keys) == [False, True, True]
        pins, promoted_under_pin = [0], []
        real_borrow, real_promote = store.borrow_top, store._promote

        @contextmanager
        def counted(ks):
            with real_borrow(ks) as entries:
                pins[0] += 1
                try:
                    yield entries
                finally:
                    pins[0] -= 1

        def promote(*a, **kw):
            promoted_under_pin.append(pins[0])
            return real_promote(*a, **kw)

        monkeypatch.setattr(store, "borrow_top", counted)
        monkeypatch.setattr(store, "_promote", promote)
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src), _pages(kv, dst))
        assert promoted_under_pin and not any(promoted_under_pin), promoted_under_pin
        assert store.locate(keys[0]) == "ram"
    finally:
        worker.close()


@pytest.mark.parametrize("chunks_per_batch", [1, 2, 3])
def test_no_more_than_a_batch_is_pinned_at_once(tmp_path, monkeypatch, chunks_per_batch):
    """``TOP_BATCH_BYTES`` bounds what one inline load pins at once (what a promotion by another
    thread meanwhile may evict beyond its need); every page right whatever the batch."""
    worker, kv = _worker(tmp_path)
    try:
        entry = 6144
        monkeypatch.setattr(worker_module, "TOP_BATCH_BYTES", chunks_per_batch * entry + entry // 2)
        store = worker.store
        keys = _keys(5)
        src, dst = list(range(0, 10)), list(range(12, 22))
        _save(worker, keys, src)
        real, sizes = store.borrow_top, []

        @contextmanager
        def recorded(ks):
            with real(ks) as entries:
                sizes.append(sum(len(joined(e)) for e in entries if e is not None))
                yield entries

        monkeypatch.setattr(store, "borrow_top", recorded)
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src), _pages(kv, dst))
        assert sum(sizes) == 5 * entry and max(sizes) <= chunks_per_batch * entry
    finally:
        worker.close()


def test_bad_block_ids_raise_and_leave_no_pin_behind(tmp_path):
    """A load naming blocks the engine does not have raises (as a per-chunk load does); every
    pin of the batch is released: deleted entries give all their pages back."""
    worker, kv = _worker(tmp_path)
    try:
        keys = _keys(2)
        _save(worker, keys, [0, 1, 2, 3])
        with pytest.raises(ValueError):
            worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, [4, 5, 999, 1000], 0)]))
        for k in keys:
            worker.store.delete(k)
        assert _top(worker).free_bytes() == _top(worker).capacity_bytes
        assert_accounting(worker.store)
    finally:
        worker.close()

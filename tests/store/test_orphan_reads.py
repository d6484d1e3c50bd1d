"""A top entry evicted while its write-through copy is still queued (an orphan: its arena pages
stay pinned for that copy) is still found and read from those pages, so a writer may hold the
copy for the engine's step even then (``writer_step_wait_s``): the first pass of a small RAM
tier evicts its newest chunks in the middle of a step, and their copies need not run in it.
Real stores (RAM + disk under tmp_path); a fake only blocks a disk put."""

from __future__ import annotations

import numpy as np

from kvtier.store import TieredStore
from tests.store.test_step_gate import key, on_disk, wait_until
from tests.store.test_step_gate_attack import BlockingPut, small_store


def payload(i: int, n: int = 100_000) -> bytes:
    return bytes([i % 251]) * (n - 1) + bytes([i % 7])


def orphans_of(s: TieredStore) -> int:
    return len(s._ledger.orphans())


def test_an_orphan_is_found_located_and_read_while_its_copy_waits(tmp_path):
    """The disk writer is stuck in its first put: entries evicted from the 1 MiB RAM tier meanwhile
    are orphans, served from their pages (counted hits), never from a lower tier."""
    with small_store(tmp_path, wait=None) as s:
        fault = BlockingPut(s)
        assert s.put(key(0), payload(0))
        assert fault.entered.wait(5)
        for i in range(1, 21):  # 2 MB into 1 MiB: the oldest are evicted with their copies queued
            assert s.put(key(i), payload(i))
        evicted = [i for i in range(1, 21) if not s.in_top_tier([key(i)])[0]]
        assert evicted and orphans_of(s) >= len(evicted) - 1
        keys = [key(i) for i in range(1, 21)]
        assert s.lookup(keys) == 20
        hits = s.stats()["hits"]
        for i in evicted:
            assert s.locate(key(i)) == s.tier_names[0]
            assert s.get(key(i)) == payload(i)
        assert s.stats()["hits"] == hits + len(evicted)
        fault.release.set()
        assert s.flush(timeout=20)
        assert orphans_of(s) == 0
        assert all(s.get(key(i)) == payload(i) for i in range(21))
        assert s.stats()["write_drops"] == 0


def lru_store(tmp_path, wait):
    """RAM (1 MiB, LRU: the victims are predictable) over disk, writers waiting ``wait``."""
    return TieredStore.from_config({
        "tiers": [{"type": "ram", "capacity": 1 << 20, "policy": "lru"},
                  {"type": "disk", "path": str(tmp_path / "disk"), "capacity": 64 << 20}],
        "writer_step_wait_s": wait})


def orphan_beside_clean_victims(s: TieredStore) -> bytes:
    """Fill the RAM tier with written-down (clean) entries, then, in a step, put ``key(100)``,
    use the clean ones (100 is the LRU now) and put ``key(101)``: 100 is evicted while its copy
    is held (an orphan) and the room comes from the next, clean victim. The orphan's key."""
    for i in range(40):  # as many clean entries as the tier takes
        if not s.put(key(i), payload(i)):
            break
        assert s.flush(timeout=10)
        if s.stats()["evictions"]:
            break
    clean = [i for i in range(40) if s.in_top_tier([key(i)])[0]]
    s.engine_step(True)
    assert s.put(key(100), payload(100))
    for i in clean:
        assert s.get(key(i)) == payload(i)
    assert s.put(key(101), payload(101))
    assert s._ledger.has_orphan(key(100)) and not s.in_top_tier([key(100)])[0]
    return key(100)


def test_a_writer_holds_copies_through_a_step_that_evicts_them(tmp_path):
    """A put in a step evicts an entry whose copy is held (an orphan): the copy stays held (not
    on disk while the step runs), the key is found and read meanwhile from its pages, and it
    lands when the step ends, nothing dropped, no copy out of the arena."""
    with lru_store(tmp_path, wait=30.0) as s:
        victim = orphan_beside_clean_victims(s)
        assert s._detached.total == 0
        assert wait_until(lambda: s.stats()["tiers"][1]["queue_depth"] <= 1, timeout=5)  # the writer took one, holds it
        assert not on_disk(s, victim) and not on_disk(s, key(101))
        assert s.lookup([victim]) == 1 and s.get(victim) == payload(100)
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert on_disk(s, victim) and on_disk(s, key(101))
        assert s._ledger.idle() and s.stats()["write_drops"] == 0 and s.stats()["step_waits"] >= 1


def test_an_orphan_copied_out_of_the_arena_sends_the_writers_at_once(tmp_path):
    """Puts in a step overflow a RAM tier whose entries all wait for their copies: orphans are
    copied out of the arena to make room (memory past the tier's capacity), so the writers stop
    holding and write while the step still runs, until no copied-out orphan is left; every key
    found and read meanwhile, nothing dropped."""
    with small_store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        peak = 0
        for i in range(16):
            assert s.put(key(i), payload(i))
            peak = max(peak, s._detached.total)
        assert peak > 0
        assert wait_until(lambda: s._detached.total == 0, timeout=10)  # the step still runs
        assert sum(on_disk(s, key(i)) for i in range(16)) >= 1
        assert s.lookup([key(i) for i in range(16)]) == 16
        assert all(s.get(key(i)) == payload(i) for i in range(16))
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert s._ledger.idle() and s._detached.total == 0 and s.stats()["write_drops"] == 0


def test_a_deleted_orphan_is_gone_at_once_and_never_written(tmp_path):
    with small_store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        for i in range(16):
            assert s.put(key(i), payload(i))
        gone = [i for i in range(16) if not s.in_top_tier([key(i)])[0] and s._ledger.has_orphan(key(i))]
        assert gone
        for i in gone:
            assert s.delete(key(i))
            assert s.lookup([key(i)]) == 0 and s.get(key(i)) is None and s.locate(key(i)) is None
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert not any(on_disk(s, key(i)) for i in gone)
        assert all(s.get(key(i)) == payload(i) for i in range(16) if i not in gone)


def test_a_detached_orphan_reads_back_its_bytes(tmp_path):
    """When the RAM tier needs the room its orphans pin, they are copied out of the arena (once);
    the copy still reads back the entry's bytes, and the lower copy lands from it."""
    with small_store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        for i in range(40):  # 4 MB through 1 MiB: orphans pin the arena, then are copied out
            assert s.put(key(i), payload(i))
        detached = [o for o in s._ledger.orphans() if not o.detachable]
        assert detached
        assert all(s.get(key(i)) == payload(i) for i in range(40) if s.lookup([key(i)]))
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert s.stats()["write_drops"] == 0
        assert all(s.get(key(i)) == payload(i) for i in range(40))


def test_a_read_holds_the_orphan_against_a_detach(tmp_path):
    """A reader of an orphan's pages keeps them pinned: a detach meanwhile is refused, and the
    pages read back whole."""
    with small_store(tmp_path, wait=None) as s:
        fault = BlockingPut(s)
        assert s.put(key(0), payload(0))
        assert fault.entered.wait(5)
        for i in range(1, 16):
            assert s.put(key(i), payload(i))
        victim = next(i for i in range(1, 16) if s._ledger.has_orphan(key(i)))
        orphan = s._ledger.orphan(key(victim))
        seen = []

        def consume(segments):
            with s._lock:
                seen.append(orphan.detach())
            seen.append(b"".join(np.asarray(seg).tobytes() for seg in segments))

        assert s.read(key(victim), consume) == s.tier_names[0]
        assert seen == [False, payload(victim)]
        fault.release.set()
        assert s.flush(timeout=20)

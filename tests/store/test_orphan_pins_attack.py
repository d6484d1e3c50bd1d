"""Attacks on the pinned orphans of a top arena (``kvtier.store.writeback.Orphan``): a top entry
evicted while its write-through copies are still queued keeps its arena pages pinned for them,
reference-counted between the ledger and the copies reading it; ``_unpin_orphans`` copies one
out (``detach``) when the top tier needs the room.

Checked after every attack, once the lower tiers are let go and the store is flushed: the
ledger is idle (no orphan left), every arena page is either free or an entry's own (none leaked
by a pin, none freed twice), and what reached a lower tier is the bytes that were put (no pin
released while a writer still read the pages). Real tiers (RAM, disk under the test's temp
dir); the only fakes are fault-injection wrappers: a lower RAM tier whose put of chosen keys
waits at a gate (announcing it), records the bytes it was handed, or raises. Threads meet on
Events, never on sleeps.
"""

from __future__ import annotations

import logging
import random
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from kvtier.policies.lru import LRUPolicy
from kvtier.policies.registry import make_policy
from kvtier.store import StoreConfig, TieredStore
from kvtier.store import writeback
from kvtier.store.writeback import Orphan
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.ram import RamConfig, RamTier
from tests.test_store import PAGE, key, payload, ram, store_over

WAIT = 10  # seconds an Event may take before the test fails (never reached when all is well)


class GateRam(RamTier):
    """A lower RAM tier: a put of a gated key waits at that key's gate (announcing that it got
    there); every put records the bytes it was handed, read after the gate (what a writer
    reads from pinned pages then); with ``fail`` set a put raises after the gate."""

    def __init__(self, pages: int = 64, name: str = "low"):
        super().__init__(RamConfig(capacity=pages * PAGE, page_size=PAGE, pin_memory=False), name=name)
        self.gates: dict[bytes, threading.Event] = {}
        self.entered: dict[bytes, threading.Event] = {}
        self.received: dict[bytes, bytes] = {}
        self.fail = False

    def gate(self, *keys: bytes) -> "GateRam":
        for k in keys:
            self.gates[k] = threading.Event()
            self.entered[k] = threading.Event()
        return self

    def open_all(self) -> None:
        for gate in list(self.gates.values()):
            gate.set()

    def put(self, key, data, dtype="uint8", shape=None) -> bool:
        k = bytes(key)
        if k in self.gates:
            self.entered[k].set()
            if not self.gates[k].wait(30):
                raise TimeoutError("the test never opened the gate")
        self.received[k] = np.asarray(data).view(np.uint8).tobytes()
        if self.fail:
            raise OSError("injected write fault")
        return super().put(key, data, dtype, shape)


@contextmanager
def zero_held_at_the_gate(pages: int):
    """A store of a ``pages``-page top (LRU) over a ``GateRam`` whose put of key 0 waits at its
    gate: yields (store, lower) once 0 is put and its copy holds 0's pages at the gate; on the
    way out every gate opens and the store closes."""
    lower = GateRam().gate(key(0))
    store = store_over([ram(pages), lower], write_queue_depth=64)
    try:
        assert store.put(key(0), payload(0))
        assert lower.entered[key(0)].wait(WAIT)
        yield store, lower
    finally:
        lower.open_all()
        store.close()


def assert_landed(store: TieredStore, lower: GateRam, n: int) -> None:
    """Once the store settles, the lower tier holds keys 0..n-1 with the bytes put."""
    assert_all_landed(store, [lower], range(n))


def assert_all_landed(store: TieredStore, lowers: list, numbers) -> None:
    """Once the store settles, every one of ``lowers`` holds the keys of ``numbers`` with the
    bytes put."""
    settle(store, *lowers)
    for lower in lowers:
        for i in numbers:
            assert lower.get(key(i)) == payload(i), (lower.name, i)


def pages_balance(top: RamTier) -> bool:
    """Every arena page is free or an entry's own: no pinned page left behind, none counted twice
    (a raw arena)."""
    held = sum(top.footprint(top.size_of(k)) for k in top.keys())
    return top.free_bytes() + held == top.arena_bytes


def settle(store: TieredStore, *lowers: GateRam) -> None:
    """Let every lower tier go, flush, and check that nothing is left pinned or pending."""
    for lower in lowers:
        lower.open_all()
    assert store.flush(WAIT)
    assert store._ledger.orphans() == []
    assert store._ledger.idle()
    assert pages_balance(store.tiers[0])


def count_detach_copies(monkeypatch) -> list[int]:
    """The bytes of each copy an orphan's detach makes (``writeback.gather_into``: only
    ``Orphan.detach`` calls it)."""
    copies: list[int] = []
    real = writeback.gather_into

    def counting(segments, out):
        n = real(segments, out)
        copies.append(n)
        return n

    monkeypatch.setattr(writeback, "gather_into", counting)
    return copies


def in_arena(orphan: Orphan, top: RamTier) -> bool:
    """Whether ``orphan`` still pins arena pages (not a copy of its own)."""
    views = orphan.hold()
    try:
        return np.shares_memory(np.asarray(views[0]), top._arena)
    finally:
        orphan.drop()


def dirty_orphan_behind_clean_victim(pages: int = 3, lowers=None):
    """A top of ``pages`` pages (LRU) over gated lower tiers: ``c`` written below (clean), then
    0 (its copies held at the gate, pinned by the writers) and 1 (queued behind it); 2's write
    evicts 0, then 1 (an orphan: pinned, not copied) and then ``c`` for the room."""
    lowers = lowers or [GateRam()]
    store = store_over([ram(pages)] + lowers, write_queue_depth=64)
    assert store.put(key(100), payload(100))
    assert store.flush(WAIT)
    for lower in lowers:
        lower.gate(key(0))
    assert store.put(key(0), payload(0))
    for lower in lowers:
        assert lower.entered[key(0)].wait(WAIT)
    assert store.put(key(1), payload(1))
    assert store.get(key(100)) == payload(100)  # c is the most recently used now
    assert store.put(key(2), payload(2))
    orphan = store._ledger.orphan(key(1))
    assert isinstance(orphan, Orphan) and in_arena(orphan, store.tiers[0])
    return store, lowers, orphan


# ------------------------------------------------------------------------------------ defects found (fixed)


def test_a_detached_orphan_is_not_copied_again(monkeypatch):
    """Attacks ``_unpin_orphans`` walking every orphan, detached ones too: a detached orphan
    still waits in the ledger for its copy, and each later write that ran out of victims copied
    its (already private) bytes again on the engine's thread, under the store lock, and
    counted that as room made. An orphan is copied out once."""
    copies = count_detach_copies(monkeypatch)
    with zero_held_at_the_gate(2) as (store, lower):  # 0's copy holds its pages at the gate
        assert store.put(key(1), payload(1))  # 1's copy is queued behind it
        assert store.put(key(2), payload(2))  # evicts 0 and 1; no victim left: 1 is copied out
        assert copies == [PAGE]
        first = store._ledger.orphan(key(1))
        assert first is not None and not in_arena(first, store.tiers[0])  # copied out
        assert store.put(key(3), payload(3))  # evicts 2 (pinned); only 2 is copied out now
        assert copies == [PAGE, PAGE], f"{len(copies)} copies for 2 orphans: a detached one was copied again"
        assert first.detach() is False  # once
        assert_landed(store, lower, 4)


def test_no_orphan_is_copied_out_for_a_write_that_cannot_fit_anyway(monkeypatch):
    """Attacks ``_unpin_orphans`` on a write that never fits: with the arena's other pages held
    (here by a writer's pin), copying every orphan out cannot make the room, yet each was
    copied (and unpinned) before the write failed anyway: copies on the engine's thread for
    nothing. None is copied when the copies could not make the room."""
    copies = count_detach_copies(monkeypatch)
    with zero_held_at_the_gate(3) as (store, lower):  # 0's pages stay pinned by its writer
        assert store.put(key(1), payload(1))
        assert store.put(key(2), payload(2))
        assert store.put(key(9), payload(9, 3 * PAGE)) is False  # 0's page is not for the taking
        assert copies == [], f"copied {len(copies)} orphans out for a write that failed anyway"
        for i in (1, 2):
            assert in_arena(store._ledger.orphan(key(i)), store.tiers[0]), i
        assert_landed(store, lower, 3)


def test_one_write_does_not_empty_a_top_tier_whose_entries_all_wait_for_their_copies(monkeypatch):
    """Attacks the eviction loop: an evicted entry whose copies wait gives no page back, so a
    write into a full top tier whose entries all wait (a lower writer behind, as under
    ``writer_idle``) evicted every one of them (the index forgot them all, their pages still
    pinned) and only then copied one out: the top tier fell to the one new entry, and stayed
    there for as long as the writer was behind. The copy the loop tried to avoid costs one
    memcpy; now, once one pinned victim gave nothing, a second one makes an orphan be copied
    out instead of being evicted."""
    copies = count_detach_copies(monkeypatch)
    with zero_held_at_the_gate(4) as (store, lower):
        for i in (1, 2, 3):
            assert store.put(key(i), payload(i))  # queued behind 0: the whole top waits
        assert store.put(key(4), payload(4))
        assert store.in_top_tier([key(i) for i in range(5)]) == [False, False, True, True, True]
        assert copies == [PAGE]  # one orphan (1) copied out for the room
        for i in (5, 6, 7):  # the writer still behind: each write costs one entry, not the tier
            assert store.put(key(i), payload(i))
        assert sum(store.in_top_tier([key(i) for i in range(8)])) == 3
        assert_landed(store, lower, 8)


# ------------------------------------------------------------------------------------ attacks that held


def test_a_detach_is_refused_while_a_writer_reads_the_orphan_and_its_bytes_stay_right():
    """Attacks the reference count: with two lower tiers, one writer reads the orphan's pages
    (blocked in its put) while the other's copy is still queued, so the ledger still offers
    the orphan; a write out of room must not detach (unpin) it under that writer, whose put
    would then copy another entry's bytes."""
    a, b = GateRam(name="a"), GateRam(name="b")
    store, _, orphan = dirty_orphan_behind_clean_victim(lowers=[a, b])
    top = store.tiers[0]
    try:
        a.gate(key(1))
        a.gates[key(0)].set()  # a's writer lands 0, then reads 1's orphan and waits in its put
        assert a.entered[key(1)].wait(WAIT)
        assert store._ledger.orphan(key(1)) is orphan  # b's copy still to read it
        assert orphan._refs == 2  # the ledger's and a's writer's
        assert store.put(key(3), payload(3, 2 * PAGE)) is False  # room only from under a's writer
        assert in_arena(orphan, top)
        assert_all_landed(store, [a, b], (0, 1, 2, 100))
        assert a.received[key(1)] == payload(1) and b.received[key(1)] == payload(1)
    finally:
        a.open_all()
        b.open_all()
        store.close()


def test_a_delete_while_a_writer_reads_the_orphan_keeps_its_pages_until_the_writer_is_done():
    """Attacks ``begin_delete``'s release: a delete drops the ledger's reference while a writer
    reads the pages; new writes then look for free pages. The pages stay the writer's until its
    put is done (it was handed the entry's bytes), and the delete still wins below."""
    a, b = GateRam(name="a"), GateRam(name="b")
    store, _, orphan = dirty_orphan_behind_clean_victim(lowers=[a, b])
    try:
        a.gate(key(1))
        a.gates[key(0)].set()
        assert a.entered[key(1)].wait(WAIT)  # a's writer holds the orphan in its put
        assert store.delete(key(1))
        assert store._ledger.orphan(key(1)) is None
        for i in (5, 6, 7):  # every page not pinned is taken, again and again
            assert store.put(key(i), payload(i))
        settle(store, a, b)
        assert a.received[key(1)] == payload(1)  # the entry's bytes, not a later writer's
        assert a.get(key(1)) is None and b.get(key(1)) is None and store.get(key(1)) is None
        for i in (0, 2, 5, 6, 7):
            assert a.get(key(i)) == payload(i) and b.get(key(i)) == payload(i), i
    finally:
        a.open_all()
        b.open_all()
        store.close()


def test_two_lower_tiers_read_one_orphan_and_it_is_unpinned_after_the_second():
    """Attacks the ledger's reference with two queued copies of one key: the first copy to read
    the orphan must not unpin it from under the second."""
    a, b = GateRam(name="a"), GateRam(name="b")
    store, _, orphan = dirty_orphan_behind_clean_victim(lowers=[a, b])
    top = store.tiers[0]
    try:
        a.gate(key(2))
        a.gates[key(0)].set()
        assert a.entered[key(2)].wait(WAIT)  # a landed 0, then 1 from the orphan, and waits at 2
        assert a.get(key(1)) == payload(1)
        assert store._ledger.orphan(key(1)) is orphan
        assert in_arena(orphan, top)  # still pinned for b
        assert_all_landed(store, [a, b], (0, 1, 2, 100))
        assert orphan._refs == 0
    finally:
        a.open_all()
        b.open_all()
        store.close()


def test_a_re_put_of_a_key_whose_orphan_is_pinned_lands_once_with_its_bytes():
    """Attacks a second write of the key while its first entry is an orphan: two copies of it
    queued, one orphan (kept once), a second eviction of the new entry, and a detach of the
    orphan while the new entry lives."""
    store, (lower,), orphan = dirty_orphan_behind_clean_victim()
    try:
        assert store.put(key(1), payload(1))  # evicts 2 (pinned too); the orphan of 1 is copied out
        assert store.get(key(1)) == payload(1)
        assert store.put(key(3), payload(3))
        assert store.put(key(4), payload(4))  # 1's new entry evicted while its copies wait
        settle(store, lower)
        assert store.get(key(1)) == payload(1)
        for i in (0, 1, 2, 3, 4):
            assert lower.get(key(i)) == payload(i), i
    finally:
        lower.open_all()
        store.close()


def test_a_full_queue_and_close_release_the_orphans_of_dropped_copies(caplog):
    """Attacks the releases on the drop paths: ``write_queue_depth`` 1 drops copies on a full
    queue, and ``close`` with a writer stuck at the gate drops the copies still queued; each
    queued copy's orphan must be unpinned, and the stuck writer must finish without error."""
    lower = GateRam().gate(key(0))
    store = store_over([ram(3), lower], write_queue_depth=1)
    try:
        assert store.put(key(100), payload(100))
        assert store.flush(WAIT)
        assert store.put(key(0), payload(0))
        assert lower.entered[key(0)].wait(WAIT)
        assert store.put(key(1), payload(1))  # fills the queue
        assert store.get(key(100)) == payload(100)
        assert store.put(key(2), payload(2))  # its copy is dropped: 1 becomes the orphan
        assert store.stats()["write_drops"] >= 1
        orphan = store._ledger.orphan(key(1))
        assert orphan is not None and in_arena(orphan, store.tiers[0])
        writer = store._writeback._workers[1]
        with caplog.at_level(logging.ERROR):
            store.close(timeout=0.05)  # 0's copy stuck at the gate; 1's copy still queued
            assert store._ledger.orphans() == []
            assert orphan._refs == 0  # every reference let go: its pages unpinned
            lower.open_all()
            writer.join(WAIT)
            assert not writer.is_alive()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        lower.open_all()
        store.close()


def test_close_while_a_writer_reads_an_orphan_lets_it_finish_and_unpin(caplog):
    """Attacks ``close`` (and the top tier's close) under a writer that holds an orphan's pages
    in its put: close returns on its timeout, the writer then finishes on the pages it pinned
    (the bytes it was handed are the entry's), lets the orphan go and stops, without error."""
    store, (lower,), orphan = dirty_orphan_behind_clean_victim()
    try:
        lower.gate(key(1))
        lower.gates[key(0)].set()
        assert lower.entered[key(1)].wait(WAIT)  # the writer holds 1's orphan in its put
        writer = store._writeback._workers[1]
        with caplog.at_level(logging.ERROR):
            store.close(timeout=0.05)
            # landing: the ledger keeps it readable while the writer's put runs, the writer holds it
            assert store._ledger.orphans() == [] and store._ledger.readable_orphan(key(1)) is orphan
            assert orphan._refs == 2
            lower.open_all()
            writer.join(WAIT)
            assert not writer.is_alive()
        assert orphan._refs == 0
        assert lower.received[key(1)] == payload(1)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        lower.open_all()
        store.close()


def test_a_lower_tier_that_raises_in_put_still_unpins_the_orphan():
    """Attacks the writer's error path: a lower put that raises while the copy reads an
    orphan's pages must still unpin them (counted as an error, nothing stored below)."""
    store, (lower,), orphan = dirty_orphan_behind_clean_victim()
    try:
        lower.fail = True
        settle(store, lower)
        assert orphan._refs == 0
        assert lower.received[key(1)] == payload(1)
        assert lower.get(key(1)) is None
        assert store.stats()["tiers"][1]["errors"] >= 2
    finally:
        lower.open_all()
        store.close()


@pytest.mark.parametrize("detach", [False, True], ids=["read-pinned", "detached"])
def test_an_orphan_of_several_page_runs_reaches_the_lower_tier_whole(detach):
    """Attacks entries over more than one page and more than one run of pages (a fragmented
    arena): the orphan's views are several segments, gathered by the writer, or by a detach."""
    lower = GateRam().gate(key(50))
    store = store_over([ram(8), lower], write_queue_depth=64)
    top = store.tiers[0]
    big = payload(7, 3 * PAGE + 100)
    try:
        for i in range(4):
            assert store.put(key(i), payload(i))
        assert store.flush(WAIT)
        assert store.put(key(50), payload(50))  # page 4; its copy waits at the gate
        assert lower.entered[key(50)].wait(WAIT)
        assert store.delete(key(1))  # page 1 free: the next entry spans pages 1, 5, 6, 7
        assert store.put(key(7), big)
        for i in (0, 2, 3):
            assert store.get(key(i)) == payload(i)
        assert store.put(key(60), payload(60))  # evicts 50 (pinned), 7 (an orphan) and 0
        orphan = store._ledger.orphan(key(7))
        assert orphan is not None and len(orphan.hold()) == 2
        orphan.drop()
        if detach:
            assert store.put(key(61), payload(61, 4 * PAGE))  # 2, 3, 60 go; 7 is copied out
            assert not in_arena(orphan, top)
        settle(store, lower)
        assert lower.received[key(7)] == big
        assert lower.get(key(7)) == big
    finally:
        lower.open_all()
        store.close()


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "wtinylfu", "wtinylfu_adaptive"])
def test_every_copy_of_an_admitted_chain_lands_under_each_policy(policy):
    """Attacks the orphans under each eviction policy, with prefix chains (a chain's tail is
    evicted first) and ``write_many`` batches: a writer behind while a small top tier turns
    over three times; every entry the top took must reach the lower tier with its bytes (no
    orphan released before its copy read it), and every page comes back."""
    top = RamTier(RamConfig(capacity=4 * PAGE, page_size=PAGE, pin_memory=False), name="ram")
    lower = GateRam().gate(key(0, b"chain0"))
    store = TieredStore([(top, make_policy(policy, capacity_hint=top.capacity_bytes)),
                         (lower, make_policy(policy, capacity_hint=lower.capacity_bytes))],
                        StoreConfig(write_queue_depth=64))
    taken: dict[bytes, bytes] = {}
    try:
        for c in range(3):
            keys = [key(i, b"chain%d" % c) for i in range(4)]
            datas = [payload(100 * c + i) for i in range(4)]
            if c == 1:
                done = store.put_many(list(zip(keys, datas)))
            else:
                done = [store.put(k, d, parent=keys[i - 1] if i else None, chunk_index=i)
                        for i, (k, d) in enumerate(zip(keys, datas))]
            if c == 0:
                assert lower.entered[keys[0]].wait(WAIT)
            taken.update({k: d for k, d, ok in zip(keys, datas, done) if ok})
            store.get(keys[0])
        assert len(taken) >= 4
        settle(store, lower)
        for k, d in taken.items():
            assert lower.get(k) == d
    finally:
        lower.open_all()
        store.close()


def coded_ram(tmp_path, pages: int) -> RamTier:
    return RamTier(RamConfig(capacity=pages * PAGE, page_size=PAGE, shm_path=str(tmp_path / "arena"),
                             codec="lossless", pin_memory=False), name="ram")


def compressible(i: int, n: int = 2 * PAGE) -> bytes:
    return (bytes([i % 251]) * 64 + bytes(range(64))) * (n // 128)


def test_a_coded_arena_orphan_is_decoded_by_its_writer_and_by_a_detach(tmp_path):
    """Attacks a coded RAM arena (``codec: lossless``, ``kvtier serve``'s): an orphan of a coded
    entry pins its coded pages and hands out views that decode on use, read by the writer (2)
    and by a detach under the store lock (1); the coder must not move the pinned pages, and
    every coded page comes back."""
    from kvtier.tiers.ram import _DecodedOnUse

    top = coded_ram(tmp_path, 6)
    lower = GateRam()
    store = TieredStore([(top, LRUPolicy()), (lower, LRUPolicy())], StoreConfig(write_queue_depth=64))
    raw0 = payload(0, 2 * PAGE)  # random: stays raw, two pages
    try:
        assert store.put(key(100), compressible(100))
        assert store.flush(WAIT) and top.drain(WAIT)  # c: coded, one page, clean
        lower.gate(key(0))
        assert store.put(key(0), raw0)
        assert lower.entered[key(0)].wait(WAIT)  # 0 pinned by its writer at the gate
        assert store.put(key(1), compressible(1))
        assert top.drain(WAIT)
        assert store.get(key(100)) == compressible(100)
        assert store.put(key(2), compressible(2))
        assert top.drain(WAIT)
        assert top.codec_state()["entries_coded"] == 3  # c, 1, 2: one page each
        assert store.put(key(3), compressible(3))  # evicts 0, 1 (a coded orphan), c
        first = store._ledger.orphan(key(1))
        assert first is not None and isinstance(first.hold(), _DecodedOnUse)
        first.drop()
        assert top.drain(WAIT)
        assert store.put(key(4), compressible(4))  # evicts 2 (an orphan); 1 is decoded out
        views = first.hold()
        assert not isinstance(views, _DecodedOnUse)  # decoded into a buffer of its own
        first.drop()
        second = store._ledger.orphan(key(2))
        assert second is not None and second._refs == 1 and isinstance(second.hold(), _DecodedOnUse)
        second.drop()
        lower.open_all()
        assert store.flush(WAIT)
        assert store._ledger.idle()
        assert lower.get(key(0)) == raw0 and lower.received[key(0)] == raw0
        for i in (1, 2, 3, 4, 100):
            assert lower.get(key(i)) == compressible(i), i
        for i in (0, 1, 2, 3, 4, 100):
            store.delete(key(i))
        assert top.free_bytes() == top.arena_bytes  # no coded page left pinned
    finally:
        lower.open_all()
        store.close()


def test_a_coded_orphan_that_does_not_decode_is_tried_once(tmp_path, caplog):
    """Attacks ``detach`` on a coded orphan whose pages were scribbled over (a shared arena's
    file is mapped by other processes): it cannot be copied out, and every later write out of
    room decoded it again under the store lock (a decode, a corrupt count and a warning each
    time). Tried once; its copy then fails as a counted error, and its pages still come back."""
    top = coded_ram(tmp_path, 6)
    lower = GateRam()
    store = TieredStore([(top, LRUPolicy()), (lower, LRUPolicy())], StoreConfig(write_queue_depth=64))
    try:
        assert store.put(key(100), compressible(100))
        assert store.flush(WAIT) and top.drain(WAIT)
        lower.gate(key(0))
        assert store.put(key(0), payload(0, 2 * PAGE))
        assert lower.entered[key(0)].wait(WAIT)
        assert store.put(key(1), compressible(1))
        assert top.drain(WAIT)
        assert store.get(key(100)) == compressible(100)
        assert store.put(key(2), compressible(2))
        assert top.drain(WAIT)
        assert store.put(key(3), compressible(3))  # evicts 0, 1 (a coded orphan), c
        assert top.drain(WAIT)
        orphan = store._ledger.orphan(key(1))
        for start, end in orphan.hold()._entry.extents:  # scribble over its coded pages
            top._arena[start:end] = 0x5A
        orphan.drop()
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            assert store.put(key(4), compressible(4))  # 1 does not decode: 2 is copied out
            assert top.drain(WAIT)
            assert store.put(key(5), compressible(5))  # 3 is copied out; 1 is not tried again
        assert top.codec_state()["corrupt"] == 1
        assert len([r for r in caplog.records if "does not decode" in r.getMessage()]) == 1
        lower.open_all()
        assert store.flush(WAIT)
        assert store._ledger.idle()
        assert lower.get(key(1)) is None
        for i in (0, 2, 3, 4, 5, 100):
            assert lower.get(key(i)) is not None, i
        for i in (0, 1, 2, 3, 4, 5, 100):
            store.delete(key(i))
        assert top.free_bytes() == top.arena_bytes
    finally:
        lower.open_all()
        store.close()


def test_concurrent_puts_gets_and_deletes_over_a_lagging_disk_keep_bytes_and_pages(tmp_path):
    """Attacks the orphans from several threads at once: puts, gets and deletes of shared keys
    over a small top tier, a real disk tier below and a tiny write queue (copies dropped,
    orphans kept, released by deletes and by copies, copied out). A get returns the put bytes
    or nothing; afterwards every page is back and the disk holds only the put bytes."""
    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity=4 << 20, drop_cache=False), name="disk")
    store = TieredStore([(ram(5), LRUPolicy()), (disk, LRUPolicy())], StoreConfig(write_queue_depth=8))
    n, errors = 16, []
    data = {key(i): payload(i) for i in range(n)}
    start = threading.Event()

    def run(seed: int) -> None:
        rng = random.Random(seed)
        start.wait(WAIT)
        try:
            for _ in range(600):
                k = key(rng.randrange(n))
                op = rng.random()
                if op < 0.5:
                    store.put(k, data[k])
                elif op < 0.85:
                    got = store.get(k)
                    if got is not None and got != data[k]:
                        errors.append(("wrong bytes", k.hex()))
                else:
                    store.delete(k)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    try:
        for th in threads:
            th.start()
        start.set()
        for th in threads:
            th.join(WAIT * 3)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        settle(store)
        for k in disk.keys():
            assert disk.get(k) == data[k]
        for k in data:
            got = store.get(k)
            assert got is None or got == data[k]
    finally:
        store.close()


def test_close_racing_puts_leaves_no_orphan_pinned(tmp_path):
    """Attacks ``close`` while other threads write into a full top tier over a stuck lower tier
    (orphans being made): once close returns, no orphan is left in the ledger, and the writers
    racing it neither raise nor hang."""
    lower = GateRam().gate(key(0))
    store = store_over([ram(3), lower], write_queue_depth=8)
    errors: list[str] = []
    go = threading.Event()
    some = threading.Event()

    def run(base: int) -> None:
        go.wait(WAIT)
        try:
            for i in range(base, base + 200):
                store.put(key(i), payload(i % 7))
                if i - base == 5:
                    some.set()
        except Exception as exc:
            errors.append(repr(exc))

    assert store.put(key(0), payload(0))
    assert lower.entered[key(0)].wait(WAIT)
    threads = [threading.Thread(target=run, args=(1000 * (t + 1),)) for t in range(3)]
    try:
        for th in threads:
            th.start()
        go.set()
        assert some.wait(WAIT)
        store.close(timeout=0.05)
        assert store._ledger.orphans() == []
        lower.open_all()
        for th in threads:
            th.join(WAIT)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        assert store._ledger.orphans() == []
    finally:
        lower.open_all()
        store.close()

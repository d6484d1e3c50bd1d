"""Hostile callers of the orphan reads (``TieredStore._hold_orphan``: ``lookup``, ``locate``,
``read``/``get`` find a top entry evicted while its write-through copy waits, and serve its pinned
pages) and of the writers' hold of such a copy through the engine's step (``_may_hold_copy``).

Contracts attacked: nothing lost, no wrong bytes, delete wins, no pin left (after a flush the
ledger is idle, no orphan kept, every arena page free or an entry's own), no deadlock (a read's
consume calls back into the store), close() during holds loses nothing, counters stay sane.
Real stores (a small RAM tier over a disk tier under tmp_path); fakes only inject faults: a
disk put of chosen keys waits at a gate, and a coded arena's pages are scribbled over."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.errors import CorruptEntry
from kvtier.policies.lru import LRUPolicy
from kvtier.store import StoreConfig, TieredStore, writeback
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.ram import RamConfig, RamTier
from tests.store.test_orphan_pins_attack import coded_ram as coded, compressible
from tests.store.test_orphan_reads import lru_store, orphan_beside_clean_victims
from tests.store.test_step_gate import wait_until
from tests.store.test_step_gate_attack import reopened
from tests.test_store import PAGE, key, payload

WAIT = 10


class KeyGate:
    """Fault: the disk tier's put of a gated key waits until its gate opens (announcing it)."""

    def __init__(self, s: TieredStore, *numbers: int):
        self.tier = s._levels[1].tier
        self.real = self.tier.put
        self.gates = {key(i): threading.Event() for i in numbers}
        self.entered = {key(i): threading.Event() for i in numbers}
        self.tier.put = self

    def __call__(self, k, data, *args, **kwargs):
        k = bytes(k)
        if k in self.gates:
            self.entered[k].set()
            self.gates[k].wait(30)
        return self.real(k, data, *args, **kwargs)

    def open(self, i: int) -> None:
        self.gates[key(i)].set()

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


def make(tmp_path, pages: int = 4, wait: float | None = None, depth: int = 64, top: RamTier | None = None):
    top = top or RamTier(RamConfig(capacity=pages * PAGE, page_size=PAGE, pin_memory=False), name="ram")
    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity=64 << 20, drop_cache=False), name="disk")
    return TieredStore([(top, LRUPolicy()), (disk, LRUPolicy())],
                       StoreConfig(write_queue_depth=depth, writer_step_wait_s=wait))


def balanced(top: RamTier) -> bool:
    """Every arena page is free or an entry's own (coded or raw): none left pinned."""
    with top._lock:
        held = top._page * sum(len(e.pages) for e in top._entries.values())
    return top.free_bytes() + held == top.arena_bytes


def settle(s: TieredStore, gate: KeyGate | None = None) -> None:
    if gate is not None:
        gate.open_all()
    s.engine_step(False)
    assert s.flush(WAIT)
    assert s._ledger.orphans() == [] and s._ledger.idle()
    assert balanced(s.tiers[0])


def orphaned(s: TieredStore, gate: KeyGate, numbers) -> list[int]:
    """Key 0's copy stuck at the disk gate (its writer blocked), then ``numbers`` put through the
    4-page top: the evicted ones (copies queued) are orphans. Returns those."""
    assert s.put(key(0), payload(0))
    assert gate.entered[key(0)].wait(WAIT)
    for i in numbers:
        assert s.put(key(i), payload(i))
    gone = [i for i in numbers if s._ledger.has_orphan(key(i))]
    assert gone
    return gone


def coded_orphan(s: TieredStore) -> tuple[KeyGate, object]:
    """A coded top of 6 pages: 100 coded and clean, 0 stuck at the disk gate, 1 and 2 coded;
    putting 3 evicts 0, 1 (a coded orphan whose pages stay pinned) and 100."""
    top = s.tiers[0]
    assert s.put(key(100), compressible(100))
    assert s.flush(WAIT) and top.drain(WAIT)
    gate = KeyGate(s, 0)
    assert s.put(key(0), payload(0, 2 * PAGE))
    assert gate.entered[key(0)].wait(WAIT)
    for i in (1, 100, 2, 3):
        assert s.put(key(i), compressible(i)) if i != 100 else s.get(key(i)) == compressible(i)
        assert top.drain(WAIT)
    orphan = s._ledger.orphan(key(1))
    assert type(orphan.hold()).__name__ == "_DecodedOnUse"  # pinned, decoded on use
    orphan.drop()
    return gate, orphan


# ----------------------------------------------------------------------------- defects


def test_an_orphan_stays_found_while_its_copy_is_in_flight(tmp_path):
    """The module notes promise an orphan is 'found and read from those pages until they land'.
    But ``_copy_down`` lets go of the orphan in the ledger (``release_orphan(self._ledger.
    read_top(copy.key))``) as soon as the copy pins its pages, before the put: while that put
    runs (a slow disk) the key is in no index and no orphan, so lookup says 0 and get misses,
    though the bytes sit pinned in RAM and land a moment later (a scheduler that counted the
    chunk as a hit sees its load fail)."""
    with make(tmp_path) as s:
        gate = KeyGate(s, 0, 1)
        gone = orphaned(s, gate, range(1, 6))
        assert 1 in gone and s.lookup([key(1)]) == 1 and s.get(key(1)) == payload(1)
        gate.open(0)
        assert gate.entered[key(1)].wait(WAIT)  # 1's copy holds its pages, its put blocked
        seen = (s.lookup([key(1)]), s.locate(key(1)), s.get(key(1)) == payload(1))
        settle(s, gate)
        assert s.get(key(1)) == payload(1)
        assert seen == (1, "ram", True), f"while its copy was in flight: {seen}"


def test_a_re_put_of_an_orphan_key_never_serves_the_old_bytes_after(tmp_path):
    """Put k=v1; k is evicted while its copy waits (an orphan of v1); put k=v2 (a new top entry,
    a second copy queued); v2 is evicted too. ``_evict_top`` keeps no second orphan (one is kept:
    ``_pins_on_eviction``) and does not demote (a copy is queued), so v2's pages are freed; then
    ``read`` -> ``_hold_orphan`` serves v1, and both copies read the orphan
    (``_pin_top`` prefers it over the index), so v1 is what lands on disk. The last put is lost
    and get flips v2 -> v1. (Harmless only while equal keys always carry equal bytes.)"""
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        new = payload(1001)
        gone = orphaned(s, gate, range(1, 6))
        assert 1 in gone
        assert s.put(key(1), new) and s.get(key(1)) == new
        for i in range(6, 10):  # evict the new entry of 1 as well
            assert s.put(key(i), payload(i))
        during = s.get(key(1))
        settle(s, gate)
        after = s.get(key(1))
        name = {new: "new", payload(1): "OLD", None: None}
        assert (name[during], name[after]) == ("new", "new"), f"get after the re-put: {name[during]}, {name[after]}"


def test_a_coded_orphan_that_does_not_decode_is_a_counted_miss_not_an_exception(tmp_path):
    """A coded arena (``codec: lossless``) hands an orphan's pages out as ``_DecodedOnUse``;
    ``read`` runs ``consume(segments)`` on them with no guard, so pages scribbled over (a shared
    arena file) make ``get`` raise CorruptEntry into the caller. The store's contract: a storage
    fault is a counted miss, never raised (a lower tier's corrupt entry is exactly that)."""
    with make(tmp_path, top=coded(tmp_path, 6)) as s:
        gate, orphan = coded_orphan(s)
        for start, end in orphan.hold()._entry.extents:
            s.tiers[0]._arena[start:end] = 0x5A
        orphan.drop()
        misses = s.stats()["misses"]
        try:
            got = s.get(key(1))
        except CorruptEntry as exc:
            got = exc
        settle(s, gate)
        assert got is None and s.stats()["misses"] == misses + 1, f"get of the corrupt orphan: {got!r}"


def test_an_orphan_read_is_counted_by_the_tier_it_names(tmp_path):
    """``read`` names the top tier for an orphan hit and the store counts a hit, but
    ``_hold_orphan`` adds neither a hit nor ``bytes_read`` to the top tier's stats (every other
    read path counts it in the tier it names: ``borrow``, ``get_into``), so per-tier hit ratios
    under-report the RAM tier exactly when it is small and evicting."""
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        gone = orphaned(s, gate, range(1, 6))
        before = s.stats()["tiers"][0]["hits"]
        assert all(s.read(key(i), lambda segs: None) == "ram" for i in gone)
        after = s.stats()["tiers"][0]["hits"]
        settle(s, gate)
        assert after == before + len(gone)


@pytest.mark.xfail(strict=True, reason="LIMIT: a put into a top tier full of orphans copies one out on the putting "
                   "thread; the writers then stop holding until no copied-out orphan is left")
def test_a_held_step_does_not_move_the_copies_onto_the_putting_thread(tmp_path, monkeypatch):
    """docs/design.md: an orphan means 'no copy on the evicting thread, which is the engine's';
    ``_unpin_orphans``: 'only when the lower writers fall behind does an eviction cost a copy'.
    The hold now keeps writers behind on purpose, orphans included, so once the top is full
    of orphans every put during the step detaches one (``Orphan.detach``: a heap buffer and a
    memcpy under the store lock, on the engine's thread), and the detached copies, held until
    the step ends, outgrow the RAM tier's capacity (up to half the queue). Paced puts with no
    hold (wait None) cost none: the writer keeps up."""
    copies = []
    real = writeback.gather_into
    monkeypatch.setattr(writeback, "gather_into", lambda segs, out: (copies.append(out.nbytes), real(segs, out))[1])
    with make(tmp_path, wait=30.0, depth=128) as s:
        s.engine_step(True)
        peak = 0
        for i in range(40):
            assert s.put(key(i), payload(i))
            peak = max(peak, sum(o.nbytes for o in s._ledger.orphans() if not o._pinned))
        arena = s.tiers[0].arena_bytes
        settle(s)
    assert (len(copies), peak <= arena) == (0, True), f"{len(copies)} detach copies, {peak} B heap over a {arena} B tier"


def test_lookup_takes_the_keys_read_and_locate_take(tmp_path):
    """``is_valid_key`` takes a bytearray and ``read``/``locate`` convert it (``check_key``), but
    ``lookup`` hands it as it is to ``StoreIndex.leading_held`` (``level.holds(key)``, then
    ``has_orphan``): a dict lookup of an unhashable key, TypeError into the scheduler."""
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        gone = orphaned(s, gate, range(1, 6))
        k = bytearray(key(gone[0]))
        assert s.locate(k) == "ram" and s.get(k) == payload(gone[0])
        try:
            assert s.lookup([k]) == 1
        finally:
            settle(s, gate)


# ----------------------------------------------------------------------------- attacks that held


def test_orphans_are_found_located_counted_and_interleave_in_a_chain(tmp_path):
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        gone = orphaned(s, gate, range(1, 8))
        held = [i for i in range(1, 8) if s.in_top_tier([key(i)])[0]]
        assert held and all(s.locate(key(i)) == "ram" for i in gone + held)
        chain = [key(i) for i in range(1, 8)]
        assert s.lookup(chain) == 7
        assert s.lookup(chain + [key(99)] + chain) == 7  # a missing key ends the run
        assert s.lookup([key(gone[0]), b"short", key(held[0])]) == 1  # so does an invalid key
        assert s.locate(key(99)) is None and s.locate(b"bad") is None
        st = s.stats()
        for i in gone:
            assert s.get(key(i)) == payload(i)
        assert s.get(key(99)) is None
        st2 = s.stats()
        assert (st2["hits"] - st["hits"], st2["misses"] - st["misses"]) == (len(gone), 1)
        settle(s, gate)
        assert all(s.get(key(i)) == payload(i) for i in range(8))


def test_consume_that_reenters_the_store_does_not_deadlock(tmp_path):
    """A read's consume reads the key again, deletes it, looks it up and writes enough to need
    the orphan's pages (its detach is refused: it is read), all inside the hold; one that raises
    lets go of the hold."""
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        gone = orphaned(s, gate, range(1, 6))
        victim, seen = gone[-1], []  # the newest: pinned in the arena, not copied out

        def boom(segments):
            raise RuntimeError("caller bug")

        for _ in range(3):  # a consume that raises lets go of its hold
            with pytest.raises(RuntimeError):
                s.read(key(victim), boom)
        assert s._ledger.orphan(key(victim))._refs == 1

        def consume(segments):
            seen.append(b"".join(np.asarray(seg).tobytes() for seg in segments))
            seen.append(s.get(key(victim)))  # nested hold of the same orphan
            s.delete(key(victim))
            seen.append(s.lookup([key(victim)]))
            for i in range(20, 26):
                s.put(key(i), payload(i))
            seen.append(b"".join(np.asarray(seg).tobytes() for seg in segments))  # still pinned

        t = threading.Thread(target=lambda: seen.append(s.read(key(victim), consume)))
        t.start()
        t.join(WAIT)
        assert not t.is_alive(), "read with a re-entrant consume deadlocked"
        assert seen == [payload(victim), payload(victim), 0, payload(victim), "ram"]
        assert s.get(key(victim)) is None
        settle(s, gate)
        assert s.get(key(victim)) is None and not s._levels[1].tier.contains(key(victim))


def test_delete_then_re_put_of_an_orphan_during_a_held_step_lands_the_new_bytes(tmp_path):
    with make(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        for i in range(8):
            assert s.put(key(i), payload(i))
        gone = [i for i in range(8) if s._ledger.has_orphan(key(i))]
        assert gone
        k, new = gone[0], payload(777)
        assert s.delete(key(k)) and s.get(key(k)) is None and s.lookup([key(k)]) == 0
        assert s.put(key(k), new) and s.get(key(k)) == new
        for i in range(8, 12):  # the new entry is evicted in its turn: an orphan of the new bytes
            assert s.put(key(i), payload(i))
        assert s.get(key(k)) == new
        settle(s)
        assert s.get(key(k)) == new
    with reopened(tmp_path) as again:
        assert again.get(key(k)) == new
        assert all(again.get(key(i)) == payload(i) for i in range(12) if i != k)


def test_concurrent_readers_deleters_and_writers_on_held_orphans_and_detaches(tmp_path):
    """Readers (get, lookup, locate), a deleter and a writer hammer keys that are orphans while the
    writer holds their copies for a step, and the writes need the orphans' pages (detaches, some
    refused while read): a get is the put bytes or nothing, never an error or other bytes."""
    with make(tmp_path, pages=6, wait=30.0, depth=256) as s:
        s.engine_step(True)
        for i in range(40):
            assert s.put(key(i), payload(i))
        assert len(s._ledger.orphans()) > 4
        stop, bad, deleted = threading.Event(), [], set(range(0, 40, 5))

        def reader(seed):
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                i = int(rng.integers(0, 70))
                try:
                    got = s.get(key(i))
                    s.lookup([key(j) for j in range(i, i + 4)]), s.locate(key(i))
                except Exception as exc:  # noqa: BLE001
                    bad.append(repr(exc))
                    return
                if got is not None and got != payload(i):
                    bad.append(i)

        jobs = [lambda: [s.delete(key(i)) for i in sorted(deleted)],
                lambda: [s.put(key(i), payload(i)) for i in range(40, 70)]]
        threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
        threads += [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads[4:]:
            t.join(WAIT)
        stop.set()
        for t in threads[:4]:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads) and bad == []
        settle(s)
        for i in range(70):
            got = s.get(key(i))
            assert got is None if i in deleted else got in (None, payload(i)), i
        assert all(s._levels[1].tier.get(key(i)) is None for i in deleted)
        assert s.stats()["write_drops"] == 0


def test_a_zero_length_orphan_is_found_read_and_lands(tmp_path):
    with make(tmp_path) as s:
        gate = KeyGate(s, 0)
        assert s.put(key(0), payload(0))
        assert gate.entered[key(0)].wait(WAIT)
        assert s.put(key(1), b"")
        for i in range(2, 7):
            assert s.put(key(i), payload(i))
        assert s.get(key(1)) == b"" and s.lookup([key(1), key(6)]) == 2
        settle(s, gate)
        assert s.get(key(1)) == b"" and s._levels[1].tier.get(key(1)) == b""


def test_close_during_held_orphan_copies_loses_nothing(tmp_path):
    s = make(tmp_path, wait=30.0)
    s.engine_step(True)
    for i in range(12):
        assert s.put(key(i), payload(i))
    assert s._ledger.orphans()
    closer = threading.Thread(target=s.close, kwargs={"timeout": 5.0})
    closer.start()
    s.engine_step(True)  # the engine races the shutdown
    closer.join(WAIT)
    assert not closer.is_alive() and s._ledger.idle() and s.stats()["write_drops"] == 0
    with reopened(tmp_path) as again:
        assert all(again.get(key(i)) == payload(i) for i in range(12))


def test_the_hold_drops_nothing_and_copied_out_orphans_are_written_at_once(tmp_path):
    """30 pages through a 4-page top in one step: nothing dropped, every key found meanwhile;
    orphans copied out of the arena (memory past its capacity) are not held: none is left
    while the step still runs."""
    with make(tmp_path, wait=30.0, depth=128) as s:
        s.engine_step(True)
        ok = [s.put(key(i), payload(i)) for i in range(30)]
        assert all(ok)
        assert s.lookup([key(i) for i in range(30)]) == 30
        assert wait_until(lambda: s._detached.total == 0, timeout=10)
        settle(s)
        st = s.stats()
        assert st["write_drops"] == 0 and st["tiers"][0]["dropped"] == 0
    with reopened(tmp_path) as again:
        assert all(again.get(key(i)) == payload(i) for i in range(30))


def test_a_deleted_orphan_releases_its_held_copy_at_once(tmp_path):
    """``_wait_for_step`` stops holding once ``may_hold`` says no ('it was deleted'), but
    ``StepGate.wait`` asks ``done()`` only when woken: ``delete`` wakes it, so the cancelled copy
    of a deleted orphan does not sit with the writer until the step ends (it once did)."""
    with lru_store(tmp_path, wait=30.0) as s:
        victim = orphan_beside_clean_victims(s)
        assert wait_until(lambda: s.stats()["tiers"][1]["queue_depth"] <= 1, timeout=5)  # the victim's copy held
        assert s.delete(victim)
        released = wait_until(lambda: s.stats()["cancelled_writes"] >= 1, timeout=1.5)
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert s.get(victim) is None and s._levels[1].tier.get(victim) is None
        assert released, "the deleted key's copy stayed held until the step ended"


def test_a_re_put_of_the_same_bytes_while_the_orphan_copy_is_in_flight_lands_once(tmp_path):
    with make(tmp_path) as s:
        gate = KeyGate(s, 0, 1)
        gone = orphaned(s, gate, range(1, 6))
        assert 1 in gone
        gate.open(0)
        assert gate.entered[key(1)].wait(WAIT)  # in flight
        assert s.put(key(1), payload(1)) and s.get(key(1)) == payload(1)
        for i in range(6, 10):
            assert s.put(key(i), payload(i))
        settle(s, gate)
        assert s.get(key(1)) == payload(1) and s._levels[1].tier.get(key(1)) == payload(1)
        assert s.stats()["tiers"][1]["entries"] == len(set(s._levels[1].tier.keys()))


def test_a_coded_orphan_reads_back_decoded(tmp_path):
    with make(tmp_path, top=coded(tmp_path, 6)) as s:
        gate, _ = coded_orphan(s)
        assert s.lookup([key(1)]) == 1 and s.get(key(1)) == compressible(1)
        settle(s, gate)
        assert all(s.get(key(i)) == compressible(i) for i in (1, 2, 3, 100))

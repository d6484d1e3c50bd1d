"""CopyLedger alone (no threads, no tiers): each interleaving of ``kvtier/store/ledger.py``'s
notes, played as the store plays it (register a copy, carry it out, release it)."""

from __future__ import annotations

import hashlib

from kvtier.store.ledger import CopyLedger

K = hashlib.sha256(b"k").digest()
J = hashlib.sha256(b"j").digest()


def test_delete_during_a_queued_copy_skips_it():
    ledger = CopyLedger()
    gen = ledger.begin_write_through(K)  # queued, not yet run
    ledger.begin_delete(K)
    ledger.end_delete(K)
    assert ledger.deleted_since(K, gen)  # the writer, when it runs: skip
    ledger.read_top(K)
    ledger.end_copy(K)
    assert ledger.idle()


def test_delete_during_an_in_flight_copy_undoes_its_put():
    ledger = CopyLedger()
    gen = ledger.begin_write_through(K)
    assert not ledger.deleted_since(K, gen)  # before the put: go
    ledger.read_top(K)
    ledger.begin_in_flight(K)
    assert not ledger.demotable(K)  # an eviction now must not demote it as well
    ledger.begin_delete(K)  # while the put runs
    ledger.end_delete(K)
    assert ledger.deleted_since(K, gen)  # after the put: undo it
    ledger.end_in_flight(K)
    ledger.end_copy(K)
    assert ledger.idle()


def test_delete_during_a_demotion_being_read_wins():
    """The demotion is registered when the eviction is decided, before its bytes are read
    outside the lock: a delete in that gap tombstones it, and it is skipped when it runs."""
    ledger = CopyLedger()
    gen = ledger.begin_copy(K)  # eviction decided: demote K from level 1 to 2
    ledger.begin_removal(1, K)
    ledger.begin_delete(K)  # the delete sees the key pending
    ledger.end_delete(K)
    ledger.end_removal(1, K)  # bytes read, tier delete done: the demotion is queued under gen
    assert ledger.deleted_since(K, gen)
    ledger.end_copy(K)
    assert ledger.idle()


def test_re_put_after_delete_lands_while_the_older_copy_is_skipped():
    ledger = CopyLedger()
    old = ledger.begin_write_through(K)
    ledger.begin_delete(K)
    ledger.end_delete(K)
    new = ledger.begin_write_through(K)  # written again after the delete
    assert ledger.deleted_since(K, old)
    assert not ledger.deleted_since(K, new)
    for _ in range(2):
        ledger.read_top(K)
        ledger.end_copy(K)
    assert ledger.idle()


def test_re_put_after_delete_with_nothing_pending_carries_the_current_generation():
    ledger = CopyLedger()
    ledger.begin_delete(K)  # nothing pending: no tombstone kept
    ledger.end_delete(K)
    assert ledger.idle()
    gen = ledger.begin_copy(K)
    assert not ledger.deleted_since(K, gen)
    ledger.end_copy(K)
    assert ledger.idle()


def test_a_delete_counts_once_per_key_and_tombstones_go_with_the_last_copy():
    ledger = CopyLedger()
    a, b = ledger.begin_copy(K), ledger.begin_copy(J)
    seq = ledger.delete_seq
    ledger.begin_delete(K)
    assert ledger.delete_seq == seq + 1 and ledger.is_deleting(K) and not ledger.is_deleting(J)
    ledger.end_delete(K)
    assert ledger.deleted_since(K, a) and not ledger.deleted_since(J, b)
    second = ledger.begin_copy(K)  # registered after the delete: current
    ledger.end_copy(K)
    assert not ledger.deleted_since(K, second)  # the tombstone stays while a copy is pending
    ledger.end_copy(K)
    ledger.end_copy(J)
    assert ledger.idle()


def test_orphan_bytes_live_only_while_a_write_through_copy_is_queued():
    ledger = CopyLedger()
    assert ledger.keep_orphan(K, b"x") is False  # nothing queued: nothing would release them
    assert ledger.orphan(K) is None
    ledger.begin_write_through(K)
    ledger.begin_write_through(K)
    assert ledger.keep_orphan(K, b"x") is True
    assert ledger.keep_orphan(K, b"z") is False  # one kept already: the caller releases its own
    assert ledger.read_top(K) is None
    assert ledger.orphan(K) == b"x"  # one copy still to read them
    assert ledger.read_top(K) == b"x"  # the last copy hands them back to be released
    assert ledger.orphan(K) is None
    ledger.begin_write_through(K)
    ledger.keep_orphan(K, b"y")
    assert ledger.begin_delete(K) == [b"y"]  # a delete drops them: the queued copy must not bring the key back
    assert ledger.orphan(K) is None
    ledger.end_delete(K)
    assert ledger.read_top(K) is None
    ledger.end_copy(K)
    ledger.end_copy(K)
    ledger.end_copy(K)
    assert ledger.idle()


def test_removals_and_stores_are_per_level_and_nest():
    ledger = CopyLedger()
    ledger.begin_removal(1, K)
    ledger.begin_removal(1, K)
    assert ledger.removing(1, K) and not ledger.removing(2, K) and not ledger.removing(1, J)
    ledger.end_removal(1, K)
    assert ledger.removing(1, K)  # a put of K into level 1 still waits
    ledger.end_removal(1, K)
    assert not ledger.removing(1, K)
    ledger.begin_store(0, K)
    assert ledger.storing(0, K) and not ledger.storing(1, K) and not ledger.idle()
    ledger.end_store(0, K)
    assert ledger.idle()


def test_demotable_unless_a_write_through_copy_is_on_its_way():
    ledger = CopyLedger()
    assert ledger.demotable(K)
    ledger.begin_write_through(K)
    assert not ledger.demotable(K) and ledger.is_queued(K)
    ledger.read_top(K)
    assert ledger.demotable(K)  # read, not yet holding bytes: gave up
    ledger.begin_in_flight(K)
    assert not ledger.demotable(K) and ledger.is_in_flight(K)
    ledger.end_in_flight(K)
    ledger.end_copy(K)
    assert ledger.demotable(K) and ledger.idle()


def test_a_landing_orphan_serves_reads_until_its_copy_lands():
    ledger = CopyLedger()
    ledger.begin_write_through(K)
    assert ledger.keep_orphan(K, b"x")
    assert ledger.readable_orphan(K) == b"x" and ledger.has_orphan(K)
    orphan = ledger.read_top(K)  # the last copy read it: it puts the bytes now
    assert orphan == b"x" and ledger.orphan(K) is None
    assert ledger.land(K, orphan) is None
    assert ledger.readable_orphan(K) == b"x" and ledger.has_orphan(K)  # found while the put runs
    assert ledger.orphans() == []  # not one to copy out: its copy reads it
    assert ledger.landed(K, orphan) == b"x"  # landed: the caller releases it
    assert not ledger.has_orphan(K) and ledger.landed(K, orphan) is None
    ledger.end_copy(K)
    assert ledger.idle()


def test_a_new_entry_or_a_delete_lets_go_of_kept_and_landing_orphans():
    ledger = CopyLedger()
    ledger.begin_write_through(K)
    ledger.keep_orphan(K, b"old")
    ledger.land(K, ledger.read_top(K))
    ledger.begin_write_through(K)  # a re-put: its copy is queued, then it is evicted too
    ledger.keep_orphan(K, b"new")
    assert ledger.readable_orphan(K) == b"new"  # the newer entry's bytes win
    assert sorted(ledger.supersede(K)) == [b"new", b"old"]  # a third entry of K was published
    assert not ledger.has_orphan(K) and ledger.landed(K, b"old") is None  # its copy finds it gone
    assert ledger.read_top(K) is None
    ledger.begin_write_through(K)
    ledger.keep_orphan(K, b"y")
    ledger.land(K, ledger.read_top(K))
    assert ledger.begin_delete(K) == [b"y"]  # a delete drops the landing one too
    assert not ledger.has_orphan(K) and ledger.landed(K, b"y") is None
    ledger.end_delete(K)
    for _ in range(3):
        ledger.end_copy(K)
    assert ledger.idle()

"""``RoomLedger``: when a hit of several KV cache groups may load inline (no eviction can come
before its load). Pure bookkeeping, every interleaving the module notes describe."""

from __future__ import annotations

from kvtier.integrations.vllm.room import RoomLedger


def test_unknown_room_is_never_safe():
    ledger = RoomLedger()
    assert not ledger.safe()
    ledger.reported(3, None)
    assert not ledger.safe()


def test_a_reported_room_covers_the_steps_planned_since_and_no_more():
    ledger = RoomLedger()
    ledger.reported(0, 5)
    assert ledger.safe()
    ledger.planned(1, 3)  # in flight: not yet reported
    assert ledger.safe()
    ledger.planned(2, 2)
    assert ledger.safe()  # 5 >= 3 + 2: nothing can be evicted
    ledger.planned(2, 1)
    assert not ledger.safe()  # 6 entries may come before the next load, 5 fit
    ledger.reported(1, 2)  # step 1's saves were made: room 2 left against step 2's 3
    assert not ledger.safe()
    ledger.reported(2, 0)  # every planned step seen; a full tier evicts nothing until the next put
    assert ledger.safe()
    ledger.planned(3, 1)
    assert not ledger.safe()


def test_background_loads_count_until_they_are_reported_finished():
    ledger = RoomLedger()
    ledger.reported(0, 4)
    ledger.loading("a", 3)
    assert ledger.safe()
    ledger.loading("b", 2)  # their promotions could take 5 entries
    assert not ledger.safe()
    ledger.reported(5, 4)  # later steps reported: the loads may still be promoting
    assert not ledger.safe()
    ledger.loaded({"b", "unknown"})
    assert ledger.safe()
    ledger.loaded(None)
    assert ledger.safe()


def test_a_stale_report_is_ignored_and_a_plan_for_a_seen_step_counts_nothing():
    ledger = RoomLedger()
    ledger.reported(4, 1)
    ledger.reported(3, 100)  # out of order: older than what is known
    ledger.planned(5, 2)
    assert not ledger.safe()
    ledger.planned(4, 50)  # step 4 is already in the report
    ledger.reported(5, 0)
    assert ledger.safe()

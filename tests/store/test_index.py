"""The store's decisions alone (``kvtier.store.index``): real policies, no tiers, no I/O, no
threads. What each level holds, what must go for an entry to fit, which chunk of a prefix
chain goes first and where its bytes should go."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.policies.admission import Admission, AdmissionConfig
from kvtier.policies.registry import POLICIES, make_policy
from kvtier.store.events import EventLog, StoreEvent
from kvtier.store.index import Eviction, LevelIndex, Room, StoreIndex


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def index(*capacities: int | None, policy: str = "lru", admission: AdmissionConfig | None = None,
          events: EventLog | None = None) -> StoreIndex:
    """Levels of the given capacities (None: a self-managed level, no policy)."""
    levels = [LevelIndex(f"l{i}", "CPU" if i == 0 else "DISK", cap or 0,
                         None if cap is None else make_policy(policy, capacity_hint=cap))
              for i, cap in enumerate(capacities)]
    return StoreIndex(levels, Admission(admission or AdmissionConfig()), events or EventLog())


def fill_up(idx: StoreIndex, level: int, nbytes: int, count: int, chain: bool = False) -> list[bytes]:
    keys = [key(100 * level + i) for i in range(count)]
    for i, k in enumerate(keys):
        idx.insert(level, k, nbytes, keys[i - 1] if chain and i else None)
    return keys


def make_room(idx: StoreIndex, level: int, nbytes: int) -> list[Eviction] | None:
    """Carry decisions out as a store would (forgetting each evicted key) until the entry
    fits; the evictions in order, or None when it never fits."""
    done = []
    while True:
        step = idx.plan_room(level, nbytes, nbytes, None)
        if step is Room.FITS:
            return done
        if step is Room.NEVER:
            return None
        done.append(step)
        assert idx.forget(step.level, step.key)


@pytest.mark.parametrize("policy", POLICIES.names())
def test_fits_without_evicting_while_there_is_room(policy):
    idx = index(1000, policy=policy)
    fill_up(idx, 0, 100, 5)
    assert idx.plan_room(0, 500, 500, None) is Room.FITS
    assert idx[0].used == 500


@pytest.mark.parametrize("policy", POLICIES.names())
def test_an_entry_larger_than_the_level_never_fits(policy):
    idx = index(1000, policy=policy)
    assert idx.plan_room(0, 1001, 1001, None) is Room.NEVER
    assert idx.plan_room(0, 10, 1001, None) is Room.NEVER  # what it occupies counts, not its payload


@pytest.mark.parametrize("policy", POLICIES.names())
def test_making_room_evicts_until_it_fits_and_accounts_exactly(policy):
    idx = index(1000, policy=policy)
    fill_up(idx, 0, 100, 10)
    evictions = make_room(idx, 0, 250)
    assert evictions is not None and len(evictions) == 3
    assert idx[0].used == 700 and len(idx[0].sizes) == 7
    assert all(e.level == 0 for e in evictions)
    assert idx.plan_room(0, 250, 250, None) is Room.FITS


def test_lru_evicts_the_least_recently_used_first():
    idx = index(300)
    a, b, c = fill_up(idx, 0, 100, 3)
    idx.accessed(0, a)
    assert idx.plan_room(0, 100, 100, None) == Eviction(b, 0, None)


def test_within_a_chain_the_tail_goes_first():
    idx = index(400)
    chain = fill_up(idx, 0, 100, 4, chain=True)
    order = [e.key for e in make_room(idx, 0, 400)]
    assert order == chain[::-1]  # the LRU head names the chain; its tail is evicted first


def test_a_cyclic_parent_link_does_not_hang():
    idx = index(200)
    a, b = key(1), key(2)
    idx.insert(0, a, 100, b)
    idx.insert(0, b, 100, a)
    assert isinstance(idx.plan_room(0, 100, 100, None), Eviction)


def test_an_eviction_names_where_its_bytes_should_go():
    idx = index(200, 1000, None)
    a, b = fill_up(idx, 0, 100, 2)
    assert idx.plan_room(0, 100, 100, None) == Eviction(a, 0, 1)  # the next level lacks it
    idx.insert(1, a, 100, None)
    assert idx.plan_room(0, 100, 100, None) == Eviction(a, 0, None)  # the next level holds it
    fill_up(idx, 1, 100, 9)
    step = idx.plan_room(1, 100, 100, None)
    assert isinstance(step, Eviction) and step.demote_to is None  # the next level is self-managed


def test_the_last_level_demotes_nowhere():
    idx = index(100)
    (a,) = fill_up(idx, 0, 100, 1)
    assert idx.plan_room(0, 100, 100, None) == Eviction(a, 0, None)


def test_a_paged_level_asks_its_free_bytes():
    """Payload bytes under capacity are not room when the tier's pages are used up."""
    idx = index(1000)
    fill_up(idx, 0, 100, 2)
    free = {"bytes": 0}
    step = idx.plan_room(0, 100, 128, lambda: free["bytes"])
    assert isinstance(step, Eviction)
    free["bytes"] = 128
    assert idx.plan_room(0, 100, 128, lambda: free["bytes"]) is Room.FITS


def test_nothing_left_to_evict_never_fits():
    idx = index(100)
    idx[0].used = 100  # bytes the policy does not know of (e.g. a reservation)
    assert idx.plan_room(0, 50, 50, None) is Room.NEVER


def test_inserts_and_removals_are_stored_and_removed_events():
    events = EventLog()
    events.enable()
    idx = index(1000, 1000, events=events)
    idx.insert(0, key(1), 10, None)
    idx.insert(1, key(1), 10, None)
    assert idx.forget(0, key(1)) and not idx.forget(0, key(1))
    idx.learn(1, key(2), 10)  # found at start: not news
    assert events.take() == [StoreEvent("stored", key(1), "CPU"), StoreEvent("stored", key(1), "DISK"),
                             StoreEvent("removed", key(1), "CPU")]
    assert events.take() == []


def test_disabled_events_are_not_recorded_and_the_log_is_bounded():
    events = EventLog()
    idx = index(1000, events=events)
    idx.insert(0, key(1), 10, None)
    assert events.take() == []
    events.enable(maxlen=2)
    for i in range(2, 6):
        idx.insert(0, key(i), 10, None)
    assert [e.key for e in events.take()] == [key(4), key(5)]


def test_lookups_count_leading_keys_held_by_managed_levels():
    idx = index(1000, 1000, None)
    ks = [key(i) for i in range(5)]
    idx.insert(0, ks[0], 10, None)
    idx.insert(1, ks[1], 10, None)
    idx.insert(0, ks[3], 10, None)
    assert idx.leading_held(ks) == 2
    assert idx.first_holder(ks[1]) == "l1" and idx.first_holder(ks[2]) is None
    assert idx.in_top(ks) == [True, False, False, True, False]
    assert index(None).in_top(ks) == [False] * 5


def test_admission_by_chain_position():
    idx = index(1000, admission=AdmissionConfig(enabled=True, min_prefix_chunks=2))
    assert not idx.admits_new(key(1), chunk_index=0, nbytes=10)
    assert idx.admits_new(key(2), chunk_index=1, nbytes=10)


def test_reads_update_the_policy_only_for_held_keys():
    idx = index(300)
    a, b, c = fill_up(idx, 0, 100, 3)
    idx.accessed(0, key(99))  # not held: no effect, no error
    idx.missed(0, key(99))
    idx.accessed(0, a)
    assert idx.plan_room(0, 100, 100, None).key == b

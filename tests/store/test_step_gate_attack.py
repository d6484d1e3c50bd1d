"""Adversarial tests of the writers' step wait (``writer_step_wait_s``, ``TieredStore.engine_step``):
a careless operator and a hostile caller against the rules "a copy waits only while a step runs,
only while its queue is under half full, at most the wait after it was queued; nothing is dropped
for the wait; close() ends the wait". Real stores (RAM + disk under tmp_path); fakes only inject
faults (a disk put that blocks until released)."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import STEP_WAIT_ON_CPU_S, ConnectorConfig
from kvtier.server.client import ServerStore
from kvtier.store import TieredStore
from kvtier.store.base import KVStore
from kvtier.store.config import StoreConfig
from tests.store.test_step_gate import key, on_disk, store, wait_until


def small_store(tmp_path, wait, depth=64, ram=1 << 20, **extra) -> TieredStore:
    return TieredStore.from_config({
        "tiers": [{"type": "ram", "capacity": ram},
                  {"type": "disk", "path": str(tmp_path / "disk"), "capacity": 64 << 20}],
        "writer_step_wait_s": wait, "write_queue_depth": depth, **extra})


def reopened(tmp_path) -> TieredStore:
    """The same disk tier, in a store that never waits (reads come from disk)."""
    return store(tmp_path, wait=None)


class BlockingPut:
    """Fault: the disk tier's first put blocks until ``release`` is set."""

    def __init__(self, s: TieredStore):
        self.tier = s._levels[1].tier
        self.real = self.tier.put
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.tier.put = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.release.wait(20)
        return self.real(*args, **kwargs)


def spin(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


# ----------------------------------------------------------------------------- defects


def test_a_burst_during_a_step_drops_nothing(tmp_path):
    """Nothing may be dropped because of the wait: copy 0 held, 8 more make the queue (16)
    half full, 3 ms later 9 more come. The queue reaching half full wakes the held writer at
    once (it once looked every 20 ms, and a burst in between overflowed the queue)."""
    drops = []
    for attempt in range(3):
        with small_store(tmp_path / str(attempt), wait=30.0, depth=16, ram=16 << 20) as s:
            s.engine_step(True)
            assert s.put(key(0), b"\0" * 1000)
            time.sleep(0.001)  # the writer takes copy 0 and holds it
            for i in range(1, 9):
                assert s.put(key(i), bytes([i]) * 1000)
            time.sleep(0.003)  # the queue is half full: the writer may go
            for i in range(9, 18):
                assert s.put(key(i), bytes([i]) * 1000)
            drops.append(s.stats()["write_drops"])
            s.engine_step(False)
            assert s.flush(timeout=10)
            assert sum(on_disk(s, key(i)) for i in range(18)) == 18 - drops[-1]
    assert drops == [0, 0, 0], f"copies dropped per burst: {drops} (the queue filled while the writer slept)"


@pytest.mark.parametrize("write_through", [True, False])
def test_a_key_evicted_during_a_step_stays_findable(tmp_path, write_through):
    """A small RAM tier evicts during a step: no writer holds a copy while an evicted entry
    waits for its copy (the eviction wakes it), and a demotion is never held, so the keys are
    found again within moments, not after the step (once: up to the wait, 1 s on a CPU engine)."""
    with small_store(tmp_path, wait=30.0, write_through=write_through) as s:
        s.engine_step(True)
        for i in range(20):  # 2 MB into a 1 MiB RAM tier
            assert s.put(key(i), bytes([i]) * 100_000)
        deadline = time.monotonic() + 5.0  # far less than the 30 s wait: the writers did not hold them
        while sum(s.lookup([key(i)]) for i in range(20)) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = sum(s.lookup([key(i)]) for i in range(20))
        readable = sum(s.get(key(i)) == bytes([i]) * 100_000 for i in range(20))
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert all(s.get(key(i)) == bytes([i]) * 100_000 for i in range(20))  # nothing lost in the end
        assert (found, readable) == (20, 20), f"during the step: {found} found, {readable} readable of 20"


def test_close_ends_the_wait_even_if_the_engine_marks_a_step_after_it(tmp_path):
    """close() ends every wait for good: an engine thread that marks one more step after it
    (once: that shut the gate again, the writer held the next copy for the whole wait, the
    flush timed out and the copy was lost with the closed tiers) is ignored."""
    s = store(tmp_path, wait=30.0)
    fault = BlockingPut(s)
    assert s.put(key(1), b"1" * 10_000)  # no step: written at once, blocks in the tier
    assert fault.entered.wait(5)
    assert s.put(key(2), b"2" * 10_000)  # queued behind it
    closer = threading.Thread(target=s.close, kwargs={"timeout": 2.0})
    t0 = time.monotonic()
    closer.start()
    time.sleep(0.2)  # close() is flushing now
    s.engine_step(True)  # the engine's next step, racing the shutdown
    fault.release.set()
    closer.join(15)
    took = time.monotonic() - t0
    assert not closer.is_alive()
    with reopened(tmp_path) as again:
        assert again.get(key(1)) == b"1" * 10_000
        assert again.get(key(2)) == b"2" * 10_000, f"lost by close ({took:.1f} s) while a step was marked after it"


def test_step_waits_counts_only_copies_that_waited(tmp_path):
    """``step_waits``: copies held while the step ran. A copy taken when its queue is already
    half full goes at once and is not counted."""
    with store(tmp_path, wait=30.0, depth=4) as s:
        fault = BlockingPut(s)
        s.engine_step(True)
        assert s.put(key(1), b"1" * 10_000)
        time.sleep(0.1)  # the writer holds copy 1
        assert s.put(key(2), b"2" * 10_000) and s.put(key(3), b"3" * 10_000)  # half full: 1 goes
        assert fault.entered.wait(5)  # copy 1 is in the (blocked) tier
        assert s.put(key(4), b"4" * 10_000) and s.put(key(5), b"5" * 10_000)  # queue full: 2..5
        assert s.stats()["write_drops"] == 0
        fault.release.set()
        # copies 2 and 3 are taken with the queue at least half full: they go at once;
        # copy 4 finds one behind it and is held (30 s: not counted before its wait ends)
        assert wait_until(lambda: on_disk(s, key(3)), timeout=5)
        time.sleep(0.2)
        waits = s.stats()["step_waits"]
        assert not on_disk(s, key(4))  # held
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert all(on_disk(s, key(i)) for i in range(1, 6))
        assert waits == 1, f"step_waits {waits}: copies 2 and 3 went at once but were counted as waits"


# ----------------------------------------------------------------------------- probes (regressions)


def test_a_delete_wins_over_a_held_write_through_copy(tmp_path):
    with store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        assert s.put(key(1), b"x" * 50_000)
        time.sleep(0.1)  # held
        assert s.delete(key(1))
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert not s._levels[1].tier.contains(key(1))
        assert s.get(key(1)) is None and s.lookup([key(1)]) == 0
        assert s.stats()["cancelled_writes"] >= 1
    with reopened(tmp_path) as again:
        assert again.get(key(1)) is None


def test_a_delete_wins_over_a_demotion_queued_during_a_step(tmp_path):
    with small_store(tmp_path, wait=30.0, write_through=False) as s:
        s.engine_step(True)
        for i in range(15):  # some keys are evicted: their demotions (with their bytes) are queued
            assert s.put(key(i), bytes([i]) * 100_000)
        gone = [i for i, top in enumerate(s.in_top_tier([key(i) for i in range(15)])) if not top]
        assert s.stats()["demotions"] >= 1 and gone
        victim = gone[0]
        assert s.delete(key(victim))
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert not s._levels[1].tier.contains(key(victim))
        assert s.get(key(victim)) is None
        assert all(s.get(key(i)) == bytes([i]) * 100_000 for i in range(15) if i != victim)
        assert s.stats()["write_drops"] == 0
    with reopened(tmp_path) as again:
        assert again.get(key(victim)) is None


def test_a_re_put_after_delete_while_the_first_copy_is_held_ends_with_the_newest_bytes(tmp_path):
    with store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        assert s.put(key(1), b"a" * 50_000)
        time.sleep(0.1)  # held
        assert s.delete(key(1))
        assert s.put(key(1), b"b" * 50_000)
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert s.get(key(1)) == b"b" * 50_000
    with reopened(tmp_path) as again:
        assert again.get(key(1)) == b"b" * 50_000


def test_demotions_during_a_step_lose_nothing(tmp_path):
    with small_store(tmp_path, wait=30.0, write_through=False) as s:
        s.engine_step(True)
        for i in range(30):
            assert s.put(key(i), bytes([i]) * 100_000)
        assert s.stats()["write_drops"] == 0
        s.engine_step(False)
        assert s.flush(timeout=10)
        stats = s.stats()
        assert stats["write_drops"] == 0 and stats["demotions"] >= 20
        assert all(s.get(key(i)) == bytes([i]) * 100_000 for i in range(30))


def test_unbalanced_engine_step_calls_do_not_wedge_the_writers(tmp_path):
    with store(tmp_path, wait=30.0) as s:
        s.engine_step(False)  # False without True: nothing held
        assert s.put(key(1), b"1" * 10_000)
        assert wait_until(lambda: on_disk(s, key(1)), timeout=5)
        s.engine_step(True)
        s.engine_step(True)  # True twice, one False ends it
        assert s.put(key(2), b"2" * 10_000)
        time.sleep(0.1)
        assert not on_disk(s, key(2))
        s.engine_step(False)
        assert wait_until(lambda: on_disk(s, key(2)), timeout=5)


def test_engine_step_from_many_threads_then_an_end_writes_everything(tmp_path):
    with store(tmp_path, wait=30.0) as s:
        stop = threading.Event()

        def toggler(n):
            while not stop.is_set():
                s.engine_step(n % 2 == 0)

        threads = [threading.Thread(target=toggler, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        try:
            for i in range(20):
                assert s.put(key(i), bytes([i]) * 10_000)
        finally:
            stop.set()
            for t in threads:
                t.join(5)
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert all(on_disk(s, key(i)) for i in range(20))
        assert s.stats()["write_drops"] == 0


@pytest.mark.parametrize("extra", [{"writer_idle": True}, {"writer_nice": 5}])
def test_the_wait_with_a_low_priority_writer(tmp_path, extra):
    with small_store(tmp_path, wait=0.3, ram=16 << 20, **extra) as s:
        s.engine_step(True)
        t0 = time.monotonic()
        for i in range(4):
            assert s.put(key(i), bytes([i]) * 10_000)
        assert s.flush(timeout=10)
        assert 0.2 < time.monotonic() - t0 < 5
        assert all(on_disk(s, key(i)) for i in range(4))
        assert s.stats()["step_waits"] >= 1


def test_flush_during_a_step_that_never_ends_returns_within_about_the_wait(tmp_path):
    with store(tmp_path, wait=0.5) as s:
        s.engine_step(True)
        for i in range(3):
            assert s.put(key(i), bytes([i]) * 10_000)
        t0 = time.monotonic()
        assert s.flush(timeout=10)
        assert time.monotonic() - t0 < 2.0
    with store(tmp_path / "long", wait=30.0) as s:
        s.engine_step(True)
        assert s.put(key(1), b"1" * 10_000)
        t0 = time.monotonic()
        assert s.flush(timeout=0.3) is False  # a short flush gives up, it does not hang
        assert time.monotonic() - t0 < 2.0


def test_close_from_another_thread_ends_a_held_wait(tmp_path):
    s = store(tmp_path, wait=30.0)
    s.engine_step(True)
    assert s.put(key(1), b"c" * 10_000)
    time.sleep(0.1)  # held
    closer = threading.Thread(target=s.close, kwargs={"timeout": 10})
    t0 = time.monotonic()
    closer.start()
    closer.join(8)
    assert not closer.is_alive() and time.monotonic() - t0 < 3
    s.engine_step(True)  # after close: harmless
    s.engine_step(False)
    with reopened(tmp_path) as again:
        assert again.get(key(1)) == b"c" * 10_000


def test_step_counters_are_consistent_and_bounded(tmp_path):
    wait = 0.3
    with store(tmp_path, wait=wait) as s:
        assert s.stats()["step_waits"] == 0 and s.stats()["step_wait_seconds"] == 0
        s.engine_step(True)
        for i in range(5):
            assert s.put(key(i), bytes([i]) * 10_000)
        assert s.flush(timeout=10)
        stats = s.stats()
        assert 1 <= stats["step_waits"] <= 5
        assert 0 <= stats["step_wait_seconds"] <= stats["step_waits"] * (wait + 0.2)
        s.engine_step(False)
        before = s.stats()
        assert s.put(key(9), b"9" * 10_000) and s.flush(timeout=10)
        after = s.stats()  # no step: no wait counted
        assert after["step_waits"] == before["step_waits"]
        assert after["step_wait_seconds"] == before["step_wait_seconds"]


def test_a_queue_of_one_waits_and_drops_nothing(tmp_path):
    with store(tmp_path, wait=30.0, depth=1) as s:
        s.engine_step(True)
        assert s.put(key(1), b"1" * 10_000)
        time.sleep(0.1)
        assert not on_disk(s, key(1))  # held: the queue (0 of 1) is under half full
        assert s.put(key(2), b"2" * 10_000)  # 1 of 1: the held copy goes
        assert wait_until(lambda: on_disk(s, key(1)), timeout=5)
        for i in range(3, 8):
            assert wait_until(lambda: s.stats()["tiers"][1]["queue_depth"] == 0, timeout=5)
            assert s.put(key(i), bytes([i]) * 10_000)
        assert s.stats()["write_drops"] == 0
        s.engine_step(False)
        assert s.flush(timeout=10)
        assert all(on_disk(s, key(i)) for i in range(1, 8))


@pytest.mark.parametrize("bad", [-1, -1e-9, 60.001, float("nan"), float("inf"), float("-inf"), True, False,
                                 "soon", [1], {"s": 1}])
def test_bad_waits_are_refused_at_every_edge(tmp_path, bad):
    with pytest.raises(ConfigError, match="writer_step_wait_s"):
        ConnectorConfig.from_extra_config({"writer_step_wait_s": bad})
    with pytest.raises(ConfigError, match="writer_step_wait_s"):
        StoreConfig(writer_step_wait_s=bad)
    with pytest.raises(ConfigError, match="writer_step_wait_s"):
        TieredStore.from_config({"tiers": [{"type": "ram", "capacity": 1 << 20}], "writer_step_wait_s": bad})


@pytest.mark.parametrize("good, resolved_on_cpu", [(None, STEP_WAIT_ON_CPU_S), (0, 0), (0.0, 0), (60, 60),
                                                   (1e-9, 1e-9)])
def test_edge_waits_are_kept(good, resolved_on_cpu):
    config = ConnectorConfig.from_extra_config({"writer_step_wait_s": good})
    assert config.with_step_wait(True).store.writer_step_wait_s == resolved_on_cpu
    assert config.with_step_wait(False).store.writer_step_wait_s == (0 if good is None else good)
    assert StoreConfig(writer_step_wait_s=good).writer_step_wait_s == good


def test_a_store_without_its_own_engine_step_has_the_no_op():
    assert ServerStore.engine_step is KVStore.engine_step
    bare = object.__new__(ServerStore)  # never connected: the default touches nothing
    assert bare.engine_step(True) is None and bare.engine_step(False) is None


def test_prefetch_and_lower_tier_reads_work_during_a_step(tmp_path):
    with store(tmp_path, wait=None) as s:
        for i in range(6):
            assert s.put(key(i), bytes([i]) * 20_000)
        assert s.flush(timeout=10)
    with store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        assert s.lookup([key(i) for i in range(6)]) == 6
        assert s.prefetch([key(i) for i in range(3)])
        assert wait_until(lambda: all(s.in_top_tier([key(i) for i in range(3)])), timeout=5)
        assert s.get(key(4)) == bytes([4]) * 20_000  # from disk, during the step
        assert s.get(key(0)) == bytes([0]) * 20_000
        s.engine_step(False)
        assert s.flush(timeout=10) and s.stats()["write_drops"] == 0

"""Lower-tier writers that yield to the engine's step (``writer_step_wait_s``): a copy queued
while a step runs is written when the step ends, or after the wait, or at once when its queue is
half full; nothing is dropped for it; the connector resolves the default from the platform and
its worker marks every step, also one whose save fails."""

from __future__ import annotations

import time

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import STEP_WAIT_ON_CPU_S, ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierMetadata, SaveSpec
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import WorkerShare
from kvtier.store import TieredStore
from tests.integration.test_connector_worker import GEOMETRY, _kv_caches, _keys


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def store(tmp_path, wait: float | None, depth: int = 64) -> TieredStore:
    return TieredStore.from_config({
        "tiers": [{"type": "ram", "capacity": 16 << 20},
                  {"type": "disk", "path": str(tmp_path / "disk"), "capacity": 64 << 20}],
        "writer_step_wait_s": wait, "write_queue_depth": depth})


def on_disk(s: TieredStore, k: bytes) -> bool:
    return s.stats()["tiers"][1]["entries"] > 0 and s._levels[1].tier.contains(k)


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def long_step(s: TieredStore, seconds: float) -> None:
    """Record one engine step of ``seconds`` on ``s``'s step gate without sitting it out: the
    gate's clock moves by ``seconds`` between the step's start and its end."""
    gate = s._step_gate
    real, now = gate._clock, [gate._clock()]
    gate._clock = lambda: now[0]
    try:
        s.engine_step(True)
        now[0] += seconds
        s.engine_step(False)
    finally:
        gate._clock = real


def test_a_copy_queued_during_a_step_is_written_when_the_step_ends(tmp_path):
    with store(tmp_path, wait=30.0) as s:
        s.engine_step(True)
        assert s.put(key(1), b"a" * 100_000)
        time.sleep(0.3)
        assert not on_disk(s, key(1))  # held while the step runs
        assert s.get(key(1)) == b"a" * 100_000  # the top tier serves it meanwhile
        s.engine_step(False)
        assert wait_until(lambda: on_disk(s, key(1)))
        stats = s.stats()
        assert stats["step_waits"] == 1 and 0.2 < stats["step_wait_seconds"] < 30
        assert stats["write_drops"] == 0


def test_a_step_that_never_ends_holds_each_copy_at_most_the_wait_from_its_queueing(tmp_path):
    with store(tmp_path, wait=0.4) as s:
        s.engine_step(True)
        t0 = time.monotonic()
        for i in range(5):
            assert s.put(key(i), bytes([i]) * 50_000)
        assert s.flush(timeout=10)
        took = time.monotonic() - t0
        assert all(on_disk(s, key(i)) for i in range(5))
        # copies queued together wait together: about one wait, not one per copy
        assert 0.3 < took < 1.6, took
        assert s.stats()["write_drops"] == 0


def test_after_long_steps_a_copy_is_held_through_the_next_one_as_long(tmp_path):
    """A prefill step that runs for seconds (a KV-heavy model on a CPU engine): a copy queued
    after one is held through the next step of the same length, not written during it once the
    configured wait has passed; the stretched hold still ends (a step that never ends)."""
    with store(tmp_path, wait=0.2) as s:
        long_step(s, 0.6)  # one long step, nothing queued
        s.engine_step(True)  # the next, as long
        assert s.put(key(1), b"b" * 50_000)
        time.sleep(0.5)  # past the 0.2 s wait, within twice the last step (1.2 s)
        assert not on_disk(s, key(1))
        s.engine_step(False)
        assert wait_until(lambda: on_disk(s, key(1)))
        s.engine_step(True)  # a step that never ends: the hold (twice the longest step) runs out
        t0 = time.monotonic()
        assert s.put(key(2), b"c" * 50_000)
        assert wait_until(lambda: on_disk(s, key(2)), timeout=5)
        assert 0.9 < time.monotonic() - t0 < 3.0
        assert s.stats()["write_drops"] == 0


def test_the_hold_is_the_floor_or_twice_the_longest_recent_step_up_to_its_cap():
    from kvtier.store.writeback import HOLD_MAX_S, StepGate

    clock = [100.0]
    gate = StepGate(clock=lambda: clock[0])
    assert gate.hold_s(1.0) == 1.0  # no step yet: the floor
    for length in (0.1, 3.0, 0.2):
        gate.step(True)
        clock[0] += length
        gate.step(False)
    assert gate.hold_s(1.0) == 6.0 and gate.hold_s(10.0) == 10.0
    gate.step(False)  # an end without a start records nothing
    gate.step(True)
    gate.step(True)  # nor does a second start move the first
    clock[0] += 100.0
    gate.step(False)
    assert gate.hold_s(1.0) == HOLD_MAX_S and gate.hold_s(45.0) == 45.0  # capped; a larger floor stands
    for _ in range(StepGate.RECENT):  # the long steps age out
        gate.step(True)
        clock[0] += 0.1
        gate.step(False)
    assert gate.hold_s(1.0) == 1.0


def test_a_queue_half_full_writes_at_once_and_drops_nothing(tmp_path):
    with store(tmp_path, wait=30.0, depth=4) as s:
        s.engine_step(True)
        for i in range(12):  # three times the queue: without the half-full rule these would drop
            assert s.put(key(i), bytes([i]) * 50_000)
            time.sleep(0.02)
        assert s.stats()["write_drops"] == 0
        # all but what the (half-full) queue and the copy in hand hold, while the step still runs
        assert wait_until(lambda: sum(on_disk(s, key(i)) for i in range(12)) >= 12 - 4)
        s.engine_step(False)
        assert s.flush(timeout=20)
        assert all(on_disk(s, key(i)) for i in range(12))
        assert s.stats()["write_drops"] == 0


def test_without_a_wait_a_step_holds_nothing(tmp_path):
    for wait in (None, 0.0):
        with store(tmp_path / str(wait), wait=wait) as s:
            s.engine_step(True)
            assert s.put(key(1), b"z" * 10_000)
            assert wait_until(lambda: on_disk(s, key(1)), timeout=5)
            assert s.stats()["step_waits"] == 0


def test_close_during_a_step_writes_what_is_queued(tmp_path):
    s = store(tmp_path, wait=30.0)
    s.engine_step(True)
    assert s.put(key(1), b"c" * 10_000)
    t0 = time.monotonic()
    s.close(timeout=10)
    assert time.monotonic() - t0 < 5
    with store(tmp_path, wait=None) as again:
        assert again.get(key(1)) == b"c" * 10_000  # from the disk tier, written by the close


def test_the_wait_is_a_validated_store_key():
    with pytest.raises(ConfigError, match="writer_step_wait_s"):
        ConnectorConfig.from_extra_config({"writer_step_wait_s": -1})
    with pytest.raises(ConfigError, match="writer_step_wait_s"):
        ConnectorConfig.from_extra_config({"writer_step_wait_s": 1e9})


def test_the_connector_resolves_the_default_from_the_platform_and_keeps_a_given_value():
    default = ConnectorConfig.from_extra_config({})
    assert default.store.writer_step_wait_s is None
    assert default.with_step_wait(True).store.writer_step_wait_s == STEP_WAIT_ON_CPU_S
    assert default.with_step_wait(False).store.writer_step_wait_s == 0.0
    given = ConnectorConfig.from_extra_config({"writer_step_wait_s": 0.25})
    assert given.with_step_wait(True).store.writer_step_wait_s == 0.25
    off = ConnectorConfig.from_extra_config({"writer_step_wait_s": 0})
    assert off.with_step_wait(True).store.writer_step_wait_s == 0


def test_the_worker_marks_every_step_even_one_whose_save_fails(tmp_path, monkeypatch):
    config = ConnectorConfig.from_extra_config({
        "tiers": [{"type": "ram", "capacity": "4MiB"}, {"type": "disk", "path": str(tmp_path / "d")}],
    }).with_step_wait(True)
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    try:
        worker.register_kv_caches(_kv_caches(0))
        gate = worker.store._step_gate
        assert not gate.running()
        worker.begin_step()  # the connector binds a step's metadata: its forward pass is next
        assert gate.running()
        keys = _keys(2)
        saves = [SaveSpec("r", k, keys[c - 1] if c else None, c, [2 * c, 2 * c + 1]) for c, k in enumerate(keys)]
        worker.wait_for_save(KVTierMetadata(saves=saves))
        assert not gate.running()
        assert worker.store.flush(timeout=10) and worker.store.stats()["tiers"][1]["entries"] == 2

        def broken(*args, **kwargs):  # a fake only to inject the fault: a save that raises
            raise RuntimeError("save failed")

        monkeypatch.setattr(worker, "_save_inline", broken)
        worker.begin_step()
        with pytest.raises(RuntimeError):
            worker.wait_for_save(KVTierMetadata(saves=[SaveSpec("r", _keys(3)[2], keys[1], 2, [4, 5])]))
        assert not gate.running()  # the step is over for the writers all the same
    finally:
        worker.close()

"""kvtier.affinity: a background thread started from an engine thread bound to one core (as
vLLM's CPU worker binds its main thread) runs on every core the process's threads run on."""

import os
import threading
import time

import pytest

from kvtier.affinity import process_cores, spread_thread
from kvtier.store.index import Counters
from kvtier.store.ledger import CopyLedger
from kvtier.store.writeback import Copy, Lane, WriteBack
from kvtier.tiers.base import TierStats

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs per-thread CPU affinity and two cores")


def _bound_thread(core: int, body):
    """Run ``body()`` on a new thread bound to ``core`` (as an engine binds its main thread);
    its result, or its exception raised here."""
    out = {}

    def run():
        try:
            os.sched_setaffinity(0, {core})
            out["value"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_process_cores_is_the_union_of_every_threads_affinity():
    everything = os.sched_getaffinity(0)
    assert process_cores() == everything
    core = min(everything)
    assert _bound_thread(core, process_cores) == everything  # the other threads still span them all


def test_a_thread_started_from_a_one_core_thread_is_spread_over_the_process_cores():
    everything = os.sched_getaffinity(0)
    core = min(everything)

    def start_child():
        seen = {}

        def child():
            seen["inherited"] = os.sched_getaffinity(0)
            seen["spread"] = spread_thread()
            seen["after"] = os.sched_getaffinity(0)

        t = threading.Thread(target=child)
        t.start()
        t.join(30)
        return seen, os.sched_getaffinity(0)

    seen, parent_after = _bound_thread(core, start_child)
    assert seen["inherited"] == {core}  # what every kvtier thread got before
    assert seen["spread"] is True and seen["after"] == everything
    assert parent_after == {core}  # the engine's own thread keeps its binding


def test_the_store_writer_threads_run_on_every_core():
    """A store built on an engine's bound thread: its lower-tier writer is not held to that core."""
    everything = os.sched_getaffinity(0)
    core = min(everything)
    seen = []
    done = threading.Event()
    lock = threading.RLock()

    def apply(i, copy):
        seen.append(os.sched_getaffinity(0))
        done.set()

    def build():
        return WriteBack([None, Lane("lower", TierStats())], 4, lock, CopyLedger(), Counters(), apply)

    wb = _bound_thread(core, build)
    try:
        with lock:
            wb._queues[1].put_nowait(Copy(b"k" * 32, None, b"x", 0))
        assert done.wait(10)
        assert seen == [everything]
    finally:
        wb.flush(5)
        wb.stop(time.monotonic() + 5)


def test_spread_thread_never_raises_where_affinity_cannot_be_read(monkeypatch):
    monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(PermissionError(13, "denied")))
    assert process_cores() is None and spread_thread() is False

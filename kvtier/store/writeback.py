"""The store's background data movement: bounded queues and one writer thread per lower
level, and a bounded prefetch worker. Threads and queues only: what each copy may do is the
``CopyLedger``'s (``ledger.py``) and the store's to decide.

Copies to lower levels are *write-through* copies of a new top-level entry (queued without
bytes when the top level is an arena: the writer reads its pages when it runs, or, when the
entry was evicted first, its ``Orphan``'s pinned pages; with their bytes otherwise) and
*demotions* of an evicted entry (queued with a copy of their bytes). A full queue drops the copy
and counts it: the caller never waits. Every queued copy is registered in the ledger
(its delete generation travels with it) and released there when it is done or dropped.

Thread-safety: the queueing methods are called with the store's lock held (the ledger is
guarded by it); ``flush``, ``stop`` and the worker threads take it themselves, and only around
ledger calls. Imports: ``kvtier.buffers``, ``kvtier.keys``, ``kvtier.tiers.base`` (TierStats),
``kvtier.store.index`` (Counters), ``kvtier.store.ledger``.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from contextlib import ExitStack
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.buffers import gather_into
from kvtier.keys import Key
from kvtier.store.index import Counters
from kvtier.store.ledger import CopyLedger
from kvtier.tiers.base import TierStats

log = logging.getLogger(__name__)

_STOP = object()


class DetachedBytes:
    """Bytes of orphans copied out of the top tier's arena (``Orphan.detach``) and not yet let
    go of: memory the store holds beyond the top tier's capacity. Changed under the store
    lock; read without it (an int)."""

    __slots__ = ("total",)

    def __init__(self):
        self.total = 0


class Orphan:
    """The arena pages of a top entry evicted while write-through copies of it were still queued,
    kept pinned (not copied) until the ledger lets go of them and no copy reads them any more.
    Every method runs under the store lock."""

    __slots__ = ("_pin", "_views", "_refs", "_pinned", "_readable", "_detached", "_own", "nbytes")

    def __init__(self, pin: ExitStack, views: Any, nbytes: int, detached: DetachedBytes):
        """``nbytes``: the entry's raw length (what a ``detach`` copies; its pages, rounded up,
        are the most a detach can give back to the arena); ``detached``: the store's tally of
        copied-out orphans, which a ``detach`` adds to until the last reference goes."""
        self._pin, self._views, self._refs = pin, views, 1  # the ledger's reference
        self._pinned = True  # until the last reference goes or a detach copies the pages out
        self._readable = True  # until a detach found that they do not read back
        self._detached, self._own = detached, 0  # bytes of its own copy, counted in ``detached``
        self.nbytes = nbytes

    @property
    def detachable(self) -> bool:
        """Whether ``detach`` would copy the pages out now: they are still pinned (not detached
        before: a detached orphan is never copied again), no copy reads them, and no detach
        found them unreadable before (a coded entry is decoded, and counted corrupt, once)."""
        return self._pinned and self._readable and self._refs == 1

    def hold(self) -> Any:
        """The pinned pages, for a copy that reads them until it calls ``drop``."""
        self._refs += 1
        return self._views

    def drop(self) -> None:
        """Let go of one reference (the ledger's or a copy's); the last unpins the pages."""
        self._refs -= 1
        if self._refs == 0:
            self._pinned = False
            self._pin.close()
            self._detached.total -= self._own
            self._own, self._views = 0, None

    def detach(self) -> bool:
        """Copy the pages into a buffer of the orphan's own and unpin them, so the arena can
        free them (when the top tier needs the room: ``TieredStore._make_room_top``); False
        when a copy reads them now, or they are not pinned any more, or they do not read
        back (a coded entry that does not decode: a copy would fail the same way). Copies at
        most once: a detached orphan answers False, its own buffer stays as it is."""
        if not self.detachable:
            return False
        try:
            segments = list(self._views)  # a coded arena's entry decodes here
            own = np.empty(sum(int(seg.nbytes) for seg in segments), dtype=np.uint8)
            gather_into(segments, own)
        except Exception:
            self._readable = False
            return False
        self._views = [own]
        self._pinned = False
        self._pin.close()
        self._own = own.nbytes
        self._detached.total += self._own
        return True


def release_orphan(orphan: object | None) -> None:
    """Drop the reference the ledger held to ``orphan`` (None: nothing was let go of)."""
    if orphan is not None:
        orphan.drop()


@dataclass(frozen=True)
class Copy:
    """One copy of ``key`` for a lower level: ``data`` is the entry's bytes in a buffer of its
    own (a demotion, or a write-through copy from a top level without an arena) or None (a
    write-through copy, read from the top level when it runs); ``gen`` is the key's delete
    generation when the copy was registered in the ledger; ``queued``: when it was queued
    (monotonic seconds)."""

    key: Key
    parent: Key | None
    data: "bytes | np.ndarray | None"
    gen: int
    queued: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Lane:
    """A lower level as the writer sees it: its name (for threads and logs) and its counters."""

    name: str
    stats: TierStats


# Carries one copy out into level ``i`` (the store's code: room-making, the tier's put).
ApplyCopy = Callable[[int, Copy], None]


def lower_priority(nice: int) -> bool:
    """Make the calling thread ``nice`` steps nicer (at most 19), best effort: Linux sets a
    thread's niceness by its native id, other systems have no per-thread niceness and are left
    as they are. True when it took effect. Raising niceness needs no privilege."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True


def run_when_idle() -> bool:
    """Put the calling thread under Linux's ``SCHED_IDLE`` policy (it runs only on a core no
    other thread wants), best effort: other systems have no such policy and are left as they
    are. True when it took effect. Needs no privilege; threads it starts inherit it (Linux resets
    only real-time policies on ``SCHED_RESET_ON_FORK``), so a tier starts its pools up front."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


HOLD_MAX_S = 30.0  # the longest a copy waits behind the engine's steps, whatever their length


class StepGate:
    """Whether the engine's step (its forward pass) is running, for writers that wait for its
    end: set by the engine's thread (``step``), waited on by the writers (``wait``), woken early
    by the store (``wake``) when something a waiting writer weighs has changed. Thread-safe."""

    RECENT = 8  # steps whose durations ``hold_s`` weighs

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        """``clock``: seconds, monotonic (the steps' durations are measured with it)."""
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._running = False
        self._closed = False
        self._started = 0.0  # monotonic time the running step started
        self._recent: deque[float] = deque(maxlen=self.RECENT)  # the last steps' durations, seconds

    def step(self, running: bool) -> None:
        """A step starts (True) or ends (False); after ``close`` a start is ignored. The end of
        a step that started records its duration."""
        with self._cond:
            now = self._clock()
            if self._running and not running:
                self._recent.append(now - self._started)
            elif running and not self._running:
                self._started = now
            self._running = running and not self._closed
            if not self._running:
                self._cond.notify_all()

    def hold_s(self, floor: float) -> float:
        """How long a writer may hold a copy queued behind the engine's steps: ``floor``, or
        twice the longest of the last ``RECENT`` steps where that is longer (a prefill step of a
        KV-heavy model on a CPU engine runs for seconds, and copies queued after one step would
        otherwise be written during the next), at most ``HOLD_MAX_S``."""
        with self._cond:
            longest = max(self._recent, default=0.0)
        return min(max(floor, 2.0 * longest), max(floor, HOLD_MAX_S))

    def close(self) -> None:
        """No step runs from now on (the store is closing): every wait ends."""
        with self._cond:
            self._closed, self._running = True, False
            self._cond.notify_all()

    def wake(self) -> None:
        """Make waiting writers look at their reasons to stop waiting again."""
        with self._cond:
            self._cond.notify_all()

    def running(self) -> bool:
        """Whether a step is running now."""
        return self._running

    def wait(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait while a step runs and ``done()`` is false, for at most ``timeout`` seconds
        (``done`` is asked under the gate's own lock: it must not take the store's)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running or done(), timeout)


class WriteBack:
    """Queues and writer threads for levels 1.. of a store."""

    def __init__(self, lanes: Sequence[Lane | None], depth: int, lock: threading.RLock, ledger: CopyLedger,
                 counters: Counters, apply: ApplyCopy, nice: int = 0, idle: bool = False,
                 gate: StepGate | None = None, step_wait_s: float = 0.0,
                 may_hold: Callable[[Key], bool] = lambda key: False):
        """``lanes[i]`` describes level ``i`` (``lanes[0]``, the top level, is None); the writer
        threads run ``nice`` steps nicer than the thread that starts them (see ``lower_priority``),
        or with ``idle`` under ``SCHED_IDLE`` (``run_when_idle``). With ``gate`` and
        ``step_wait_s`` > 0 a writer holds a write-through copy while the engine's step runs
        and ``may_hold(key)`` says yes (asked without the store's lock: the top level still
        serves the key, or its orphan does; ``_wait_for_step``). ``ledger``
        and ``counters`` are guarded by ``lock``."""
        self._gate = gate if step_wait_s > 0 else None
        self._step_wait_s = step_wait_s
        self._may_hold = may_hold
        self._nice = nice
        self._idle = idle
        self._lock = lock
        self._ledger = ledger
        self._counters = counters
        self._apply = apply
        self._lanes = list(lanes)
        self._queues: list[queue.Queue | None] = [None] * len(self._lanes)
        self._workers: list[threading.Thread | None] = [None] * len(self._lanes)
        for i, lane in enumerate(self._lanes):
            if lane is None:
                continue
            self._queues[i] = queue.Queue(maxsize=depth)
            worker = threading.Thread(target=self._writer, args=(i,), name=f"kvtier-writer-{lane.name}", daemon=True)
            self._workers[i] = worker
            worker.start()

    # ----------------------------------------------------------------------------- queueing (lock held)

    def queue_write_through(self, i: int, key: Key, parent: Key | None, data: bytes | None = None) -> bool:
        """Queue a write-through copy of a new top entry for level ``i`` (``data``: its bytes,
        or None to read the top level when it runs); False (counted) when the queue is full."""
        gen = self._ledger.begin_write_through(key) if data is None else self._ledger.begin_copy(key)
        try:
            self._queues[i].put_nowait(Copy(key, parent, data, gen))
            self._queued(i)
            return True
        except queue.Full:
            if data is None:
                release_orphan(self._ledger.read_top(key))
            self._drop(i, key)
            return False

    def queue_demotion(self, i: int, key: Key, parent: Key | None, data: "bytes | np.ndarray", gen: int) -> bool:
        """Queue an evicted entry's bytes for level ``i`` (counted as a demotion). The copy was
        registered (``CopyLedger.begin_copy``) when the eviction was decided, under ``gen``;
        False (counted as a drop, the registration released) when the queue is full."""
        try:
            self._queues[i].put_nowait(Copy(key, parent, data, gen))
        except queue.Full:
            self._drop(i, key)
            return False
        self._queued(i)
        self._counters.demotions += 1
        return True

    def _drop(self, i: int, key: Key) -> None:
        self._ledger.end_copy(key)
        self._lanes[i].stats.add(dropped=1)
        self._counters.write_drops += 1

    # ----------------------------------------------------------------------------- threads

    def depth(self, i: int) -> int:
        """Copies queued for level ``i`` now (0 for the top level)."""
        q = self._queues[i]
        return q.qsize() if q is not None else 0

    def _writer(self, i: int) -> None:
        """Worker of level ``i``: carries queued copies out until told to stop."""
        q, lane = self._queues[i], self._lanes[i]
        try:
            if self._idle and not run_when_idle():
                log.warning("kvtier: the %s writer runs at the store's priority (writer_idle not applied)",
                            lane.name)
            if self._nice > 0 and not lower_priority(self._nice):
                log.warning("kvtier: the %s writer runs at the store's priority (writer_nice not applied)",
                            lane.name)
        except Exception:  # the writer runs on at the process's priority rather than not at all
            log.exception("kvtier: could not lower the priority of the %s writer", lane.name)
        while True:
            item = q.get()
            if item is _STOP:
                q.task_done()
                return
            try:
                if self._gate is not None:
                    self._wait_for_step(q, item)
                self._apply(i, item)
            except Exception:  # never let one bad write kill the worker
                log.exception("kvtier: write to tier %s failed", lane.name)
                lane.stats.add(errors=1)
            finally:
                with self._lock:
                    self._ledger.end_copy(item.key)
                q.task_done()

    def _wait_for_step(self, q: queue.Queue, item: Copy) -> None:
        """Hold ``item`` while the engine's step runs, until the step ends or one of these:
        its queue is half full (``_queued`` wakes the writer: a copy never waits at the price of
        a later one being dropped); it is a demotion, or ``may_hold`` says no (the top level
        serves the key no more, not even from an orphan: it was deleted, or its pages were gone
        at its eviction); or the hold has passed since it was queued (``StepGate.hold_s``:
        ``step_wait_s``, or twice the longest recent step where that is longer; a step that never
        ends, or steps back to back, cannot starve the tier, and copies queued together wait
        together). Counted when it waited: how many copies, and for how long in all."""
        def done() -> bool:
            return 2 * q.qsize() >= q.maxsize or item.data is not None or not self._may_hold(item.key)

        if not self._gate.running() or done():
            return
        start = time.monotonic()
        left = item.queued + self._gate.hold_s(self._step_wait_s) - start
        if left <= 0:
            return
        self._gate.wait(done, left)
        with self._lock:
            self._counters.step_waits += 1
            self._counters.step_wait_seconds += time.monotonic() - start

    def _queued(self, i: int) -> None:
        """After a copy joined level ``i``'s queue: a half-full queue wakes its waiting writer."""
        q = self._queues[i]
        if self._gate is not None and 2 * q.qsize() >= q.maxsize:
            self._gate.wake()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued copy is done; False on timeout."""
        deadline = time.monotonic() + timeout
        for q in self._queues:
            if q is None:
                continue
            while q.unfinished_tasks:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        return True

    def stop(self, deadline: float) -> None:
        """Drop (and count) what is still queued, stop the workers and wait for them until
        ``deadline`` (a monotonic instant). Call after ``flush``."""
        for i, q in enumerate(self._queues):
            if q is None:
                continue
            self._drop_queued(i)
            try:  # a full queue here means a worker still demotes into it: do not wait forever
                q.put(_STOP, timeout=max(0.1, deadline - time.monotonic()))
            except queue.Full:
                log.warning("kvtier: writer for tier %s did not stop", self._lanes[i].name)
        for worker in self._workers:
            if worker is not None:
                worker.join(timeout=max(0.1, deadline - time.monotonic()))

    def _drop_queued(self, i: int) -> None:
        """Drop (and count) the copies still queued for level ``i``."""
        q = self._queues[i]
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                with self._lock:
                    if item.data is None:
                        release_orphan(self._ledger.read_top(item.key))
                    self._ledger.end_copy(item.key)
                    self._counters.write_drops += 1
                self._lanes[i].stats.add(dropped=1)
            q.task_done()


class Prefetcher:
    """One background thread that runs ``fetch(keys)`` for submitted key lists, through a
    bounded queue: a full queue drops the request (the caller never waits, never starts a
    thread per call). The thread starts on the first request."""

    def __init__(self, depth: int, fetch: Callable[[list[Key]], None]):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._fetch = fetch
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, keys: list[Key]) -> bool:
        """Queue ``keys`` for fetching; False when the queue is full (dropped)."""
        self._ensure_thread()
        try:
            self._queue.put_nowait(keys)
            return True
        except queue.Full:
            return False

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            keys = self._queue.get()
            if keys is _STOP:
                return
            try:
                self._fetch(keys)
            except Exception:  # a failed prefetch is only a later miss
                log.exception("kvtier: prefetch failed")

    def stop(self, deadline: float) -> None:
        """Drop queued requests and stop the thread (waiting until ``deadline`` at most)."""
        with self._start_lock:
            thread = self._thread
        if thread is None:
            return
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put(_STOP, timeout=max(0.1, deadline - time.monotonic()))
        except queue.Full:
            return
        thread.join(timeout=max(0.1, deadline - time.monotonic()))

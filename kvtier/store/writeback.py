"""The store's background data movement: bounded queues and one writer thread per lower
level, the bookkeeping of copies under way, and a bounded prefetch worker.

Copies to lower levels are *write-through* copies of a new top-level entry (queued without
bytes: the writer snapshots the top level when it runs) and *demotions* of an evicted entry
(queued with their bytes). A full queue drops the copy and counts it: the caller never waits.

``delete`` wins over every copy already queued or running: each copy carries its key's delete
generation (``tombstone`` count) from when it was queued; the code that carries a copy out asks
``deleted_since`` before and after its put. Tombstones live only while copies of the key are
pending, so they never pile up.

Thread-safety: the bookkeeping methods are called with the store's lock held (one lock for the
index and this, as the copies into the top tier are memcpys); ``flush``, ``stop`` and the
worker threads take it themselves. Imports: ``kvtier.keys``, ``kvtier.tiers.base`` (TierStats),
``kvtier.store.index`` (Counters).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.keys import Key
from kvtier.store.index import Counters
from kvtier.tiers.base import TierStats

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class Copy:
    """One copy of ``key`` for a lower level: ``data`` is the entry's bytes (a demotion) or
    None (a write-through copy, read from the top level when it runs); ``gen`` is the key's
    delete generation when it was queued."""

    key: Key
    parent: Key | None
    data: bytes | None
    gen: int


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


class WriteBack:
    """Queues, writer threads and in-flight bookkeeping for levels 1.. of a store."""

    def __init__(self, lanes: Sequence[Lane | None], depth: int, lock: threading.RLock, counters: Counters,
                 apply: ApplyCopy, nice: int = 0):
        """``lanes[i]`` describes level ``i`` (``lanes[0]``, the top level, is None); the writer
        threads run ``nice`` steps nicer than the thread that starts them (see ``lower_priority``)."""
        self._nice = nice
        self._lock = lock
        self._counters = counters
        self._apply = apply
        self._lanes = list(lanes)
        self._queues: list[queue.Queue | None] = [None] * len(self._lanes)
        self._workers: list[threading.Thread | None] = [None] * len(self._lanes)
        self._orphans: dict[Key, bytes] = {}  # bytes of top entries evicted before their lower writes ran
        self._queued: dict[Key, int] = {}  # key -> lower writes still to read from the top level
        self._in_flight: dict[Key, int] = {}  # key -> lower writes that have their bytes, not yet landed
        self._pending: dict[Key, int] = {}  # key -> lower copies queued or running (any level)
        self._tombs: dict[Key, int] = {}  # key -> delete generation, kept while copies are pending
        self._delete_seq = 0  # deletes so far: a promotion that saw one meanwhile is skipped
        for i, lane in enumerate(self._lanes):
            if lane is None:
                continue
            self._queues[i] = queue.Queue(maxsize=depth)
            worker = threading.Thread(target=self._writer, args=(i,), name=f"kvtier-writer-{lane.name}", daemon=True)
            self._workers[i] = worker
            worker.start()

    # ----------------------------------------------------------------------------- queueing (lock held)

    def queue_write_through(self, i: int, key: Key, parent: Key | None) -> bool:
        """Queue a write-through copy of a new top entry for level ``i``; False (counted) when
        the queue is full."""
        self._queued[key] = self._queued.get(key, 0) + 1
        gen = self._add_pending(key)
        try:
            self._queues[i].put_nowait(Copy(key, parent, None, gen))
            return True
        except queue.Full:
            self.release_queued(key)
            self._drop(i, key)
            return False

    def queue_demotion(self, i: int, key: Key, parent: Key | None, data: bytes) -> bool:
        """Queue an evicted entry's bytes for level ``i`` (counted as a demotion); False
        (counted as a drop) when the queue is full."""
        gen = self._add_pending(key)
        try:
            self._queues[i].put_nowait(Copy(key, parent, data, gen))
        except queue.Full:
            self._drop(i, key)
            return False
        self._counters.demotions += 1
        return True

    def _drop(self, i: int, key: Key) -> None:
        self._release_pending(key)
        self._lanes[i].stats.add(dropped=1)
        self._counters.write_drops += 1

    # ----------------------------------------------------------------------------- in-flight state (lock held)

    def is_queued(self, key: Key) -> bool:
        """Whether a write-through copy of ``key`` has yet to read the top level."""
        return bool(self._queued.get(key))

    def is_in_flight(self, key: Key) -> bool:
        """Whether a write-through copy of ``key`` has its bytes and has not landed yet."""
        return bool(self._in_flight.get(key))

    def orphan(self, key: Key) -> bytes | None:
        """The kept bytes of a top entry evicted before its write-through copies read it."""
        return self._orphans.get(key)

    def keep_orphan(self, key: Key, data: bytes) -> None:
        """Keep an evicted top entry's bytes for the write-through copies still queued."""
        self._orphans[key] = data

    def release_queued(self, key: Key) -> None:
        """One write-through copy of ``key`` has read (or given up on) the top level; the
        orphan bytes go with the last one."""
        n = self._queued.get(key, 0) - 1
        if n <= 0:
            self._queued.pop(key, None)
            self._orphans.pop(key, None)
        else:
            self._queued[key] = n

    def begin_in_flight(self, key: Key) -> None:
        """A write-through copy of ``key`` holds its bytes: an eviction must not demote it too."""
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def end_in_flight(self, key: Key) -> None:
        """That copy landed, failed or was cancelled."""
        n = self._in_flight.pop(key) - 1
        if n:
            self._in_flight[key] = n

    def deleted_since(self, key: Key, gen: int) -> bool:
        """Whether ``key`` was deleted after a copy carrying generation ``gen`` was queued."""
        return self._tombs.get(key, 0) != gen

    def note_delete(self, key: Key) -> None:
        """A delete of ``key``: queued or running copies see it and yield; its orphan bytes go."""
        self._delete_seq += 1
        if key in self._pending:
            self._tombs[key] = self._tombs.get(key, 0) + 1
        self._orphans.pop(key, None)  # a pending write-through must not bring it back

    @property
    def delete_seq(self) -> int:
        """Deletes so far (a read that saw another count meanwhile must not promote)."""
        return self._delete_seq

    def idle(self) -> bool:
        """Whether no copy is pending and no bytes are kept (for tests and checks)."""
        return not (self._pending or self._tombs or self._queued or self._in_flight or self._orphans)

    def _add_pending(self, key: Key) -> int:
        """Count one more lower copy of ``key``; return the key's delete generation, which the
        copy carries so that a later delete wins over it."""
        self._pending[key] = self._pending.get(key, 0) + 1
        return self._tombs.get(key, 0)

    def _release_pending(self, key: Key) -> None:
        """One lower copy of ``key`` is done, dropped or skipped; the key's tombstone goes with
        its last pending copy, so tombstones never outlive the copies they guard."""
        n = self._pending.get(key, 0) - 1
        if n <= 0:
            self._pending.pop(key, None)
            self._tombs.pop(key, None)
        else:
            self._pending[key] = n

    # ----------------------------------------------------------------------------- threads

    def depth(self, i: int) -> int:
        """Copies queued for level ``i`` now (0 for the top level)."""
        q = self._queues[i]
        return q.qsize() if q is not None else 0

    def _writer(self, i: int) -> None:
        """Worker of level ``i``: carries queued copies out until told to stop."""
        q, lane = self._queues[i], self._lanes[i]
        try:
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
                self._apply(i, item)
            except Exception:  # never let one bad write kill the worker
                log.exception("kvtier: write to tier %s failed", lane.name)
                lane.stats.add(errors=1)
            finally:
                with self._lock:
                    self._release_pending(item.key)
                q.task_done()

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
                        self.release_queued(item.key)
                    self._release_pending(item.key)
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

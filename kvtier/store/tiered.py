"""TieredStore: KV chunks kept in an ordered list of tiers (fastest first), in this process.

A facade: ``StoreIndex`` (``index.py``) decides (what each level holds, admission, what to
evict and where it goes), ``WriteBack`` (``writeback.py``) runs the background copies, and this
class carries the decisions out with the tiers. The contract:

- ``lookup(keys)`` counts how many leading chunks are present in any tier. No side effects.
- ``write`` stores a chunk in the top tier synchronously (a memcpy into its arena) and queues
  copies for the lower tiers (write-through), served by one background worker per lower tier
  with a bounded queue. A full queue drops that copy and counts it; the caller never waits on
  slow storage.
- ``read`` serves a chunk from the highest tier that has it. A lower-tier hit is copied back into
  the top tier (promotion).
- When a managed tier is full its policy picks a victim; within a prefix chain the store evicts
  the chain's tail first (a chunk is worth nothing without the chunks before it). An evicted
  chunk is demoted to the next tier when that tier does not hold it yet.
- A tier that fails to start is left out (the store degrades); a tier fault at run time is a
  counted miss or drop. Nothing here raises into the engine for a storage fault.
- ``delete`` wins over every copy of the key already queued or in flight (write-through,
  demotion, promotion): see ``writeback.py``. After ``delete`` and ``flush`` no tier holds the
  key (unless it is written again).
- A key is a ``KEY_BYTES``-byte digest (``kvtier.entry.check_key``): a write or delete of any
  other key raises InvalidKey; a read or lookup of one is a miss.
- No read sizes a buffer from a stored length beyond ``max_entry_bytes`` (and what the tier can
  hold): a larger entry is corrupt (counted, removed, a miss).

Thread-safety: every public method may be called from any thread. Bookkeeping and copies into
or out of the top tier happen under one lock (copies there are memcpys); slow I/O on lower tiers
happens outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from kvtier.buffers import Scratch, gather_into, scatter
from kvtier.config import build
from kvtier.entry import check_key, is_valid_key
from kvtier.errors import KVTierError, TierUnavailable
from kvtier.keys import Key
from kvtier.policies.admission import Admission
from kvtier.policies.base import EvictionPolicy
from kvtier.store.base import Consume, Fill, KVStore
from kvtier.store.config import StoreConfig
from kvtier.store.events import EventLog, StoreEvent
from kvtier.store.index import Counters, Eviction, LevelIndex, Room, StoreIndex
from kvtier.store.writeback import Copy, Lane, Prefetcher, WriteBack
from kvtier.tiers.base import Tier
from kvtier.tiers.ram import ArenaTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Level:
    """One tier and what the store checked of it once, at construction."""

    tier: Tier
    arena: ArenaTier | None  # the tier itself when it offers the arena's zero-copy methods
    managed: bool


class TieredStore(KVStore):
    """An ordered list of tiers with eviction, demotion, promotion and background writes."""

    def __init__(self, levels: Sequence[tuple[Tier, EvictionPolicy | None]], config: StoreConfig | None = None):
        if not levels:
            raise KVTierError("a store needs at least one working tier")
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._levels = [_Level(tier, tier if isinstance(tier, ArenaTier) else None, policy is not None)
                        for tier, policy in levels]
        self._events = EventLog()
        self._counters = Counters()
        self._index = StoreIndex(
            [LevelIndex(tier.name, tier.medium, tier.capacity_bytes, policy) for tier, policy in levels],
            Admission(self.config.admission), self._events)
        self._scratch = Scratch()
        self._closed = False
        for i in range(len(self._levels)):
            self._learn(i)
        lanes = [None] + [Lane(level.tier.name, level.tier.stats) for level in self._levels[1:]]
        self._writeback = WriteBack(lanes, self.config.write_queue_depth, self._lock, self._counters, self._copy_down,
                                    nice=self.config.writer_nice)
        self._prefetcher = Prefetcher(self.config.write_queue_depth, self._prefetch)

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, config: StoreConfig | Mapping[str, Any] | None = None) -> "TieredStore":
        """Build the tiers and policies named in ``config`` (a StoreConfig or a plain dict).

        A tier that cannot start (TierUnavailable: unwritable directory, server down at start)
        is left out with a warning; ConfigError for configuration mistakes (when the config
        is built, before any tier is opened).
        """
        from kvtier.policies.registry import DEFAULT_POLICY, make_policy

        if not isinstance(config, StoreConfig):
            config = build(StoreConfig, config, "store")
        levels = []
        for spec in config.tiers:
            try:
                tier = spec.build()
            except TierUnavailable as exc:
                log.warning("kvtier: tier %s left out: %s", spec.type, exc)
                continue
            policy = None if tier.self_managed else make_policy(spec.policy or DEFAULT_POLICY,
                                                                capacity_hint=tier.capacity_bytes)
            levels.append((tier, policy))
        if not levels:
            raise KVTierError("no tier could start; see the warnings above")
        return cls(levels, config)

    def _learn(self, i: int) -> None:
        """Learn what a managed tier already holds (a disk tier survives restarts)."""
        level = self._levels[i]
        if not level.managed:
            return
        for key in level.tier.keys():
            size = level.tier.size_of(key)
            if size is not None:
                self._index.learn(i, key, size)

    @property
    def tiers(self) -> list[Tier]:
        """The working tiers, fastest first."""
        return [level.tier for level in self._levels]

    @property
    def tier_names(self) -> list[str]:
        return [level.tier.name for level in self._levels]

    # ----------------------------------------------------------------------------- lookups

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are present in some tier. No side effects on the policies.
        An invalid key (not a chunk key) ends the run like a missing one."""
        keys = _valid_prefix(keys)
        with self._lock:
            n = self._index.leading_held(keys)
        shared = [level for level in self._levels if not level.managed]
        if n < len(keys) and shared:
            n += self._lookup_shared(shared, keys[n:])
        with self._lock:
            self._counters.lookups += 1
            self._counters.lookup_hit_chunks += n
        return n

    @staticmethod
    def _lookup_shared(levels: list[_Level], keys: Sequence[Key]) -> int:
        """Leading keys present in any of the self-managed tiers (one batched call per tier)."""
        present = [False] * len(keys)
        for level in levels:
            try:
                found = level.tier.contains_many(keys)
            except Exception:  # a tier must not raise, but a shared server may misbehave
                level.tier.stats.add(errors=1)
                continue
            present = [a or b for a, b in zip(present, found)]
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    def locate(self, key: Key) -> str | None:
        """Name of the first tier holding ``key`` (as far as the store knows), or None."""
        if not is_valid_key(key):
            return None
        with self._lock:
            name = self._index.first_holder(key)
        if name is not None:
            return name
        for level in self._levels:
            if not level.managed and level.tier.contains(key):
                return level.tier.name
        return None

    def in_top_tier(self, keys: Sequence[Key]) -> list[bool]:
        """For each key, whether the top tier holds it now (a memcpy away). No side effects."""
        with self._lock:
            return self._index.in_top(keys)

    # ----------------------------------------------------------------------------- reads

    def read(self, key: Key, consume: Consume) -> str | None:
        """Hand ``key``'s payload to ``consume`` (segments valid during the call only).

        Returns the name of the tier it came from, or None on a miss (absent, corrupt, tier
        fault, not a chunk key). A lower-tier hit is promoted into the top tier.
        """
        top = self._levels[0]
        if not is_valid_key(key):
            with self._lock:
                self._counters.misses += 1
            return None
        with self._lock:
            deletes = self._writeback.delete_seq
            if self._index[0].holds(key):
                segments = top.arena.views(key) if top.arena is not None else None
                if segments is not None:
                    consume(segments)
                    self._index.accessed(0, key)
                    self._counters.hits += 1
                    return top.tier.name
            else:
                self._index.missed(0, key)
        first = 1 if top.arena is not None else 0  # a top tier without views reads like a lower one
        for i in range(first, len(self._levels)):
            got = self._read_level(i, key)
            if got is None:
                continue
            consume([got])
            if i > 0:
                self._promote(key, got, i, deletes)
            with self._lock:
                self._counters.hits += 1
            return self._levels[i].tier.name
        with self._lock:
            self._counters.misses += 1
        return None

    def _count_error(self) -> None:
        with self._lock:
            self._counters.errors += 1

    def _read_level(self, i: int, key: Key) -> np.ndarray | None:
        """Read ``key`` from tier ``i`` into this thread's scratch buffer; a view or None."""
        level = self._levels[i]
        with self._lock:
            if level.managed and not self._index[i].holds(key):
                return None
            size = self._index[i].sizes.get(key) if level.managed else None
        if size is None:
            size = level.tier.size_of(key)
            if size is None:
                return None
        if size > self._entry_bound(level):
            self._drop_oversized(i, key, size)
            return None
        buf = self._scratch.get(size)
        try:
            n = level.tier.get_into(key, buf)
        except Exception:
            level.tier.stats.add(errors=1)
            n = None
        if n is None:
            if level.managed:
                with self._lock:
                    # Gone or corrupt (the tier removed it): forget it. A fault that left the
                    # entry in place (EIO, a raising tier) keeps it, or ``used`` would drift
                    # below what the tier holds.
                    if not level.tier.contains(key):
                        self._index.forget(i, key)
            return None
        if level.managed:
            with self._lock:
                self._index.accessed(i, key)
        return buf[:n]

    def _entry_bound(self, level: _Level) -> int:
        """The largest entry the store reads from ``level``: the configured chunk bound and
        what the tier can hold, whichever is smaller."""
        tier_bound = level.tier.max_entry_bytes or self.config.max_entry_bytes
        return min(int(self.config.max_entry_bytes), int(tier_bound))

    def _drop_oversized(self, i: int, key: Key, size: int) -> None:
        """A stored length no chunk can have (forged or foreign): count it corrupt, remove it
        from the tier and the index; the read is a miss. Nothing is allocated for it."""
        level = self._levels[i]
        log.warning("kvtier: tier %s holds %s with %d bytes, over the %d-byte entry bound: removed",
                    level.tier.name, key.hex(), size, self._entry_bound(level))
        level.tier.stats.add(corrupt=1)
        try:
            level.tier.delete(key)
        except Exception:
            level.tier.stats.add(errors=1)
        with self._lock:
            self._counters.corrupt += 1
            if level.managed:
                self._index.forget(i, key)

    def prefetch(self, keys: Sequence[Key]) -> bool:
        """Promote lower-tier entries of ``keys`` into the top tier in the background (up to the
        first key that is not a chunk key, and the first missing one). One worker thread and a
        bounded queue serve every call: False (counted as ``prefetch_drops``) when it is full."""
        keys = list(_valid_prefix(list(keys)))
        if not keys:
            return True
        with self._lock:
            if self._closed:
                return False
        if self._prefetcher.submit(keys):
            return True
        with self._lock:
            self._counters.prefetch_drops += 1
        return False

    def _prefetch(self, keys: list[Key]) -> None:
        for key in keys:
            with self._lock:
                if self._closed or self._index[0].holds(key):
                    continue
            if self.read(key, lambda segs: None) is None:
                break  # a chain is worthless past its first missing chunk

    # ----------------------------------------------------------------------------- writes

    def write(self, key: Key, nbytes: int, fill: Fill, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a chunk of ``nbytes``: ``fill(segments)`` copies the payload into the top tier.

        ``parent`` is the key of the chunk before it in its prefix chain (None for the first),
        ``chunk_index`` its position; both feed chain-aware eviction and admission. Returns
        True if the top tier holds the entry afterwards. Lower tiers are written in the
        background. ``fill`` runs under the store lock and must only copy. InvalidKey (a
        ValueError) when ``key`` or ``parent`` is not a chunk key.
        """
        check_key(key)
        if parent is not None:
            check_key(parent)
        with self._lock:
            if self._closed:
                return False
            if self._index[0].holds(key):
                return True
            if not self._index.admits_new(key, chunk_index, nbytes):
                self._counters.not_admitted += 1
                return False
            stored = self._store_top(key, nbytes, fill, parent)
            if stored:
                # Under the same lock hold: an eviction in between would find the key not yet
                # queued, demote it and leave the write-through copy to miss (a counted drop).
                self._queue_lower(key, parent)
        return stored

    def _store_top(self, key: Key, nbytes: int, fill: Fill, parent: Key | None) -> bool:
        """Make room in the top tier and copy the entry in (the caller holds the lock)."""
        top = self._levels[0]
        if top.managed and not self._make_room(0, nbytes):
            top.tier.stats.add(dropped=1)
            return False
        if top.arena is not None:
            segments = top.arena.reserve(key, nbytes)
            if segments is None:
                top.tier.stats.add(dropped=1)
                return False
            try:
                fill(segments)
            except BaseException:
                top.arena.abort(key)
                raise
            top.arena.commit(key)
        else:
            buf = self._scratch.get(nbytes, "fill")
            fill([buf])
            if not top.tier.put(key, buf):
                return False
        if top.managed:
            self._index.insert(0, key, nbytes, parent)
        return True

    def _promote(self, key: Key, data: np.ndarray, source: int, deletes: int) -> None:
        """Copy a lower-tier hit into the top tier (best effort). Skipped when any delete ran
        since the read began (``deletes``: the count then): the bytes may be of a deleted key."""
        with self._lock:
            if self._index[0].holds(key) or self._closed or self._writeback.delete_seq != deletes:
                return
            parent = self._index[source].parent.get(key)
            if self._store_top(key, data.size, lambda segments: scatter(data, segments), parent):
                self._counters.promotions += 1

    def _queue_lower(self, key: Key, parent: Key | None) -> None:
        """Queue write-through copies of a new top-tier entry for the lower tiers (lock held)."""
        if not self.config.write_through:
            return
        for i in range(1, len(self._levels)):
            if not self._index[i].holds(key):
                self._writeback.queue_write_through(i, key, parent)

    def _copy_down(self, i: int, copy: Copy) -> None:
        """Carry a queued copy out into tier ``i`` (a writer thread), unless the key was deleted
        since it was queued."""
        if copy.data is not None:  # a demotion carries its bytes
            self._put_lower(i, copy.key, copy.parent, np.frombuffer(copy.data, dtype=np.uint8), copy.gen)
            return
        with self._lock:
            try:
                deleted = self._writeback.deleted_since(copy.key, copy.gen)
                data = None if deleted else self._snapshot_top(copy.key)
            finally:  # a failed snapshot must not pin the key's orphan bytes forever
                self._writeback.release_queued(copy.key)
            if deleted:
                self._counters.cancelled_writes += 1
                return
            if data is not None:  # until the put below lands, an eviction must not demote it again
                self._writeback.begin_in_flight(copy.key)
        if data is None:
            self._levels[i].tier.stats.add(dropped=1)
            return
        try:
            self._put_lower(i, copy.key, copy.parent, data, copy.gen)
        finally:
            with self._lock:
                self._writeback.end_in_flight(copy.key)

    def _put_lower(self, i: int, key: Key, parent: Key | None, data: np.ndarray, gen: int) -> None:
        """Make room in tier ``i`` and write ``data`` there (I/O outside the lock).

        A delete of ``key`` wins: the copy is skipped if one came before the put, and what the
        put wrote is removed again if one came during it. One worker writes each tier, so no
        other copy of this key into this tier can land between the put and that removal.
        """
        level = self._levels[i]
        with self._lock:
            if self._writeback.deleted_since(key, gen):
                self._counters.cancelled_writes += 1
                return
            if level.managed:
                if self._index[i].holds(key):
                    return
                if not self._index.admits(i, key, data.size) or not self._make_room(i, data.size):
                    level.tier.stats.add(dropped=1)
                    return
        ok = level.tier.put(key, data)
        with self._lock:
            undo = ok and self._writeback.deleted_since(key, gen)
            if undo:
                self._counters.cancelled_writes += 1
            elif ok and level.managed and not self._index[i].holds(key):
                self._index.insert(i, key, data.size, parent)
            elif ok and not level.managed:
                self._events.record("stored", key, level.tier.medium)
        if undo:
            level.tier.delete(key)

    def _snapshot_top(self, key: Key) -> np.ndarray | None:
        """A contiguous copy of a top-tier entry in this thread's scratch (lock held), or None."""
        orphan = self._writeback.orphan(key)
        if orphan is not None:
            return np.frombuffer(orphan, dtype=np.uint8)
        top = self._levels[0]
        if not self._index[0].holds(key):
            return None
        buf = self._scratch.get(self._index[0].sizes[key], "snap")
        segments = top.arena.views(key, count=False) if top.arena is not None else None
        if segments is None:
            n = top.tier.get_into(key, buf)
            return None if n is None else buf[:n]
        return buf[: gather_into(segments, buf)]

    # ----------------------------------------------------------------------------- eviction

    def _make_room(self, i: int, nbytes: int) -> bool:
        """Evict from managed tier ``i`` until ``nbytes`` fit (lock held). False if they can't."""
        arena = self._levels[i].arena
        # A paged tier (RAM) rounds each entry up to whole pages: payload bytes under capacity
        # do not mean a free run for the new entry, so ask the tier what the entry takes.
        need = arena.footprint(nbytes) if arena is not None else nbytes
        free = arena.free_bytes if arena is not None else None
        while True:
            step = self._index.plan_room(i, nbytes, need, free)
            if step is Room.FITS:
                return True
            if step is Room.NEVER:
                return False
            self._evict(step)

    def _evict(self, ev: Eviction) -> None:
        """Carry out an eviction: keep or demote the entry's bytes as needed, then remove it."""
        i, key = ev.level, ev.key
        level = self._levels[i]
        wb = self._writeback
        if i == 0 and wb.is_queued(key) and wb.orphan(key) is None:
            snap = self._snapshot_top(key)  # lower writes still pending: keep the bytes for them
            if snap is not None:
                wb.keep_orphan(key, snap.tobytes())
        elif ev.demote_to is not None and not wb.is_queued(key) and not wb.is_in_flight(key):
            snap = self._snapshot_top(key) if i == 0 else self._read_for_demotion(i, key)
            if snap is not None:
                wb.queue_demotion(ev.demote_to, key, self._index[i].parent.get(key), snap.tobytes())
        level.tier.delete(key)
        level.tier.stats.add(evictions=1)
        self._counters.evictions += 1
        self._index.forget(i, key)

    def _read_for_demotion(self, i: int, key: Key) -> np.ndarray | None:
        size = self._index[i].sizes.get(key)
        if size is None:
            return None
        buf = np.empty(size, dtype=np.uint8)
        n = self._levels[i].tier.get_into(key, buf)
        return None if n is None else buf[:n]

    # ----------------------------------------------------------------------------- misc

    def enable_events(self, maxlen: int = 100_000) -> None:
        """Start recording StoreEvents for ``take_events``.

        The record is bounded: past ``maxlen`` unread events the oldest are dropped.
        """
        with self._lock:
            self._events.enable(maxlen)

    def take_events(self) -> list[StoreEvent]:
        """Events recorded since the last call (empty unless ``enable_events`` was called)."""
        with self._lock:
            return self._events.take()

    def delete(self, key: Key) -> bool:
        """Remove ``key`` from every tier; copies of it already queued or in flight do not bring
        it back (see the module notes). InvalidKey when ``key`` is not a chunk key. True."""
        check_key(key)
        with self._lock:
            self._writeback.note_delete(key)
            for i, level in enumerate(self._levels):
                if level.managed:
                    if self._index[i].holds(key):
                        level.tier.delete(key)
                        self._index.forget(i, key)
                else:
                    level.tier.delete(key)
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued lower-tier writes are done; False on timeout."""
        return self._writeback.flush(timeout)

    def stats(self) -> dict:
        """Store counters and, per tier, capacity, usage, queue depth and the tier's own counters."""
        with self._lock:
            tiers = []
            for i, level in enumerate(self._levels):
                index = self._index[i]
                tiers.append({
                    "name": level.tier.name,
                    "type": type(level.tier).__name__,
                    "medium": level.tier.medium,
                    "capacity_bytes": level.tier.capacity_bytes,
                    "used_bytes": index.used if level.managed else level.tier.used_bytes(),
                    "entries": len(index.sizes) if level.managed else None,
                    "queue_depth": self._writeback.depth(i),
                    **level.tier.stats.as_dict(),
                })
            return {**self._counters.__dict__, "tiers": tiers}

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (for up to about ``timeout`` seconds), stop the workers and
        close every tier. Writes still queued then (a stuck tier) are dropped and counted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        self.flush(timeout=timeout)
        self._prefetcher.stop(deadline)
        self._writeback.stop(deadline)
        for level in self._levels:
            try:
                level.tier.close()
            except Exception:
                log.exception("kvtier: closing tier %s failed", level.tier.name)

    def __enter__(self) -> "TieredStore":
        return self


def _valid_prefix(keys: Sequence[Key]) -> Sequence[Key]:
    """The leading run of ``keys`` that are chunk keys (all of them, uncopied, when all are)."""
    for i, key in enumerate(keys):
        if not is_valid_key(key):
            return keys[:i]
    return keys

"""TieredStore: KV chunks kept in an ordered list of tiers (fastest first).

Bookkeeping (which key lives in which tier, what to evict) is kept here, apart from the data
movement the tiers do. The contract:

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
  demotion, promotion): each queued copy carries the key's delete generation; the writer skips a
  copy whose key was deleted since it was queued, and removes what it just wrote if the delete
  came during its put. After ``delete`` and ``flush`` no tier holds the key (unless it is
  written again).
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
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kvtier.config import Size, build, ranged
from kvtier.entry import check_key, is_valid_key
from kvtier.errors import ConfigError, KVTierError
from kvtier.policies.admission import Admission, AdmissionConfig
from kvtier.policies.base import EvictionPolicy
from kvtier.tiers.base import Tier
from kvtier.tiers.registry import make_tier

log = logging.getLogger(__name__)

Key = bytes
# A fill/consume callback gets the entry's bytes as a list of writable/readable uint8 segments
# whose concatenation is the payload, valid only during the call.
Segments = list
Fill = Callable[[Segments], None]
Consume = Callable[[Segments], None]

DEFAULT_TIERS = ({"type": "ram", "capacity": "2GiB"},)


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of a TieredStore.

    ``tiers`` is an ordered list of ``{"type": NAME, "policy": POLICY, ...tier config}``, fastest
    first. ``policy`` is ignored for self-managed (shared) tiers. ``max_entry_bytes``: the largest
    entry the store reads (a chunk's bytes; the connector can set its exact chunk size); a stored
    header announcing more is a corrupt entry, so a forged length never sizes an allocation.
    """

    tiers: list[dict] = field(default_factory=lambda: [dict(t) for t in DEFAULT_TIERS])
    write_queue_depth: int = ranged(64, ge=1)
    write_through: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_entry_bytes: Size = ranged(Size(1024**3), ge=1)

    def __post_init__(self):
        if not self.tiers:
            raise ConfigError("store.tiers: at least one tier is needed")
        if self.write_queue_depth < 1:
            raise ConfigError(f"store.write_queue_depth: must be in [1, inf), got {self.write_queue_depth!r}")
        for i, spec in enumerate(self.tiers):
            if not isinstance(spec, Mapping):
                raise ConfigError(f"store.tiers[{i}]: expected a mapping with a 'type'")


@dataclass
class _Level:
    """One tier plus the store's bookkeeping for it."""

    tier: Tier
    policy: EvictionPolicy | None  # None: the tier manages its own capacity
    sizes: dict = field(default_factory=dict)  # key -> payload bytes (managed tiers)
    parent: dict = field(default_factory=dict)  # key -> parent key, for chain-aware eviction
    children: dict = field(default_factory=dict)  # parent key -> set of child keys
    used: int = 0
    queue: "queue.Queue | None" = None
    worker: threading.Thread | None = None

    @property
    def managed(self) -> bool:
        return self.policy is not None

    def holds(self, key: Key) -> bool:
        return key in self.sizes


@dataclass
class _Counters:
    lookups: int = 0
    lookup_hit_chunks: int = 0
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    not_admitted: int = 0
    write_drops: int = 0
    errors: int = 0
    corrupt: int = 0  # entries whose stored length exceeds what the store or tier accepts
    cancelled_writes: int = 0  # lower-tier copies skipped or undone because the key was deleted


_STOP = object()


class _TooSmall(Exception):
    """A caller's buffer cannot hold the entry (internal signal of ``get_into``)."""


class TieredStore:
    """An ordered list of tiers with eviction, demotion, promotion and background writes."""

    def __init__(self, levels: Sequence[tuple[Tier, EvictionPolicy | None]], config: StoreConfig | None = None):
        if not levels:
            raise KVTierError("a store needs at least one working tier")
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._levels = [_Level(tier, policy) for tier, policy in levels]
        self._admission = Admission(self.config.admission)
        self._events: deque | None = None  # (kind, key, medium), when enabled
        self._counters = _Counters()
        self._orphans: dict[Key, bytes] = {}  # bytes of top-tier entries evicted before their lower writes ran
        self._queued: dict[Key, int] = {}  # key -> lower writes still to read from the top tier
        self._in_flight: dict[Key, int] = {}  # key -> lower writes that have their bytes, not yet landed
        self._pending: dict[Key, int] = {}  # key -> lower copies queued or running (any tier)
        self._tombs: dict[Key, int] = {}  # key -> delete generation, kept while copies are pending
        self._delete_seq = 0  # deletes so far: a promotion that saw one meanwhile is skipped
        self._scratch = threading.local()
        self._closed = False
        for level in self._levels:
            self._rebuild_index(level)
        for i, level in enumerate(self._levels[1:], start=1):
            level.queue = queue.Queue(maxsize=self.config.write_queue_depth)
            level.worker = threading.Thread(target=self._writer, args=(i,), name=f"kvtier-writer-{level.tier.name}", daemon=True)
            level.worker.start()

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def from_config(cls, config: StoreConfig | Mapping[str, Any] | None = None) -> "TieredStore":
        """Build the tiers and policies named in ``config`` (a StoreConfig or a plain dict).

        A tier that cannot start (TierUnavailable: unwritable directory, server down at start)
        is left out with a warning; ConfigError for configuration mistakes.
        """
        from kvtier.policies.registry import DEFAULT_POLICY, make_policy
        from kvtier.errors import TierUnavailable

        if not isinstance(config, StoreConfig):
            config = build(StoreConfig, config, "store")
        levels = []
        for i, spec in enumerate(config.tiers):
            spec = dict(spec)
            policy_name = spec.pop("policy", DEFAULT_POLICY)
            try:
                tier = make_tier(spec, f"store.tiers[{i}]")
            except TierUnavailable as exc:
                log.warning("kvtier: tier %s left out: %s", spec.get("type"), exc)
                continue
            policy = None if tier.self_managed else make_policy(policy_name, capacity_hint=tier.capacity_bytes)
            levels.append((tier, policy))
        if not levels:
            raise KVTierError("no tier could start; see the warnings above")
        return cls(levels, config)

    def _rebuild_index(self, level: _Level) -> None:
        """Learn what a managed tier already holds (a disk tier survives restarts)."""
        if not level.managed:
            return
        for key in level.tier.keys():
            size = level.tier.size_of(key)
            if size is not None and key not in level.sizes:
                level.sizes[key] = size
                level.used += size
                level.policy.insert(key, size)

    @property
    def tiers(self) -> list[Tier]:
        """The working tiers, fastest first."""
        return [level.tier for level in self._levels]

    # ----------------------------------------------------------------------------- lookups

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are present in some tier. No side effects on the policies.
        An invalid key (not a chunk key) ends the run like a missing one."""
        keys = _valid_prefix(keys)
        with self._lock:
            n = 0
            for key in keys:
                if not any(level.holds(key) for level in self._levels if level.managed):
                    break
                n += 1
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
            for level in self._levels:
                if level.managed and level.holds(key):
                    return level.tier.name
        for level in self._levels:
            if not level.managed and level.tier.contains(key):
                return level.tier.name
        return None

    def in_top_tier(self, keys: Sequence[Key]) -> list[bool]:
        """For each key, whether the top tier holds it now (a memcpy away). No side effects."""
        top = self._levels[0]
        with self._lock:
            if top.managed:
                return [top.holds(k) for k in keys]
        return [False] * len(keys)

    def __contains__(self, key: Key) -> bool:
        return self.lookup([key]) == 1

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
            deletes = self._delete_seq
            if top.holds(key):
                segments = self._segments(top, key)
                if segments is not None:
                    consume(segments)
                    top.policy.access(key)
                    self._counters.hits += 1
                    return top.tier.name
            elif top.managed:
                top.policy.miss(key)
        first = 1 if hasattr(top.tier, "views") else 0  # a top tier without views reads like a lower one
        for i, level in enumerate(self._levels[first:], start=first):
            got = self._read_level(level, key)
            if got is None:
                continue
            consume([got])
            if i > 0:
                self._promote(key, got, level, deletes)
            with self._lock:
                self._counters.hits += 1
            return level.tier.name
        with self._lock:
            self._counters.misses += 1
        return None

    def get_into(self, key: Key, out) -> int | None:
        """Copy ``key``'s payload into the writable buffer ``out``; the byte count or None.

        A buffer smaller than the entry is a miss (None, counted as a store error); ``out`` is
        then left untouched.
        """
        dst = np.frombuffer(out, dtype=np.uint8)
        written = [0]

        def consume(segments: Segments) -> None:
            sizes = [memoryview(seg).nbytes for seg in segments]
            if sum(sizes) > dst.size:
                raise _TooSmall
            pos = 0
            for seg in segments:
                seg = np.frombuffer(seg, dtype=np.uint8)
                dst[pos : pos + seg.size] = seg
                pos += seg.size
            written[0] = pos

        try:
            found = self.read(key, consume)
        except _TooSmall:
            with self._lock:
                self._counters.errors += 1
            return None
        return written[0] if found is not None else None

    def get(self, key: Key) -> bytes | None:
        """The payload of ``key`` as new bytes, or None."""
        chunks: list[bytes] = []
        found = self.read(key, lambda segs: chunks.extend(bytes(memoryview(s)) for s in segs))
        return b"".join(chunks) if found is not None else None

    def _segments(self, level: _Level, key: Key, count: bool = True) -> Segments | None:
        """Zero-copy views of a top-tier entry (the caller holds the lock); ``count`` False for
        the store's internal reads, which must not show as the tier's hits."""
        views = getattr(level.tier, "views", None)
        if views is None:
            return None
        return views(key, count=count)

    def _read_level(self, level: _Level, key: Key):
        """Read ``key`` from one tier into this thread's scratch buffer; a view or None."""
        with self._lock:
            if level.managed and not level.holds(key):
                return None
            size = level.sizes.get(key) if level.managed else None
        if size is None:
            size = level.tier.size_of(key)
            if size is None:
                return None
        if size > self._entry_bound(level):
            self._drop_oversized(level, key, size)
            return None
        buf = self._scratch_buffer(size)
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
                        self._forget(level, key)
            return None
        if level.managed:
            with self._lock:
                if level.holds(key):
                    level.policy.access(key)
        return buf[:n]

    def _entry_bound(self, level: _Level) -> int:
        """The largest entry the store reads from ``level``: the configured chunk bound and
        what the tier can hold, whichever is smaller."""
        tier_bound = getattr(level.tier, "max_entry_bytes", 0) or self.config.max_entry_bytes
        return min(int(self.config.max_entry_bytes), int(tier_bound))

    def _drop_oversized(self, level: _Level, key: Key, size: int) -> None:
        """A stored length no chunk can have (forged or foreign): count it corrupt, remove it
        from the tier and the index; the read is a miss. Nothing is allocated for it."""
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
                self._forget(level, key)

    def _scratch_buffer(self, size: int, slot: str = "io") -> np.ndarray:
        """A per-thread reusable buffer of at least ``size`` bytes (memory stays flat).

        ``slot`` separates uses that can be live at once in one thread: "io" holds a lower-tier
        read being promoted, "snap" a top-tier snapshot taken while evicting or writing down.
        """
        buf = getattr(self._scratch, slot, None)
        if buf is None or buf.size < size:
            buf = np.empty(max(size, 1 << 20), dtype=np.uint8)
            setattr(self._scratch, slot, buf)
        return buf[:size]

    def prefetch(self, keys: Sequence[Key]) -> None:
        """Promote lower-tier entries of ``keys`` into the top tier in the background (up to the
        first key that is not a chunk key)."""
        keys = list(_valid_prefix(list(keys)))
        if keys:
            threading.Thread(target=self._prefetch, args=(keys,), name="kvtier-prefetch", daemon=True).start()

    def _prefetch(self, keys: list[Key]) -> None:
        for key in keys:
            with self._lock:
                if self._closed or self._levels[0].holds(key):
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
        top = self._levels[0]
        with self._lock:
            if self._closed:
                return False
            if top.holds(key):
                return True
            if not self._admission.admit(key, chunk_index + 1):
                self._counters.not_admitted += 1
                return False
            if top.managed and not top.policy.admit(key, nbytes):
                self._counters.not_admitted += 1
                return False
            stored = self._store_top(key, nbytes, fill, parent)
            if stored:
                # Under the same lock hold: an eviction in between would find the key not yet
                # queued, demote it and leave the write-through copy to miss (a counted drop).
                self._queue_lower(key, parent)
        return stored

    def put(self, key: Key, data, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a copy of the bytes-like ``data`` (see ``write``)."""
        src = np.frombuffer(data, dtype=np.uint8)

        def fill(segments: Segments) -> None:
            pos = 0
            for seg in segments:
                seg = np.frombuffer(seg, dtype=np.uint8) if not isinstance(seg, np.ndarray) else seg
                seg[:] = src[pos : pos + seg.size]
                pos += seg.size

        return self.write(key, src.size, fill, parent, chunk_index)

    def _store_top(self, key: Key, nbytes: int, fill: Fill, parent: Key | None) -> bool:
        """Make room in the top tier and copy the entry in (the caller holds the lock)."""
        top = self._levels[0]
        if top.managed and not self._make_room(0, nbytes):
            top.tier.stats.add(dropped=1)
            return False
        reserve = getattr(top.tier, "reserve", None)
        if reserve is not None:
            segments = reserve(key, nbytes)
            if segments is None:
                top.tier.stats.add(dropped=1)
                return False
            try:
                fill(segments)
            except BaseException:
                top.tier.abort(key)
                raise
            top.tier.commit(key)
        else:
            buf = self._scratch_buffer(nbytes, "fill")
            fill([buf])
            if not top.tier.put(key, buf):
                return False
        if top.managed:
            self._insert(top, key, nbytes, parent)
        return True

    def _promote(self, key: Key, data: np.ndarray, source: _Level, deletes: int) -> None:
        """Copy a lower-tier hit into the top tier (best effort). Skipped when any delete ran
        since the read began (``deletes``: the count then): the bytes may be of a deleted key."""
        with self._lock:
            top = self._levels[0]
            if top.holds(key) or self._closed or self._delete_seq != deletes:
                return
            parent = source.parent.get(key)

            def fill(segments: Segments) -> None:
                pos = 0
                for seg in segments:
                    seg[:] = data[pos : pos + seg.size]
                    pos += seg.size

            if self._store_top(key, data.size, fill, parent):
                self._counters.promotions += 1

    def _queue_lower(self, key: Key, parent: Key | None) -> None:
        """Queue write-through copies of a new top-tier entry for the lower tiers."""
        if not self.config.write_through:
            return
        for level in self._levels[1:]:
            with self._lock:
                if level.holds(key):
                    continue
                self._queued[key] = self._queued.get(key, 0) + 1
                gen = self._add_pending(key)
            try:
                level.queue.put_nowait((key, parent, None, gen))
            except queue.Full:
                with self._lock:
                    self._release_queued(key)
                    self._release_pending(key)
                    self._counters.write_drops += 1
                level.tier.stats.add(dropped=1)

    def _add_pending(self, key: Key) -> int:
        """Count one more lower copy of ``key`` queued (lock held); the key's delete generation,
        which the copy carries so that a later ``delete`` wins over it."""
        self._pending[key] = self._pending.get(key, 0) + 1
        return self._tombs.get(key, 0)

    def _release_pending(self, key: Key) -> None:
        """One lower copy of ``key`` is done, dropped or skipped (lock held); the key's tombstone
        goes with its last pending copy, so tombstones never outlive the copies they guard."""
        n = self._pending.get(key, 0) - 1
        if n <= 0:
            self._pending.pop(key, None)
            self._tombs.pop(key, None)
        else:
            self._pending[key] = n

    def _deleted_since(self, key: Key, gen: int) -> bool:
        """Whether ``key`` was deleted after a copy carrying generation ``gen`` was queued (lock held)."""
        return self._tombs.get(key, 0) != gen

    def _release_queued(self, key: Key) -> None:
        n = self._queued.get(key, 0) - 1
        if n <= 0:
            self._queued.pop(key, None)
            self._orphans.pop(key, None)
        else:
            self._queued[key] = n

    def _writer(self, index: int) -> None:
        """Background worker: writes queued entries into tier ``index``."""
        level = self._levels[index]
        while True:
            item = level.queue.get()
            if item is _STOP:
                level.queue.task_done()
                return
            key, parent, data, gen = item
            try:
                self._write_lower(level, key, parent, data, gen)
            except Exception:  # never let one bad write kill the worker
                log.exception("kvtier: write to tier %s failed", level.tier.name)
                level.tier.stats.add(errors=1)
            finally:
                with self._lock:
                    self._release_pending(key)
                level.queue.task_done()

    def _write_lower(self, level: _Level, key: Key, parent: Key | None, data, gen: int) -> None:
        """Copy ``key`` into a lower tier (from ``data`` or from the top tier), unless the key
        was deleted since the copy was queued (``gen``: its delete generation then)."""
        if data is None:
            with self._lock:
                try:
                    deleted = self._deleted_since(key, gen)
                    data = None if deleted else self._snapshot_top(key)
                finally:  # a failed snapshot must not pin the key's orphan bytes forever
                    self._release_queued(key)
                if deleted:
                    self._counters.cancelled_writes += 1
                    return
                if data is not None:  # until the put below lands, an eviction must not demote it again
                    self._in_flight[key] = self._in_flight.get(key, 0) + 1
            if data is None:
                level.tier.stats.add(dropped=1)
                return
            try:
                self._put_lower(level, key, parent, data, gen)
            finally:
                with self._lock:
                    n = self._in_flight.pop(key) - 1
                    if n:
                        self._in_flight[key] = n
            return
        # a demotion carries its bytes (``bytes``); sizes below are read off an array
        self._put_lower(level, key, parent, np.frombuffer(data, dtype=np.uint8), gen)

    def _put_lower(self, level: _Level, key: Key, parent: Key | None, data: np.ndarray, gen: int) -> None:
        """Make room in a lower tier and write ``data`` there (I/O outside the lock).

        A delete of ``key`` wins: the copy is skipped if one came before the put, and what the
        put wrote is removed again if one came during it. One worker writes each tier, so no
        other copy of this key into this tier can land between the put and that removal.
        """
        with self._lock:
            if self._deleted_since(key, gen):
                self._counters.cancelled_writes += 1
                return
            if level.managed:
                if level.holds(key):
                    return
                if not level.policy.admit(key, data.size) or not self._make_room(self._levels.index(level), data.size):
                    level.tier.stats.add(dropped=1)
                    return
        ok = level.tier.put(key, data)
        with self._lock:
            undo = ok and self._deleted_since(key, gen)
            if undo:
                self._counters.cancelled_writes += 1
            elif ok and level.managed and not level.holds(key):
                self._insert(level, key, data.size, parent)
            elif ok and not level.managed:
                self._event("stored", key, level)
        if undo:
            level.tier.delete(key)

    def _snapshot_top(self, key: Key):
        """A contiguous copy of a top-tier entry in this thread's scratch (lock held), or None."""
        orphan = self._orphans.get(key)
        if orphan is not None:
            return np.frombuffer(orphan, dtype=np.uint8)
        top = self._levels[0]
        if not top.holds(key):
            return None
        size = top.sizes[key]
        buf = self._scratch_buffer(size, "snap")
        segments = self._segments(top, key, count=False)
        if segments is None:
            n = top.tier.get_into(key, buf)
            return None if n is None else buf[:n]
        pos = 0
        for seg in segments:
            seg = np.frombuffer(seg, dtype=np.uint8)
            buf[pos : pos + seg.size] = seg
            pos += seg.size
        return buf[:pos]

    # ----------------------------------------------------------------------------- eviction

    def _make_room(self, index: int, nbytes: int) -> bool:
        """Evict from managed tier ``index`` until ``nbytes`` fit (lock held). False if they can't."""
        level = self._levels[index]
        tier = level.tier
        capacity = tier.capacity_bytes
        # A paged tier (RAM) rounds each entry up to whole pages: payload bytes under capacity
        # do not mean a free run for the new entry, so ask the tier what the entry takes.
        footprint = getattr(tier, "footprint", None)
        free_bytes = getattr(tier, "free_bytes", None)
        need = footprint(nbytes) if footprint is not None else nbytes
        if need > capacity:
            return False

        def fits() -> bool:
            if level.used + nbytes > capacity:
                return False
            return free_bytes is None or free_bytes() >= need

        while not fits():
            victim = level.policy.victim()
            if victim is None:
                return False
            self._evict(index, self._chain_tail(level, victim))
        return True

    @staticmethod
    def _chain_tail(level: _Level, key: Key) -> Key:
        """The last resident descendant of ``key`` in its prefix chain (``key`` if none)."""
        seen = {key}
        while True:
            kids = level.children.get(key)
            if not kids:
                return key
            nxt = next(iter(kids))
            if nxt in seen:  # a caller-made cycle (a chunk named as its own ancestor)
                return key
            seen.add(nxt)
            key = nxt

    def _evict(self, index: int, key: Key) -> None:
        """Remove ``key`` from tier ``index``, demoting it to the next tier first if needed."""
        level = self._levels[index]
        nxt = self._levels[index + 1] if index + 1 < len(self._levels) else None
        if self._queued.get(key) and index == 0 and key not in self._orphans:
            snap = self._snapshot_top(key)  # lower writes still pending: keep the bytes for them
            if snap is not None:
                self._orphans[key] = snap.tobytes()
        elif (nxt is not None and nxt.managed and not nxt.holds(key) and not self._queued.get(key)
              and not self._in_flight.get(key)):
            snap = self._snapshot_top(key) if index == 0 else self._read_for_demotion(level, key)
            if snap is not None:
                gen = self._add_pending(key)
                try:
                    nxt.queue.put_nowait((key, level.parent.get(key), snap.tobytes(), gen))
                    self._counters.demotions += 1
                except queue.Full:
                    self._release_pending(key)
                    nxt.tier.stats.add(dropped=1)
                    self._counters.write_drops += 1
        level.tier.delete(key)
        level.tier.stats.add(evictions=1)
        self._counters.evictions += 1
        self._forget(level, key)

    def _read_for_demotion(self, level: _Level, key: Key):
        size = level.sizes.get(key)
        if size is None:
            return None
        buf = np.empty(size, dtype=np.uint8)
        n = level.tier.get_into(key, buf)
        return None if n is None else buf[:n]

    def _insert(self, level: _Level, key: Key, size: int, parent: Key | None) -> None:
        self._event("stored", key, level)
        level.sizes[key] = size
        level.used += size
        level.policy.insert(key, size)
        if parent is not None:
            level.parent[key] = parent
            level.children.setdefault(parent, set()).add(key)

    def _forget(self, level: _Level, key: Key) -> None:
        """Drop ``key`` from a managed tier's bookkeeping (lock held)."""
        size = level.sizes.pop(key, None)
        if size is None:
            return
        self._event("removed", key, level)
        level.used -= size
        level.policy.remove(key)
        parent = level.parent.pop(key, None)
        if parent is not None:
            kids = level.children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del level.children[parent]

    # ----------------------------------------------------------------------------- misc

    def enable_events(self, maxlen: int = 100_000) -> None:
        """Start recording ("stored"|"removed", key, medium) events for ``take_events``.

        The record is bounded: past ``maxlen`` unread events the oldest are dropped.
        """
        with self._lock:
            if self._events is None:
                self._events = deque(maxlen=maxlen)

    def take_events(self) -> list[tuple[str, Key, str]]:
        """Events recorded since the last call (empty unless ``enable_events`` was called)."""
        with self._lock:
            if not self._events:
                return []
            events = list(self._events)
            self._events.clear()
            return events

    def _event(self, kind: str, key: Key, level: _Level) -> None:
        if self._events is not None:
            self._events.append((kind, key, level.tier.medium))

    def delete(self, key: Key) -> None:
        """Remove ``key`` from every tier; copies of it already queued or in flight do not bring
        it back (see the module notes). InvalidKey when ``key`` is not a chunk key."""
        check_key(key)
        with self._lock:
            self._delete_seq += 1
            if key in self._pending:  # queued or running copies: they check this and yield
                self._tombs[key] = self._tombs.get(key, 0) + 1
            self._orphans.pop(key, None)  # a pending write-through must not bring it back
            for level in self._levels:
                if level.managed:
                    if level.holds(key):
                        level.tier.delete(key)
                        self._forget(level, key)
                else:
                    level.tier.delete(key)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued lower-tier writes are done; False on timeout."""
        deadline = time.monotonic() + timeout
        for level in self._levels[1:]:
            while level.queue.unfinished_tasks:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        return True

    def stats(self) -> dict:
        """Store counters and, per tier, capacity, usage, queue depth and the tier's own counters."""
        with self._lock:
            tiers = []
            for level in self._levels:
                tier_stats = level.tier.stats.as_dict()
                tiers.append({
                    "name": level.tier.name,
                    "type": type(level.tier).__name__,
                    "medium": level.tier.medium,
                    "capacity_bytes": level.tier.capacity_bytes,
                    "used_bytes": level.used if level.managed else level.tier.used_bytes(),
                    "entries": len(level.sizes) if level.managed else None,
                    "queue_depth": level.queue.qsize() if level.queue is not None else 0,
                    **tier_stats,
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
        for level in self._levels[1:]:
            self._drop_pending(level)
            try:  # a full queue here means a worker still demotes into it: do not wait forever
                level.queue.put(_STOP, timeout=max(0.1, deadline - time.monotonic()))
            except queue.Full:
                log.warning("kvtier: writer for tier %s did not stop", level.tier.name)
        for level in self._levels[1:]:
            level.worker.join(timeout=max(0.1, deadline - time.monotonic()))
        for level in self._levels:
            try:
                level.tier.close()
            except Exception:
                log.exception("kvtier: closing tier %s failed", level.tier.name)

    def _drop_pending(self, level: _Level) -> None:
        """Drop (and count) the writes still queued for ``level`` (at close, after the flush)."""
        while True:
            try:
                item = level.queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                key, _parent, data, _gen = item
                with self._lock:
                    if data is None:
                        self._release_queued(key)
                    self._release_pending(key)
                    self._counters.write_drops += 1
                level.tier.stats.add(dropped=1)
            level.queue.task_done()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _valid_prefix(keys: Sequence[Key]) -> Sequence[Key]:
    """The leading run of ``keys`` that are chunk keys (all of them, uncopied, when all are)."""
    for i, key in enumerate(keys):
        if not is_valid_key(key):
            return keys[:i]
    return keys

"""TieredStore: KV chunks kept in an ordered list of tiers (fastest first), in this process.

A facade: ``StoreIndex`` (``index.py``) decides (what each level holds, admission, what to
evict and where it goes), ``CopyLedger`` (``ledger.py``) keeps the copies and removals under
way, ``WriteBack`` (``writeback.py``) runs the background copies, and this class carries the
decisions out with the tiers. The contract:

- ``lookup(keys)`` counts how many leading chunks are present in any tier. No side effects.
- ``write`` stores a chunk in the top tier synchronously (a memcpy into its arena) and queues
  copies for the lower tiers (write-through), served by one background worker per lower tier
  with a bounded queue. A full queue drops that copy and counts it; the caller never waits on
  slow storage.
- ``read`` serves a chunk from the highest tier that has it. A lower-tier hit is copied back into
  the top tier (promotion). A top entry evicted while its write-through copies wait (an orphan:
  its pages stay pinned for them) is still found and read from those pages until they land.
- When a managed tier is full its policy picks a victim; within a prefix chain the store evicts
  the chain's tail first (a chunk is worth nothing without the chunks before it). An evicted
  chunk is demoted to the next tier when that tier does not hold it yet.
- A tier that fails to start is left out (the store degrades); a tier fault at run time is a
  counted miss or drop. Nothing here raises into the engine for a storage fault.
- ``delete`` wins over every copy of the key already queued or in flight (write-through,
  demotion, promotion): see ``ledger.py``. After ``delete`` and ``flush`` no tier holds the
  key (unless it is written again).
- A key is a ``KEY_BYTES``-byte digest (``kvtier.entry.check_key``): a write or delete of any
  other key raises InvalidKey; a read or lookup of one is a miss.
- No read sizes a buffer from a stored length beyond ``max_entry_bytes`` (and what the tier can
  hold): a larger entry is corrupt (counted, removed, a miss).

Thread-safety: every public method may be called from any thread. The store's lock (one
``RLock``) guards the index, the copy ledger (``ledger.py``), the counters and the event log.
Its contract:

- Under the lock the store decides (what each level holds, what to evict, which copies may
  run), hands copies to the writer queues (``put_nowait``), and copies into or out of the top
  tier's arena: an ``ArenaTier``'s ``reserve``/``commit``/``abort``/``views``/``borrow``/
  ``footprint``/``free_bytes``/``delete`` are page operations in this process's memory. A
  top-tier hit pins its pages under the lock (``borrow``) and runs ``consume`` after it; a write
  reserves pages under it, runs ``fill`` after it and publishes under it again (a delete that
  came meanwhile wins: the pages are freed). A write-through copy pins the entry's pages under
  the lock and reads them after it; an eviction of an entry whose write-through copies have not
  read it yet keeps its pages pinned for them (``Orphan``: no copy on the evicting thread),
  freed by the arena once the last copy is done. Promotions copy into the arena under the
  lock.
- No other tier method of any tier runs under it: reads, puts, deletes, sizes, usage,
  listings of lower tiers (and of a top tier without an arena) run after the lock is released,
  on decisions taken under it. ``stats`` takes the lock for the index's figures only; a
  self-managed tier's usage is asked afterwards, on the caller's thread.
- The ledger keeps those decisions true while the I/O runs: a put of a key into a level waits
  (off the lock) for a removal of that key from that level to end; a read of a level the key
  is being removed from misses; a promotion skips a key with a delete under way; a copy that a
  delete overtook is skipped or undone (``delete`` wins).

``tests/store/test_lock_contract.py`` wraps every tier in a probe that fails when a tier
method other than the arena's runs with the lock held.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from kvtier.buffers import Scratch, gather_into, scatter
from kvtier.config import build
from kvtier.entry import DTYPES, check_key, is_valid_key
from kvtier.errors import CorruptEntry, KVTierError, TierUnavailable
from kvtier.keys import Key
from kvtier.policies.admission import Admission
from kvtier.policies.base import EvictionPolicy
from kvtier.store.base import Consume, Fill, KVStore
from kvtier.store.config import StoreConfig
from kvtier.store.events import EventLog, StoreEvent
from kvtier.store.index import Counters, Eviction, LevelIndex, Room, StoreIndex
from kvtier.store.ledger import CopyLedger
from kvtier.store.writeback import Copy, DetachedBytes, Lane, Orphan, Prefetcher, StepGate, WriteBack, release_orphan
from kvtier.tiers.base import Tier
from kvtier.tiers.ram import ArenaTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Level:
    """One tier and what the store checked of it once, at construction."""

    tier: Tier
    arena: ArenaTier | None  # the tier itself when it offers the arena's zero-copy methods
    managed: bool


@dataclass(frozen=True)
class _Removal:
    """A tier delete decided under the lock and carried out after it: ``key`` leaves level
    ``level`` (already forgotten by the index). With ``gen`` set, its ``size`` bytes are read
    first and demoted to level ``demote_to`` (a copy registered in the ledger under ``gen``)."""

    level: int
    key: Key
    size: int
    parent: Key | None
    demote_to: int | None = None
    gen: int | None = None


class TieredStore(KVStore):
    """An ordered list of tiers with eviction, demotion, promotion and background writes."""

    def __init__(self, levels: Sequence[tuple[Tier, EvictionPolicy | None]], config: StoreConfig | None = None):
        if not levels:
            raise KVTierError("a store needs at least one working tier")
        self.config = config or StoreConfig()
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified when a tier removal ends
        self._levels = [_Level(tier, tier if isinstance(tier, ArenaTier) else None, policy is not None)
                        for tier, policy in levels]
        self._events = EventLog()
        self._counters = Counters()
        self._ledger = CopyLedger()
        self._detached = DetachedBytes()  # orphans copied out of the top arena, still alive
        self._index = StoreIndex(
            [LevelIndex(tier.name, tier.medium, tier.capacity_bytes, policy) for tier, policy in levels],
            Admission(self.config.admission), self._events)
        self._scratch = Scratch()
        self._closed = False
        auth = self.config.entry_auth()  # the trust domain's key, when configured: every tier uses it
        if auth is not None:
            for level in self._levels:
                level.tier.set_auth(auth)
        for i in range(len(self._levels)):
            self._learn(i)
        lanes = [None] + [Lane(level.tier.name, level.tier.stats) for level in self._levels[1:]]
        self._step_gate = StepGate()
        self._writeback = WriteBack(lanes, self.config.write_queue_depth, self._lock, self._ledger, self._counters,
                                    self._copy_down, nice=self.config.writer_nice,
                                    idle=self.config.writer_idle, gate=self._step_gate,
                                    step_wait_s=self.config.writer_step_wait_s or 0.0,
                                    may_hold=self._may_hold_copy)
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
        """Learn what a managed tier already holds (a disk tier survives restarts). Runs in the
        constructor, before any other thread can use the store."""
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
            n = self._index.leading_held(keys, self._ledger.has_orphan)
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
        key = check_key(key)  # bytes (a bytearray is not hashable)
        with self._lock:
            name = self._index.first_holder(key)
            if name is None and self._ledger.has_orphan(key):  # evicted, its pages kept for its copy
                name = self._levels[0].tier.name
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

    @property
    def memcpy_writes(self) -> bool:
        """True when the top tier is an arena in this process (``write`` reserves its pages and
        copies into them; the lower tiers are written by the background writers)."""
        return self._levels[0].arena is not None

    def top_room(self, nbytes: int) -> int | None:
        """How many more entries of ``nbytes`` the top tier's arena takes now without evicting
        anything: what ``_make_room_top`` would fit, entry after entry, with no eviction (both its
        payload budget and whole free pages). None without an arena in this process. Only a
        write or a promotion takes room; a delete or a lower tier's copy never does."""
        arena = self._levels[0].arena
        if arena is None or nbytes <= 0:
            return None
        need = arena.footprint(nbytes)
        with self._lock:
            payload = self._index.room(0)
            pages = arena.free_bytes()
        return min(payload // nbytes, pages // need) if payload is not None else None

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
        key = check_key(key)  # bytes (a bytearray is not hashable)
        with self._lock:
            deletes = self._ledger.delete_seq
            pinned = ExitStack()
            segments = None
            if self._index.holds(0, key):
                if top.arena is not None:  # pin the pages: the copy out runs after the lock
                    segments = pinned.enter_context(top.arena.borrow(key))
                if segments is not None:
                    self._index.accessed(0, key)
                    self._counters.hits += 1
            else:
                self._index.missed(0, key)
                segments = self._hold_orphan(key, pinned)
        if segments is not None:
            try:
                with pinned:
                    consume(segments)  # a coded arena decodes here
                return top.tier.name
            except CorruptEntry:  # pages that do not decode (the tier counted it): dropped, the lower tiers asked
                with self._lock:
                    self._counters.corrupt += 1
                    self._counters.hits -= 1
                    self._drop_top(key)
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

    def _drop_top(self, key: Key) -> None:
        """Forget ``key``'s top entry and its orphans, whose pages do not decode (lock held): a
        later read goes to the lower tiers, and a promotion may bring good bytes back."""
        for orphan in self._ledger.supersede(key):
            release_orphan(orphan)
        if self._index.holds(0, key):
            self._index.forget(0, key)
            self._levels[0].arena.delete(key)

    def _hold_orphan(self, key: Key, pinned: ExitStack) -> Any:
        """The pages of ``key``'s orphan (a top entry evicted while its write-through copy
        waits), held until ``pinned`` closes, counted as a hit; None without one (lock held).
        Until its copy lands in a lower tier the orphan is the only place the key is."""
        orphan = self._ledger.readable_orphan(key)
        if orphan is None:
            return None
        views = orphan.hold()
        pinned.callback(self._drop_orphan, orphan)
        self._counters.hits += 1
        self._levels[0].tier.stats.add(hits=1, bytes_read=orphan.nbytes)
        return views

    @contextmanager
    def borrow_top(self, keys: Sequence[Key]) -> Iterator[list[Any]]:
        """For each of ``keys``, its pages in the top tier's arena (None where the arena lacks
        it), all pinned under one hold of the lock and read after it, until the ``with`` block
        ends (``read``'s top-tier hit, for many keys at once: one lock hold, one batch of copies).
        Counted as ``read`` counts hits; a key without pages is neither a hit nor a miss here.
        Keep each call small: an entry evicted while pinned frees its pages only when the block
        ends, so a put made meanwhile evicts that much more (with the whole arena pinned, every
        entry, and the put is still refused)."""
        top = self._levels[0]
        out: list[Any] = [None] * len(keys)
        with ExitStack() as pinned:
            if top.arena is not None:
                with self._lock:
                    held = [(i, key) for i, key in enumerate(map(_as_key, keys))
                            if key is not None and self._index.holds(0, key)]
                    pages = pinned.enter_context(top.arena.borrow_many([key for _, key in held]))
                    for (i, key), views in zip(held, pages):
                        if views is not None:
                            out[i] = views
                            self._index.accessed(0, key)
                            self._counters.hits += 1
            yield out

    def _count_error(self) -> None:
        with self._lock:
            self._counters.errors += 1

    def _read_level(self, i: int, key: Key) -> np.ndarray | None:
        """Read ``key`` from tier ``i`` into this thread's scratch buffer; a view or None.
        The tier is asked outside the lock; a key being removed from it is a miss."""
        level = self._levels[i]
        with self._lock:
            if level.managed:
                entry = self._index.entry(i, key)
                if entry is None:
                    return None
                size, stamp = entry
            elif self._ledger.removing(i, key):
                return None  # a delete is under way: its bytes must not be served or promoted
            else:
                size, stamp = None, 0
        if size is None:
            size = level.tier.size_of(key)
            if size is None:
                return None
        if size > self._entry_bound(level):
            self._drop_oversized(i, key, size, stamp)
            return None
        buf = self._scratch.get(size)
        try:
            n = level.tier.get_into(key, buf)
        except Exception:
            level.tier.stats.add(errors=1)
            n = None
        if n is None:
            # Gone or corrupt (the tier removed it): forget that entry. A fault that left it in
            # place (EIO, a raising tier) keeps it, or ``used`` would drift below what the tier
            # holds.
            if level.managed and not level.tier.contains(key):
                with self._lock:
                    self._index.forget_if(i, key, stamp)
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

    def _drop_oversized(self, i: int, key: Key, size: int, stamp: int) -> None:
        """A stored length no chunk can have (forged or foreign): count it corrupt, remove it
        from the tier and the index; the read is a miss. Nothing is allocated for it."""
        level = self._levels[i]
        log.warning("kvtier: tier %s holds %s with %d bytes, over the %d-byte entry bound: removed",
                    level.tier.name, key.hex(), size, self._entry_bound(level))
        level.tier.stats.add(corrupt=1)
        with self._lock:
            self._counters.corrupt += 1
            if level.managed and not self._index.forget_if(i, key, stamp):
                return  # put there again meanwhile: another entry, not this one
            self._ledger.begin_removal(i, key)
        try:
            self._tier_delete(level, key)
        finally:
            self._end_removal(i, key)

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
                if self._closed or self._index.holds(0, key):
                    continue
            if self.read(key, lambda segs: None) is None:
                break  # a chain is worthless past its first missing chunk

    # ----------------------------------------------------------------------------- writes

    def write(self, key: Key, nbytes: int, fill: Fill, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a chunk of ``nbytes``: ``fill(segments)`` copies the payload into the top tier.

        ``parent`` is the key of the chunk before it in its prefix chain (None for the first),
        ``chunk_index`` its position; both feed chain-aware eviction and admission. Returns
        True if the top tier holds the entry afterwards. Lower tiers are written in the
        background. ``fill`` must only copy; it runs outside the store lock, into pages
        reserved for the entry. A concurrent write of the same key gives way (False).
        InvalidKey (a ValueError) when ``key`` or ``parent`` is not a chunk key.
        """
        key = check_key(key)
        if parent is not None:
            parent = check_key(parent)
        top = self._levels[0]
        with self._lock:
            if self._closed:
                return False
            if self._index.holds(0, key):
                return True
            if not self._index.admits_new(key, chunk_index, nbytes):
                self._counters.not_admitted += 1
                return False
            if top.arena is not None:
                if self._ledger.storing(0, key):
                    return False  # another write of this key is filling it now
                segments = self._reserve_top(key, nbytes)
                if segments is None:
                    return False
                gen = self._ledger.begin_copy(key)
                self._ledger.begin_store(0, key)
            else:
                gen = self._ledger.begin_copy(key)
        if top.arena is not None:
            return self._fill_top(key, nbytes, fill, parent, segments, gen)
        try:  # a top tier without an arena: its put is I/O, made outside the lock
            buf = np.empty(nbytes, dtype=np.uint8)
            fill([buf])
            if self._put_level(0, key, parent, buf, gen, queue_lower=True):
                return True
            with self._lock:
                return self._index.holds(0, key)
        finally:
            with self._lock:
                self._ledger.end_copy(key)

    def _reserve_top(self, key: Key, nbytes: int) -> list | None:
        """Make room in the top tier's arena and reserve its pages for ``key`` (lock held);
        the writable segments, or None (counted as a drop)."""
        top = self._levels[0]
        if top.managed and not self._make_room_top(nbytes):
            top.tier.stats.add(dropped=1)
            return None
        segments = top.arena.reserve(key, nbytes)
        if segments is None:
            top.tier.stats.add(dropped=1)
            return None
        if top.managed:
            self._index.reserve(0, nbytes)
        return segments

    def _fill_top(self, key: Key, nbytes: int, fill: Fill, parent: Key | None, segments: list, gen: int) -> bool:
        """Run ``fill`` into reserved top pages (lock not held), then publish the entry and queue
        its lower copies, unless a delete of ``key`` came meanwhile (it wins) or ``fill`` raised
        (re-raised, the pages freed)."""
        top = self._levels[0]
        filled = False
        try:
            fill(segments)
            filled = True
        finally:
            with self._lock:
                stored = filled and not self._ledger.deleted_since(key, gen)  # before end_copy drops the tombstone
                self._ledger.end_store(0, key)
                self._ledger.end_copy(key)
                if top.managed:
                    self._index.unreserve(0, nbytes)
                if filled and not stored:
                    self._counters.cancelled_writes += 1
                if stored:
                    for orphan in self._ledger.supersede(key):  # the new entry serves the key now
                        release_orphan(orphan)
                    top.arena.commit(key)
                    if top.managed:
                        self._index.insert(0, key, nbytes, parent)
                    # Under the same lock hold: an eviction in between would find the key not
                    # yet queued, demote it and leave the write-through copy to miss.
                    self._queue_lower(key, parent)
                else:
                    top.arena.abort(key)
        return stored

    def _store_top(self, key: Key, nbytes: int, fill: Fill, parent: Key | None) -> bool:
        """Make room in the top tier's arena and copy the entry in, all under the lock (a
        promotion: page operations and a memcpy only)."""
        top = self._levels[0]
        if self._ledger.storing(0, key):
            return False
        segments = self._reserve_top(key, nbytes)
        if segments is None:
            return False
        if top.managed:
            self._index.unreserve(0, nbytes)
        try:
            fill(segments)
        except BaseException:
            top.arena.abort(key)
            raise
        top.arena.commit(key)
        if top.managed:
            self._index.insert(0, key, nbytes, parent)
        return True

    def _promote(self, key: Key, data: np.ndarray, source: int, deletes: int) -> None:
        """Copy a lower-tier hit into the top tier (best effort). Skipped when any delete ran
        since the read began (``deletes``: the count then) or one of ``key`` is under way: the
        bytes may be of a deleted key."""
        top = self._levels[0]
        with self._lock:
            if (self._index.holds(0, key) or self._closed or self._ledger.delete_seq != deletes
                    or self._ledger.is_deleting(key)):
                return
            parent = self._index.parent_of(source, key)
            if top.arena is not None:
                if self._store_top(key, data.size, lambda segments: scatter(data, segments), parent):
                    self._counters.promotions += 1
                return
            gen = self._ledger.begin_copy(key)
        try:
            if self._put_level(0, key, parent, data, gen):
                with self._lock:
                    self._counters.promotions += 1
        finally:
            with self._lock:
                self._ledger.end_copy(key)

    def _queue_lower(self, key: Key, parent: Key | None, data: bytes | None = None) -> None:
        """Queue write-through copies of a new top-tier entry for the lower tiers (lock held);
        ``data``: the entry's bytes when the top tier has no arena to read them from later."""
        if not self.config.write_through:
            return
        for i in range(1, len(self._levels)):
            if not self._index.holds(i, key):
                self._writeback.queue_write_through(i, key, parent, data)

    def _copy_down(self, i: int, copy: Copy) -> None:
        """Carry a queued copy out into tier ``i`` (a writer thread), unless the key was deleted
        since it was queued. A write-through copy pins the top entry's pages under the lock and
        reads them after it (one segment is put as it is; more are gathered into this thread's
        scratch), so no copy of the entry runs under the lock."""
        if copy.data is not None:  # a demotion (or a copy from a top tier without an arena) carries its bytes
            self._put_level(i, copy.key, copy.parent, np.frombuffer(copy.data, dtype=np.uint8), copy.gen)
            return
        pinned = ExitStack()
        with pinned:
            with self._lock:
                source = None
                try:
                    deleted = self._ledger.deleted_since(copy.key, copy.gen)
                    source = None if deleted else self._pin_top(copy.key, pinned)
                finally:  # a failed pin must not keep the key's orphan pages forever
                    landing = self._top_read(copy.key, source is not None)
                if deleted:
                    self._counters.cancelled_writes += 1
                    return
                if source is not None:  # until the put below lands, an eviction must not demote it again
                    self._ledger.begin_in_flight(copy.key)
            if source is None:
                self._levels[i].tier.stats.add(dropped=1)
                return
            try:
                self._put_level(i, copy.key, copy.parent, self._contiguous(source), copy.gen)
            finally:
                with self._lock:
                    self._ledger.end_in_flight(copy.key)
                    if landing is not None:  # the key is below now (or the put failed): its pages go
                        release_orphan(self._ledger.landed(copy.key, landing))

    def _top_read(self, key: Key, putting: bool) -> Orphan | None:
        """A write-through copy of ``key`` has read the top level (or given up on it; lock held).
        When it was the last, the key's orphan goes with it: released, or with ``putting`` kept
        landing (reads find the key there) until the copy's put is over; returned then."""
        orphan = self._ledger.read_top(key)
        if orphan is None or not putting:
            release_orphan(orphan)
            return None
        release_orphan(self._ledger.land(key, orphan))
        return orphan

    def _pin_top(self, key: Key, pinned: ExitStack) -> "np.ndarray | Sequence | None":
        """A top-tier entry's bytes for a copy down (lock held): its arena pages pinned in
        ``pinned`` (valid until it closes, whatever happens to the key), the entry's own or, once
        it was evicted, its orphan's; None when the top tier no longer holds it."""
        orphan = self._ledger.orphan(key)
        if orphan is not None:
            views = orphan.hold()
            pinned.callback(self._drop_orphan, orphan)
            return views
        top = self._levels[0]
        if top.arena is None or not self._index.holds(0, key):
            return None
        return pinned.enter_context(top.arena.borrow(key, count=False))

    def _contiguous(self, source: "np.ndarray | Sequence") -> np.ndarray:
        """``source`` as one uint8 array (lock not held): an array, or a single segment, as it
        is; more segments gathered into this thread's scratch."""
        if isinstance(source, np.ndarray):
            return source
        if len(source) == 1:
            return np.asarray(source[0]).reshape(-1).view(np.uint8)
        buf = self._scratch.get(sum(int(seg.nbytes) for seg in source), "snap")
        return buf[: gather_into(source, buf)]

    def _put_level(self, i: int, key: Key, parent: Key | None, data: np.ndarray, gen: int,
                   queue_lower: bool = False) -> bool:
        """Make room in tier ``i`` and write ``data`` there: decisions under the lock, the
        evictions' reads and deletes and the put after it. True when this put landed.

        ``gen``: the copy's delete generation (registered in the ledger). A delete of ``key``
        wins: the copy is skipped if one came before the put, and what the put wrote is removed
        again if one came during it. A put waits for a removal of ``key`` from tier ``i`` that
        is under way, and gives way to another put of ``key`` into tier ``i`` under way.
        ``queue_lower``: queue write-through copies of the entry once it landed (a new entry of
        a top tier without an arena).
        """
        level = self._levels[i]
        removals: list[_Removal] = []
        with self._lock:
            while self._ledger.removing(i, key):
                self._settled.wait(1.0)
            if self._ledger.deleted_since(key, gen):
                self._counters.cancelled_writes += 1
                return False
            if self._ledger.storing(i, key) or self._index.holds(i, key):
                return False
            if level.managed:
                if not self._index.admits(i, key, data.size):
                    level.tier.stats.add(dropped=1)
                    return False
                removals, fits = self._plan_room(i, data.size)
                if not fits:
                    level.tier.stats.add(dropped=1)
                else:
                    self._index.reserve(i, data.size)
            else:
                fits = True
            if fits:
                self._ledger.begin_store(i, key)
        self._carry_out(removals)
        if not fits:
            return False
        ok = undo = False
        try:
            ok = self._tier_put(level, key, data, self.config.element_dtype)
        finally:
            with self._lock:
                if level.managed:
                    self._index.unreserve(i, data.size)
                undo = ok and self._ledger.deleted_since(key, gen)
                if undo:
                    self._counters.cancelled_writes += 1
                elif ok and level.managed:
                    self._index.insert(i, key, data.size, parent)
                elif ok:
                    self._events.record("stored", key, level.tier.medium)
                if ok and not undo and queue_lower:
                    self._queue_lower(key, parent, data.tobytes())
                if not undo:
                    self._ledger.end_store(i, key)
        if undo:  # still marked as storing: no other put of the key into this tier meanwhile
            try:
                self._tier_delete(level, key)
            finally:
                with self._lock:
                    self._ledger.end_store(i, key)
        return ok and not undo

    def _snapshot_top(self, key: Key) -> np.ndarray | None:
        """A copy of a top-tier entry of its own (lock held: one memcpy out of the arena), or
        None."""
        top = self._levels[0]
        size = self._index.size_of(0, key)
        if size is None or top.arena is None:
            return None
        segments = top.arena.views(key, count=False)
        if segments is None:
            return None
        buf = np.empty(size, dtype=np.uint8)
        return buf[: gather_into(segments, buf)]

    def _keep_orphan(self, key: Key) -> bool:
        """Pin an evicted top entry's pages for its write-through copies still queued (lock
        held): nothing is copied, and the arena frees the pages once the last copy read them.
        Whether they were kept (False: the arena no longer had the entry)."""
        pin = ExitStack()
        views = pin.enter_context(self._levels[0].arena.borrow(key, count=False))
        orphan = Orphan(pin, views, self._index.size_of(0, key) or 0, self._detached) if views is not None else None
        if orphan is not None and self._ledger.keep_orphan(key, orphan):
            return True
        pin.close()
        return False

    def _drop_orphan(self, orphan: Orphan) -> None:
        """A copy is done reading ``orphan``'s pages (lock not held)."""
        with self._lock:
            orphan.drop()

    # ----------------------------------------------------------------------------- tier I/O (lock not held)

    @staticmethod
    def _tier_put(level: _Level, key: Key, data: np.ndarray, dtype: str = "uint8") -> bool:
        """``level``'s put (of elements of ``dtype`` when they divide the bytes: a tier codec's
        element width); a raising tier is a counted error and a failed put."""
        if dtype != "uint8" and data.nbytes % DTYPES[dtype][1]:
            dtype = "uint8"
        try:
            return bool(level.tier.put(key, data, dtype))
        except Exception as exc:  # a tier must not raise, but a buggy one may
            log.warning("kvtier: write to tier %s failed: %s", level.tier.name, exc)
            level.tier.stats.add(errors=1)
            return False

    @staticmethod
    def _tier_delete(level: _Level, key: Key) -> None:
        """``level``'s delete; a raising tier is a counted error."""
        try:
            level.tier.delete(key)
        except Exception as exc:
            log.warning("kvtier: delete from tier %s failed: %s", level.tier.name, exc)
            level.tier.stats.add(errors=1)

    def _end_removal(self, i: int, key: Key) -> None:
        """A tier delete of ``key`` from tier ``i`` is over: puts waiting on it may go."""
        with self._lock:
            self._ledger.end_removal(i, key)
            self._settled.notify_all()

    # ----------------------------------------------------------------------------- eviction

    def _make_room_top(self, nbytes: int) -> bool:
        """Evict from the top tier's arena until ``nbytes`` fit (lock held). False if they
        can't."""
        arena = self._levels[0].arena
        # A paged tier (RAM) rounds each entry up to whole pages: payload bytes under capacity
        # do not mean a free run for the new entry, so ask the tier what the entry takes.
        need = arena.footprint(nbytes)
        if need > arena.arena_bytes:  # never fits, whatever goes (a coded arena's raw budget is 16 x its pages)
            return False
        orphaned = False  # this room-making evicted an entry whose pages stay pinned (an orphan)
        while True:
            step = self._index.plan_room(0, nbytes, need, arena.free_bytes)
            if step is Room.FITS:
                return True
            if step is Room.NEVER:
                return self._unpin_orphans(nbytes, need)
            # An entry whose copies wait gives no room when evicted; the next victim gives it.
            # When that one would stay pinned too, one copy out makes the room: evicting on
            # would empty a top tier whose entries all wait for their copies, for one entry.
            if orphaned and self._pins_on_eviction(step.key) and self._unpin_orphans(nbytes, need):
                return True
            orphaned |= self._evict_top(step)

    def _pins_on_eviction(self, key: Key) -> bool:
        """Whether evicting top entry ``key`` now keeps its pages pinned as an orphan (lock held)."""
        return self._ledger.is_queued(key) and self._ledger.orphan(key) is None

    def _unpin_orphans(self, nbytes: int, need: int) -> bool:
        """Room for an entry of ``nbytes`` (``need`` in the arena) from the orphans' pinned pages
        (lock held): copy orphans out, the oldest first, until the arena can free enough;
        whether the entry fits then. Each orphan is copied at most once (a detached one is
        skipped), and none is copied when copying every detachable one out could not make the
        room (the payload budget is short, or their pages and the free ones are fewer than
        ``need``): a write that fails anyway costs no copy. Only when the lower writers fall
        behind does an eviction cost a copy."""
        arena = self._levels[0].arena
        orphans = [orphan for orphan in self._ledger.orphans() if orphan.detachable]
        if not orphans or self._index.room(0) < nbytes:
            return False
        if arena.free_bytes() + sum(arena.footprint(orphan.nbytes) for orphan in orphans) < need:
            return False
        for orphan in orphans:
            if not orphan.detach():
                continue
            self._step_gate.wake()  # memory past the top tier's capacity now: held writers go
            if self._index.plan_room(0, nbytes, need, arena.free_bytes) is Room.FITS:
                return True
        return False

    def _evict_top(self, ev: Eviction) -> bool:
        """Evict an entry of the top tier's arena (lock held: page operations and memcpys
        only): keep its pages pinned for write-through copies still queued, or queue a copy of
        its bytes for demotion. Whether its pages stay pinned (an orphan was kept)."""
        key, top, ledger = ev.key, self._levels[0], self._ledger
        orphaned = False
        if self._pins_on_eviction(key):  # lower writes still pending: their pages stay theirs
            orphaned = self._keep_orphan(key)
        elif ev.demote_to is not None and ledger.demotable(key):  # never while one is queued
            snap = self._snapshot_top(key)
            if snap is not None:
                gen = ledger.begin_copy(key)
                self._writeback.queue_demotion(ev.demote_to, key, self._index.parent_of(0, key), snap, gen)
        top.arena.delete(key)
        top.tier.stats.add(evictions=1)
        self._counters.evictions += 1
        self._index.forget(0, key)
        return orphaned

    def _plan_room(self, i: int, nbytes: int) -> tuple[list[_Removal], bool]:
        """Decide the evictions from managed tier ``i`` (not an arena) that make ``nbytes`` fit
        (lock held): each victim is forgotten and marked as being removed now, its tier I/O is
        ``_carry_out``'s. The removals, and whether the entry fits after them."""
        removals = []
        while True:
            step = self._index.plan_room(i, nbytes, nbytes, None)
            if step is Room.FITS or step is Room.NEVER:
                return removals, step is Room.FITS
            removals.append(self._decide_removal(step))

    def _decide_removal(self, ev: Eviction) -> _Removal:
        """Take an eviction's victim out of the index (lock held). A demotion is registered in
        the ledger now, so that a delete before its bytes are read wins over it."""
        i, key = ev.level, ev.key
        size, parent = self._index.size_of(i, key), self._index.parent_of(i, key)
        gen = None
        if ev.demote_to is not None and self._ledger.demotable(key):
            gen = self._ledger.begin_copy(key)
        self._index.forget(i, key)
        self._ledger.begin_removal(i, key)
        self._counters.evictions += 1
        return _Removal(i, key, size, parent, ev.demote_to if gen is not None else None, gen)

    def _carry_out(self, removals: list[_Removal]) -> None:
        """The tier I/O of decided evictions (lock not held): read a demoted victim's bytes,
        delete it, then queue the demotion."""
        for r in removals:
            level = self._levels[r.level]
            data = None
            try:
                if r.gen is not None:
                    data = self._read_for_demotion(level, r.key, r.size)
                self._tier_delete(level, r.key)
                level.tier.stats.add(evictions=1)
            finally:
                with self._lock:
                    self._ledger.end_removal(r.level, r.key)
                    self._settled.notify_all()
                    if r.gen is not None and data is None:
                        self._ledger.end_copy(r.key)
                    elif r.gen is not None:
                        self._writeback.queue_demotion(r.demote_to, r.key, r.parent, data, r.gen)

    @staticmethod
    def _read_for_demotion(level: _Level, key: Key, size: int) -> bytes | None:
        """An evicted entry's bytes (lock not held), or None when they cannot be read."""
        buf = np.empty(size, dtype=np.uint8)
        try:
            n = level.tier.get_into(key, buf)
        except Exception:
            level.tier.stats.add(errors=1)
            return None
        return None if n is None else buf[:n].tobytes()

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
        it back (see the module notes). InvalidKey when ``key`` is not a chunk key. True.

        Decided under the lock (the ledger's tombstone, the index, the top arena's pages); the
        lower tiers' deletes run after it, on this thread, before the call returns."""
        key = check_key(key)
        removals = []
        with self._lock:
            for orphan in self._ledger.begin_delete(key):
                release_orphan(orphan)
            self._step_gate.wake()  # a writer holding a copy of it may let go at once
            for i, level in enumerate(self._levels):
                if level.managed and not self._index.holds(i, key):
                    continue
                if level.managed:
                    self._index.forget(i, key)
                if i == 0 and level.arena is not None:
                    level.arena.delete(key)  # page frees in this process's memory
                    continue
                self._ledger.begin_removal(i, key)
                removals.append(i)
        done = 0
        try:
            for i in removals:
                self._tier_delete(self._levels[i], key)
                self._end_removal(i, key)
                done += 1
        finally:
            with self._lock:
                for i in removals[done:]:  # an interrupt left these undone: release them all the same
                    self._ledger.end_removal(i, key)
                self._ledger.end_delete(key)
                self._settled.notify_all()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued lower-tier writes are done; False on timeout."""
        return self._writeback.flush(timeout)

    def _may_hold_copy(self, key: Key) -> bool:
        """Whether a writer may hold ``key``'s write-through copy for the engine's step: the top
        level still serves the key, from its index or, once evicted, from the orphan its copy
        keeps (``read`` and ``lookup`` find orphans too), and no orphan was copied out of the
        arena to make room (memory past the top tier's capacity until the copies land: the
        copy-out wakes the writers). Asked by the writers without the lock: dict and int reads."""
        return (self._index.holds(0, key) or self._ledger.has_orphan(key)) and not self._detached.total

    def engine_step(self, running: bool) -> None:
        """The engine's step (its forward pass) starts (True) or ends (False): with
        ``writer_step_wait_s`` the lower tiers' writers hold their copies while one runs."""
        self._step_gate.step(running)

    def stats(self) -> dict:
        """Store counters and, per tier, capacity, usage, queue depth, the tier's own counters and
        its codec (``codec``: the setting and, for ``auto``, the choice and its inputs).

        The lock is held only to copy the store's own figures; a self-managed tier's usage
        (its ``used_bytes``) is asked afterwards, on this thread."""
        with self._lock:
            counters = dict(self._counters.__dict__)
            figures = [(self._index.used(i), self._index.entries(i), self._writeback.depth(i))
                       for i in range(len(self._levels))]
        tiers = []
        for level, (used, entries, depth) in zip(self._levels, figures):
            tier = level.tier
            tiers.append({
                "name": tier.name,
                "type": type(tier).__name__,
                "medium": tier.medium,
                "capacity_bytes": tier.capacity_bytes,
                "used_bytes": used if level.managed else tier.used_bytes(),
                "entries": entries,
                "queue_depth": depth,
                **tier.stats.as_dict(),
                "codec": tier.codec_state(),
            })
        return {**counters, "tiers": tiers}

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes (for up to about ``timeout`` seconds), stop the workers and
        close every tier. Writes still queued then (a stuck tier) are dropped and counted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        self._step_gate.close()  # no step runs any more (a later engine_step is ignored): nothing waits for one
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


def _as_key(key: Key) -> Key | None:
    """``key`` as the store holds it (bytes; a bytearray or memoryview is hashed by its bytes),
    or None when it is not a valid key."""
    return check_key(key) if is_valid_key(key) else None


def _valid_prefix(keys: Sequence[Key]) -> Sequence[Key]:
    """The leading run of ``keys`` that are chunk keys, as the store holds them (bytes: a
    bytearray or memoryview is hashed by its bytes); ``keys`` itself when all are bytes keys."""
    n = 0
    for key in keys:
        if not is_valid_key(key):
            break
        n += 1
    run = keys if n == len(keys) else keys[:n]
    return run if all(type(key) is bytes for key in run) else [check_key(key) for key in run]

"""The store's bookkeeping: which key lives in which level, how big, in which prefix chain,
and what to evict, as decisions; no I/O, no threads, no tiers.

A *level* is one tier of the store, fastest first. A managed level has an eviction policy and
an exact index of its keys (sizes, parents, children); a self-managed (shared) level has none:
the tier itself keeps its budget and is asked directly.

``plan_room`` answers "what must go for ``nbytes`` to fit" one step at a time: ``Room.FITS``,
``Room.NEVER`` or an ``Eviction`` naming the key, the level and where its bytes should go. Within
a prefix chain the tail is evicted first (a chunk is worth nothing without those before it).
The caller carries the eviction out and asks again (a paged tier's free bytes change only once
pages are actually freed).

Not thread-safe: the store calls it under its lock. Imports: ``kvtier.keys``,
``kvtier.policies`` (protocols and admission), ``kvtier.store.events``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from kvtier.keys import Key
from kvtier.policies.admission import Admission
from kvtier.policies.base import EvictionPolicy
from kvtier.store.events import EventLog


class Room(Enum):
    """An outcome of ``plan_room`` other than an eviction."""

    FITS = "fits"  # the entry fits now
    NEVER = "never"  # it cannot fit (larger than the level, or nothing left to evict)


@dataclass(frozen=True)
class Eviction:
    """Evict ``key`` from level ``level``; ``demote_to`` is the next level when it is managed
    and does not hold the key yet (its bytes should be copied there first), else None."""

    key: Key
    level: int
    demote_to: int | None


@dataclass
class Counters:
    """The store's counters (bookkeeping; the store increments them under its lock)."""

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
    prefetch_drops: int = 0  # prefetch requests dropped because the prefetch queue was full
    step_waits: int = 0  # lower-tier copies held while the engine's step ran (writer_step_wait_s)
    step_wait_seconds: float = 0.0  # their waits, in all


@dataclass
class LevelIndex:
    """What the store knows of one level."""

    name: str
    medium: str
    capacity: int
    policy: EvictionPolicy | None  # None: the tier manages its own capacity
    sizes: dict[Key, int] = field(default_factory=dict)  # key -> payload bytes (managed levels)
    parent: dict[Key, Key] = field(default_factory=dict)  # key -> parent key, for chain-aware eviction
    children: dict[Key, set[Key]] = field(default_factory=dict)  # parent key -> child keys
    stamps: dict[Key, int] = field(default_factory=dict)  # key -> which insert made the entry
    used: int = 0
    reserved: int = 0  # bytes promised to puts under way outside the store's lock

    @property
    def managed(self) -> bool:
        return self.policy is not None

    def holds(self, key: Key) -> bool:
        return key in self.sizes

    def chain_tail(self, key: Key) -> Key:
        """The last resident descendant of ``key`` in its prefix chain (``key`` if none)."""
        seen = {key}
        while True:
            kids = self.children.get(key)
            if not kids:
                return key
            nxt = next(iter(kids))
            if nxt in seen:  # a caller-made cycle (a chunk named as its own ancestor)
                return key
            seen.add(nxt)
            key = nxt


class StoreIndex:
    """Levels' indexes, admission and eviction decisions (see the module docstring)."""

    def __init__(self, levels: Sequence[LevelIndex], admission: Admission, events: EventLog):
        self.levels = list(levels)
        self._admission = admission
        self._events = events
        self._stamp = 0

    def __getitem__(self, i: int) -> LevelIndex:
        return self.levels[i]

    # ----------------------------------------------------------------------------- queries

    def holds(self, i: int, key: Key) -> bool:
        """Whether managed level ``i`` holds ``key`` (False for a self-managed level)."""
        return key in self.levels[i].sizes

    def size_of(self, i: int, key: Key) -> int | None:
        """Payload bytes of ``key`` in managed level ``i``, or None."""
        return self.levels[i].sizes.get(key)

    def parent_of(self, i: int, key: Key) -> Key | None:
        """The chunk before ``key`` in its prefix chain, as level ``i`` recorded it, or None."""
        return self.levels[i].parent.get(key)

    def entry(self, i: int, key: Key) -> tuple[int, int] | None:
        """``(size, stamp)`` of ``key`` in managed level ``i``, or None. The stamp names the
        insert that made the entry: ``forget_if`` takes it to forget that entry only."""
        level = self.levels[i]
        size = level.sizes.get(key)
        return None if size is None else (size, level.stamps.get(key, 0))

    def entries(self, i: int) -> int | None:
        """How many entries managed level ``i`` holds (None for a self-managed level)."""
        level = self.levels[i]
        return len(level.sizes) if level.managed else None

    def used(self, i: int) -> int | None:
        """Payload bytes managed level ``i`` holds (None for a self-managed level)."""
        level = self.levels[i]
        return level.used if level.managed else None

    def room(self, i: int) -> int | None:
        """Payload bytes managed level ``i`` can still take before ``plan_room`` evicts (its
        capacity less what it holds and what puts under way were promised; None for a
        self-managed level)."""
        level = self.levels[i]
        return max(0, level.capacity - level.used - level.reserved) if level.managed else None

    def leading_held(self, keys: Sequence[Key], also: Callable[[Key], bool] | None = None) -> int:
        """How many leading ``keys`` some managed level holds (or ``also`` says are present)."""
        managed = [level for level in self.levels if level.managed]
        n = 0
        for key in keys:
            if not any(level.holds(key) for level in managed) and not (also is not None and also(key)):
                break
            n += 1
        return n

    def first_holder(self, key: Key) -> str | None:
        """Name of the first managed level holding ``key``, or None."""
        for level in self.levels:
            if level.managed and level.holds(key):
                return level.name
        return None

    def in_top(self, keys: Sequence[Key]) -> list[bool]:
        """For each key, whether the top level holds it (False for all if it is unmanaged)."""
        top = self.levels[0]
        if not top.managed:
            return [False] * len(keys)
        return [top.holds(k) for k in keys]

    # ----------------------------------------------------------------------------- policy calls

    def admits_new(self, key: Key, chunk_index: int, nbytes: int) -> bool:
        """Whether a new chunk may enter the top level: the store's admission (by chain
        position) and the top level's policy both agree."""
        if not self._admission.admit(key, chunk_index + 1):
            return False
        top = self.levels[0]
        return not top.managed or top.policy.admit(key, nbytes)

    def admits(self, i: int, key: Key, nbytes: int) -> bool:
        """Whether managed level ``i``'s policy takes ``key`` (a copy coming down)."""
        return self.levels[i].policy.admit(key, nbytes)

    def accessed(self, i: int, key: Key) -> None:
        """A read of ``key`` from managed level ``i`` (if it still holds it)."""
        level = self.levels[i]
        if level.managed and level.holds(key):
            level.policy.access(key)

    def missed(self, i: int, key: Key) -> None:
        """A read that did not find ``key`` in managed level ``i``."""
        level = self.levels[i]
        if level.managed:
            level.policy.miss(key)

    # ----------------------------------------------------------------------------- changes

    def learn(self, i: int, key: Key, size: int) -> None:
        """Record an entry found in level ``i`` at start (no event: it was there before)."""
        level = self.levels[i]
        if key not in level.sizes:
            level.sizes[key] = size
            level.stamps[key] = self._next_stamp()
            level.used += size
            level.policy.insert(key, size)

    def insert(self, i: int, key: Key, size: int, parent: Key | None) -> None:
        """Record a new entry of managed level ``i`` (a "stored" event)."""
        level = self.levels[i]
        self._events.record("stored", key, level.medium)
        level.sizes[key] = size
        level.stamps[key] = self._next_stamp()
        level.used += size
        level.policy.insert(key, size)
        if parent is not None:
            level.parent[key] = parent
            level.children.setdefault(parent, set()).add(key)

    def forget(self, i: int, key: Key) -> bool:
        """Drop ``key`` from managed level ``i`` (a "removed" event); False if not held."""
        level = self.levels[i]
        size = level.sizes.pop(key, None)
        if size is None:
            return False
        self._events.record("removed", key, level.medium)
        level.stamps.pop(key, None)
        level.used -= size
        level.policy.remove(key)
        parent = level.parent.pop(key, None)
        if parent is not None:
            kids = level.children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del level.children[parent]
        return True

    def forget_if(self, i: int, key: Key, stamp: int) -> bool:
        """``forget`` the entry of ``key`` in level ``i`` only if it is still the one ``stamp``
        names (not one put there again since); False otherwise."""
        if self.levels[i].stamps.get(key) != stamp:
            return False
        return self.forget(i, key)

    def reserve(self, i: int, nbytes: int) -> None:
        """Promise ``nbytes`` of level ``i`` to a put under way (``plan_room`` counts them);
        ``unreserve`` follows, whether or not the put landed."""
        self.levels[i].reserved += nbytes

    def unreserve(self, i: int, nbytes: int) -> None:
        self.levels[i].reserved -= nbytes

    def _next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    # ----------------------------------------------------------------------------- eviction

    def plan_room(self, i: int, nbytes: int, need: int, free_bytes: Callable[[], int] | None) -> Room | Eviction:
        """The next step to fit an entry of ``nbytes`` payload into managed level ``i``.

        ``need`` is what the entry occupies in the tier (a paged tier rounds up to whole
        pages) and ``free_bytes`` asks the tier for its free room (None: payload bytes under
        capacity are room enough). Changes nothing: the caller carries an Eviction out
        (``forget`` among it) and asks again.
        """
        level = self.levels[i]
        if need > level.capacity:
            return Room.NEVER
        if level.used + level.reserved + nbytes <= level.capacity and (free_bytes is None or free_bytes() >= need):
            return Room.FITS
        victim = level.policy.victim()
        if victim is None:
            return Room.NEVER
        key = level.chain_tail(victim)
        nxt = self.levels[i + 1] if i + 1 < len(self.levels) else None
        demote_to = i + 1 if nxt is not None and nxt.managed and not nxt.holds(key) else None
        return Eviction(key, i, demote_to)

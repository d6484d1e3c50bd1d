"""CopyLedger: the store's bookkeeping of copies and removals under way, as pure state.

No threads, no I/O, no tiers: the store calls it under its lock and acts on its answers.

What it tracks, per key:
- *pending* copies: every lower-level copy queued, running, or being read for a demotion;
  while one is pending a delete leaves a *tombstone* (a delete generation). A copy carries the
  generation it was registered under; ``deleted_since`` tells the code carrying it out that a
  delete came after (skip it, or undo what its put wrote). A tombstone goes with the last
  pending copy of its key, so tombstones never pile up.
- *queued* write-through copies that have yet to read the top level, and *orphans*: what the
  store keeps of a top entry evicted before those copies read it (its pinned pages: an opaque
  object here). An orphan goes with the last such copy, or with a delete: the call that lets go
  of it returns it, and the store releases it. The last copy keeps it *landing* while its put
  runs: reads find the key there until it lands below (``readable_orphan``). A new top entry of
  the key, or a delete, lets go of both at once.
- *in-flight* write-through copies: they hold their bytes and have not landed; an eviction must
  not demote the key as well.
- *removals*: a tier delete of ``(level, key)`` decided under the lock and carried out outside
  it (a ``delete``, an eviction, a corrupt entry dropped). A put of that key into that level
  waits until it ends, or the removal could take the new entry away behind the index's back.
- *stores*: a put of ``(level, key)`` under way outside the lock; another put of the same key
  into the same level gives way meanwhile (one entry, counted once).
- *deletes* under way (decided, tier I/O not finished): reads of self-managed levels miss and
  promotions are skipped meanwhile, so a key being deleted is not brought back into the top.

The interleavings it settles (each has a test in tests/store/test_ledger.py):
- delete during a queued copy: the copy's generation is stale when it runs: skipped.
- delete during an in-flight copy: stale after its put: the put is undone.
- delete during a demotion (bytes being read outside the lock): the demotion was registered
  as pending when it was decided, so the delete tombstones it and it is skipped when it runs.
- re-put after delete: a copy registered after the delete carries the new generation and lands.
- re-put of an orphaned key: the new entry supersedes the orphan (and a landing one): reads
  and the copies still queued take the new entry.
"""

from __future__ import annotations

from kvtier.keys import Key


def _inc(counts: dict, key) -> None:
    counts[key] = counts.get(key, 0) + 1


def _dec(counts: dict, key) -> int:
    """Decrement ``counts[key]``, dropping it at zero; the count left."""
    n = counts.get(key, 0) - 1
    if n <= 0:
        counts.pop(key, None)
        return 0
    counts[key] = n
    return n


class CopyLedger:
    """In-flight / queued / deleted-since bookkeeping of a store (see the module notes)."""

    def __init__(self) -> None:
        self._pending: dict[Key, int] = {}  # key -> lower copies queued, running or being read
        self._tombs: dict[Key, int] = {}  # key -> delete generation, kept while copies are pending
        self._queued: dict[Key, int] = {}  # key -> write-through copies still to read the top level
        self._in_flight: dict[Key, int] = {}  # key -> write-through copies holding bytes, not landed
        self._orphans: dict[Key, object] = {}  # top entries evicted before their copies read them
        self._landing: dict[Key, object] = {}  # orphans read by their last copy, its put not landed
        self._removals: dict[tuple[int, Key], int] = {}  # (level, key) -> tier deletes under way
        self._deleting: dict[Key, int] = {}  # key -> deletes whose tier I/O is under way
        self._stores: set[tuple[int, Key]] = set()  # (level, key) puts under way
        self._delete_seq = 0  # deletes so far

    # ----------------------------------------------------------------------------- copies

    def begin_copy(self, key: Key) -> int:
        """Register one more lower copy of ``key`` (a demotion, a promotion, a put); its delete
        generation, which the copy carries. ``end_copy`` follows, whatever happens to it."""
        _inc(self._pending, key)
        return self._tombs.get(key, 0)

    def end_copy(self, key: Key) -> None:
        """A copy of ``key`` is done, dropped or skipped; the tombstone goes with the last."""
        if not _dec(self._pending, key):
            self._tombs.pop(key, None)

    def begin_write_through(self, key: Key) -> int:
        """Register a write-through copy (it reads the top level when it runs); its generation.
        ``read_top`` follows when it has read (or given up on) the top, ``end_copy`` when done."""
        _inc(self._queued, key)
        return self.begin_copy(key)

    def read_top(self, key: Key) -> object | None:
        """A write-through copy of ``key`` has read (or given up on) the top level. The orphan
        goes with the last one: returned (the caller releases it), else None."""
        if not _dec(self._queued, key):
            return self._orphans.pop(key, None)
        return None

    def deleted_since(self, key: Key, gen: int) -> bool:
        """Whether ``key`` was deleted after a copy registered under generation ``gen``."""
        return self._tombs.get(key, 0) != gen

    def is_queued(self, key: Key) -> bool:
        """Whether a write-through copy of ``key`` has yet to read the top level."""
        return key in self._queued

    def is_in_flight(self, key: Key) -> bool:
        """Whether a write-through copy of ``key`` holds its bytes and has not landed."""
        return key in self._in_flight

    def demotable(self, key: Key) -> bool:
        """Whether an eviction may demote ``key``: no write-through copy of it is on its way."""
        return key not in self._queued and key not in self._in_flight

    def begin_in_flight(self, key: Key) -> None:
        """A write-through copy of ``key`` holds its bytes (``end_in_flight`` follows)."""
        _inc(self._in_flight, key)

    def end_in_flight(self, key: Key) -> None:
        """That copy landed, failed or was cancelled."""
        _dec(self._in_flight, key)

    def orphan(self, key: Key) -> object | None:
        """What is kept of a top entry evicted before its write-through copies read it."""
        return self._orphans.get(key)

    def readable_orphan(self, key: Key) -> object | None:
        """The orphan that serves reads of ``key`` now: one kept for its queued copies, else one
        whose last copy is landing; None."""
        return self._orphans.get(key) or self._landing.get(key)

    def has_orphan(self, key: Key) -> bool:
        """Whether an orphan serves reads of ``key`` now (``readable_orphan``). The one query a
        writer may make without the store's lock (dict lookups: ``TieredStore._may_hold_copy``)."""
        return key in self._orphans or key in self._landing

    def land(self, key: Key, orphan: object) -> object | None:
        """The last copy of ``key`` read ``orphan`` (``read_top`` returned it) and puts it now:
        it serves reads until ``landed``. Returns a landing orphan it supersedes (the caller
        releases it), else None."""
        old = self._landing.get(key)
        self._landing[key] = orphan
        return old if old is not orphan else None

    def landed(self, key: Key, orphan: object) -> object | None:
        """That copy's put is over (landed or not): ``orphan`` goes, returned for the caller
        to release, unless a new entry or a delete let go of it first (None)."""
        if self._landing.get(key) is orphan:
            return self._landing.pop(key)
        return None

    def supersede(self, key: Key) -> list:
        """A new top entry of ``key`` was published: its orphans (kept, landing) go, returned
        for the caller to release; the copies still queued read the new entry."""
        return [o for o in (self._orphans.pop(key, None), self._landing.pop(key, None)) if o is not None]

    def orphans(self) -> list:
        """Every orphan kept now, the oldest first."""
        return list(self._orphans.values())

    def keep_orphan(self, key: Key, orphan: object) -> bool:
        """Keep ``orphan`` (an evicted top entry) for the write-through copies of ``key`` still
        queued; False (not kept: the caller releases it) when none is queued, since nothing else
        would let go of it, or when one is kept already."""
        if key not in self._queued or key in self._orphans:
            return False
        self._orphans[key] = orphan
        return True

    # ----------------------------------------------------------------------------- deletes, removals

    def begin_delete(self, key: Key) -> list:
        """A delete of ``key`` was decided: pending copies see it and yield, and until
        ``end_delete`` it counts as being deleted. Its orphans (kept, landing) go: returned
        (the caller releases them)."""
        self._delete_seq += 1
        if key in self._pending:
            self._tombs[key] = self._tombs.get(key, 0) + 1
        _inc(self._deleting, key)
        return self.supersede(key)

    def end_delete(self, key: Key) -> None:
        """That delete's tier I/O is over."""
        _dec(self._deleting, key)

    def is_deleting(self, key: Key) -> bool:
        """Whether a delete of ``key`` has tier I/O under way."""
        return key in self._deleting

    @property
    def delete_seq(self) -> int:
        """Deletes decided so far (a read that saw another count meanwhile must not promote)."""
        return self._delete_seq

    def begin_removal(self, level: int, key: Key) -> None:
        """A tier delete of ``key`` from ``level`` will run outside the lock (``end_removal``)."""
        _inc(self._removals, (level, key))

    def end_removal(self, level: int, key: Key) -> None:
        """That tier delete is over."""
        _dec(self._removals, (level, key))

    def removing(self, level: int, key: Key) -> bool:
        """Whether a tier delete of ``key`` from ``level`` is under way (a put must wait)."""
        return (level, key) in self._removals

    def begin_store(self, level: int, key: Key) -> None:
        """A put of ``key`` into ``level`` will run outside the lock (``end_store`` follows)."""
        self._stores.add((level, key))

    def end_store(self, level: int, key: Key) -> None:
        """That put landed, failed or was undone."""
        self._stores.discard((level, key))

    def storing(self, level: int, key: Key) -> bool:
        """Whether a put of ``key`` into ``level`` is under way (another one gives way)."""
        return (level, key) in self._stores

    def idle(self) -> bool:
        """Whether nothing is pending, kept or under way (for tests and checks)."""
        return not (self._pending or self._tombs or self._queued or self._in_flight or self._orphans
                    or self._landing or self._removals or self._deleting or self._stores)

"""The RAM tier: one preallocated arena of fixed pages; an entry is a list of extents.

The arena is allocated once (a pinned torch tensor's numpy view where CUDA is present, ordinary
memory otherwise) and never grows, so resident memory stays flat over any number of put/delete
cycles: a put takes free pages and copies into them, a delete gives the pages back. Free pages sit
in a min-heap, so an allocation takes the lowest free pages and tends to be one contiguous run.

Beyond the ``Tier`` protocol the tier offers a zero-copy path for a connector:
``views``/``borrow`` give read-only views of an entry's extents, and ``reserve``/``commit``/
``abort`` let a caller copy straight into arena pages.

The tier does not evict. When there is no room, ``put`` returns False (``stats.dropped``); the
store makes room first.

A coded arena (``codec: lossless``, ``kvtier serve``'s arena only) holds more entries in the
same pages: every entry is written raw (a reservation of its raw size, filled by one copy, as
before), and once committed a background coder thread of the tier encodes it (Blosc2
bit-shuffle + zstd-1 at the KV's element width, ``kvtier.codecs``), moves the coded bytes into the
entry's first pages and frees the rest. The entry then records its codec, raw length, stored
length and the xxh3-64 checksum of its raw bytes. Encoding runs on that thread, never on a
writer's path or under the store's lock. Readers get raw bytes wherever they do not ask for the
stored form: ``get_into`` and ``views`` decode (checksum verified), ``borrow`` yields a segment
decoded on first use; ``borrow_stored`` hands out the coded pages themselves (the server leases
them to clients, which decode). ``capacity_bytes`` of a coded arena is its raw-byte budget
(``CODED_BUDGET`` x its arena bytes): the pages, which ``free_bytes`` reports, are the limit.
"""

from __future__ import annotations

import errno
import heapq
import logging
import mmap
import os
import threading
import time
from abc import abstractmethod
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from collections import deque
from collections.abc import Sequence
from typing import Iterator, Literal, NamedTuple

import numpy as np

from kvtier.buffers import Scratch, gather_into, scatter
from kvtier.codecs import LOSSLESS_ID, decode_into
from kvtier.config import Size, out_of_range, ranged, validate
from kvtier.entry import DTYPES, MAX_NDIM, checksum
from kvtier.errors import ConfigError, CorruptEntry, OutOfSpace
from kvtier.fileio import unlink_quietly
from kvtier.keys import Key
from kvtier.tiers.base import RankShare, SchedulerView, Tier

log = logging.getLogger(__name__)

CODED_BUDGET = 16  # a coded arena's raw-byte budget (capacity_bytes) over its arena bytes
DEFAULT_ELEMENT_BYTES = 2  # the shuffle width while the KV dtype is unknown (uint8): bf16/fp16 KV
_CODER_QUEUE = 65536  # keys waiting for the coder; more are left raw (counted as queue_full)
PAGE_SIZE = 256 * 1024  # a raw arena's default page
CODED_PAGE_SIZE = 16 * 1024  # a coded arena's: rounding a coded entry up costs at most this
_CODER_LOG_EVERY_S = 60.0  # a failing coder logs at most one line this often (the first with its traceback)
_CODER_RETRIES = 3  # encodes of an entry a reader took while it was encoded, before it stays raw


@dataclass(frozen=True)
class RamConfig:
    """Configuration of a RAM tier.

    capacity: arena bytes (rounded down to whole pages), e.g. "2GiB".
    page_size: allocation unit; an entry occupies ceil(size / page_size) pages. 0 (the default)
        is 256 KiB, or 16 KiB for a coded arena: a coded entry's last page is partly empty, and
        with 256 KiB pages a 1 MiB chunk coded to 0.69 MiB still takes three of four pages (a
        256 KiB chunk all of its one).
    pin_memory: "auto" pins the arena when torch with CUDA is present; true asks for it (falls back
        to ordinary memory with a warning when CUDA is absent); false never pins.
    prefault: touch every arena page at construction, so resident memory is the full arena from
        the start instead of growing up to it on first use.
    shm_path: back the arena with this new file (e.g. under /dev/shm, mode 0600) so other
        processes of the same user can map it (the per-node cache server); the file is created
        exclusively and removed on ``close``. Never pinned.
    codec: ``lossless`` codes every entry in the background into fewer pages (see the module
        notes); only for ``kvtier serve``'s arena (a shared arena, where capacity is the limit):
        an engine's own RAM tier refuses it and stays raw (``none``, the default).
    """

    capacity: Size = ranged(Size(1024**3), ge=1)
    page_size: Size = ranged(Size(0), ge=0)
    pin_memory: Literal["auto"] | bool = "auto"
    prefault: bool = False
    shm_path: str | None = None
    codec: Literal["none", "lossless"] = "none"

    def __post_init__(self):
        if not self.page_size:  # 0: the default for the codec
            object.__setattr__(self, "page_size", Size(CODED_PAGE_SIZE if self.codec != "none" else PAGE_SIZE))

    def check(self, where: str) -> None:
        """Across fields: the arena holds at least one page (``config.validate`` calls this)."""
        if self.page_size > self.capacity:
            raise out_of_range(f"{where}.page_size", self.page_size, f"[1, capacity={self.capacity}]")


class _Entry:
    """One stored (or reserved) entry: its byte extents in the arena and its metadata."""

    __slots__ = ("pages", "extents", "length", "dtype", "shape", "readers", "dead", "codec", "stored",
                 "checksum", "moving", "deferred")

    def __init__(self, pages: list[int], extents: list[tuple[int, int]], length: int,
                 dtype: str, shape: tuple[int, ...]):
        self.pages = pages  # page numbers, freed when the entry dies and has no readers
        self.extents = extents  # (start byte, end byte) runs covering exactly ``stored`` bytes
        self.length = length  # raw bytes (what a reader gets)
        self.stored = length  # bytes in the pages: the coded length once coded
        self.codec = 0  # 0 raw, else the codec id of the stored bytes (kvtier.codecs)
        self.checksum = 0  # xxh3-64 of the raw bytes (set when coded)
        self.moving = False  # the coder is rewriting its pages: acquirers wait, its pages stay
        self.deferred: tuple[Key, int] | None = None  # (key, attempt) for the coder once its readers are gone
        self.dtype = dtype
        self.shape = shape
        self.readers = 0  # copies in progress outside the lock; pages are freed only at 0
        self.dead = False  # deleted or replaced while readers were still copying


class StoredEntry(NamedTuple):
    """An entry's pages as stored: ``segments`` (read-only arena views) hold ``codec``-coded
    bytes (0: the raw bytes themselves) that decode to ``length`` raw bytes whose xxh3-64 is
    ``checksum`` (0 for a raw entry: nothing to verify after a copy)."""

    segments: list[np.ndarray]
    codec: int
    length: int
    checksum: int


class ArenaTier(Tier):
    """A store-managed tier over one arena of fixed pages that a caller can read and fill in
    place (the top tier of a store: a write is one memcpy into its pages).

    The store checks for this base once, when it is built; a top tier without it is read and
    written through the plain ``Tier`` methods (a copy more per call).
    """

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena itself (what another process maps); ``capacity_bytes`` unless the
        tier stores more raw bytes than that (a coded arena)."""
        return self.capacity_bytes

    @contextmanager
    def borrow_stored(self, key: Key) -> Iterator[StoredEntry | None]:
        """Like ``borrow``, but the pages as stored (coded or raw) with what decoding them
        needs. The default: an arena that stores every entry raw."""
        with self.borrow(key) as views:
            yield None if views is None else StoredEntry(views, 0, sum(int(v.size) for v in views), 0)

    def drain(self, timeout: float) -> bool:
        """Wait until background work of the tier (a coded arena's coder) is done; False on
        timeout. The default: nothing runs in the background."""
        return True

    def set_element_dtype(self, dtype: str) -> None:
        """The KV's element type, for a tier that codes by element width (a coded arena's
        shuffle). The default: an arena that stores every entry raw ignores it."""

    @abstractmethod
    def views(self, key: Key, count: bool = True) -> list[np.ndarray] | None:
        """Read-only views of ``key``'s extents, valid until the key is deleted or replaced
        (the caller keeps that from happening meanwhile); None when absent."""

    @abstractmethod
    def borrow(self, key: Key, count: bool = True) -> AbstractContextManager[list[np.ndarray] | None]:
        """Like ``views``, but the pages stay untouched until the ``with`` block ends. Counts a
        hit or a miss unless ``count`` is False (the store's copies down to a lower tier)."""

    @contextmanager
    def borrow_many(self, keys: Sequence[Key]) -> Iterator[list[list[np.ndarray] | None]]:
        """``borrow`` of each of ``keys`` at once (each a hit or a miss as ``borrow`` counts it):
        each entry's views (None where absent), every page untouched until the ``with`` block
        ends. The default borrows them one by one; an arena may take them in one lock hold."""
        with ExitStack() as pinned:
            yield [pinned.enter_context(self.borrow(key)) for key in keys]

    @abstractmethod
    def reserve(self, key: Key, nbytes: int, dtype: str = "uint8",
                shape: tuple[int, ...] | None = None) -> list[np.ndarray] | None:
        """Writable views of pages reserved for ``nbytes`` under ``key`` (``commit`` or
        ``abort`` follows); None when there is no room."""

    @abstractmethod
    def commit(self, key: Key) -> bool:
        """Publish ``key``'s reservation; False if there was none."""

    @abstractmethod
    def abort(self, key: Key) -> bool:
        """Free ``key``'s reservation; False if there was none."""

    @abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Arena bytes an entry of ``nbytes`` occupies (whole pages)."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Bytes in free pages: the most one more entry could take."""

    @abstractmethod
    def offset_of(self, view: np.ndarray) -> int:
        """Byte offset in the arena of a view this tier handed out."""

    @classmethod
    def shared_file(cls, config) -> str | None:
        """The shared-memory file another process maps the arena from (None: private)."""
        return None

    @classmethod
    def share_at(cls, config, path: str):
        """The configuration with the arena in the new shared-memory file ``path``;
        ConfigError when this arena cannot be shared."""
        raise ConfigError(f"tier class {cls.__name__} cannot share its arena with other processes")


class RamTier(ArenaTier):
    """A RAM tier over one preallocated arena.

    Thread-safety: every method may be called from any thread. Bookkeeping happens under one lock
    (``_lock``: the entries, reservations, free pages, byte counts, the coder's queue and
    counters); the copies themselves run outside it (numpy releases the GIL), and an entry being
    read keeps its pages until the last reader finishes, so a concurrent delete or overwrite
    never changes bytes under a reader. A coded arena's coder rewrites an entry's pages only
    while no reader holds it, and an acquirer waits (on ``_cond``, the same lock) for that move,
    one memcpy of the coded bytes, to end.
    """

    Config = RamConfig
    medium = "CPU"
    kv_event_medium = "CPU"
    locality = "LOCAL"
    self_managed = False

    def __init__(self, config: RamConfig | None = None, name: str = "ram"):
        super().__init__(config, name)
        config = config or RamConfig()
        validate(config, name)
        self.config = config
        if config.codec != "none" and not config.shm_path:
            raise ConfigError(f"{name}.codec: {config.codec!r} is for kvtier serve's arena, where capacity is the "
                              f"limit; an engine's own RAM tier stays raw (valid here: none)")
        self._page = int(config.page_size)
        self._npages = int(config.capacity) // self._page
        self._capacity = self._npages * self._page
        if config.shm_path:
            self._tensor, self._arena = None, _map_shared(config.shm_path, self._capacity, name)
        else:
            self._tensor, self._arena = _allocate(self._capacity, config.pin_memory, name)
        if config.prefault and self._capacity:
            self._arena.fill(0)
        self._free = list(range(self._npages))  # already a valid min-heap
        self._entries: dict[Key, _Entry] = {}
        self._reserved: dict[Key, _Entry] = {}
        self._used = 0  # stored bytes of committed entries and reservations
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a move ended, work arrived, the coder went idle
        self._queue: deque[tuple[Key, int]] = deque()  # (key, attempt) waiting for the coder
        self._coding = False  # the coder is working on a key now
        self._stop = False
        self._element_bytes = DEFAULT_ELEMENT_BYTES
        self._coder_counts = {"coded": 0, "kept_raw": 0, "busy": 0, "queue_full": 0, "corrupt": 0, "errors": 0}
        self._coder_logged = (float("-inf"), 0)  # (when the coder last logged a failure, errors counted then)
        self._coder: threading.Thread | None = None
        self._scratch = Scratch()  # per-thread contiguous copies of multi-run entries for the codec
        if config.codec != "none":
            self.codec  # resolve now: a missing library is a ConfigError here, not in the coder thread
            self._coder = threading.Thread(target=self._code_loop, name=f"kvtier-ram-coder-{name}", daemon=True)
            self._coder.start()

    # --- capabilities --------------------------------------------------------------------------

    @classmethod
    def scheduler_view(cls) -> SchedulerView:
        """Process-private memory: another process knows it only from the store's events."""
        return SchedulerView.MIRRORED

    @classmethod
    def for_rank(cls, config: RamConfig, share: RankShare) -> RamConfig:
        """Each worker's arena holds its share of the total capacity."""
        return replace(config, capacity=int(config.capacity) // share.workers)

    @classmethod
    def for_engine_pages(cls, config: RamConfig, page_bytes: int, given: frozenset[str]) -> RamConfig:
        """One arena page per engine page (every page copy a single memcpy), and the arena
        touched at start (its page faults out of the first requests); given options stay."""
        changes = {}
        if "page_size" not in given:
            changes["page_size"] = page_bytes
        if "prefault" not in given:
            changes["prefault"] = True
        return replace(config, **changes)

    @classmethod
    def shared_file(cls, config: RamConfig) -> str | None:
        return config.shm_path

    @classmethod
    def share_at(cls, config: RamConfig, path: str) -> RamConfig:
        return replace(config, shm_path=path)

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """Arena bytes (configured capacity rounded down to whole pages); for a coded arena, its
        raw-byte budget, ``CODED_BUDGET`` x that (its free pages are the real limit)."""
        return self._capacity * (CODED_BUDGET if self._coder is not None else 1)

    @property
    def arena_bytes(self) -> int:
        """Arena bytes (configured capacity rounded down to whole pages)."""
        return self._capacity

    def set_element_dtype(self, dtype: str) -> None:
        """Code entries as elements of ``dtype`` (the KV's type; the shuffle's width). ``uint8``,
        the store's default, means unknown: 2-byte elements (bf16/fp16 KV; at width 1 the shuffle
        does not line up bf16 KV's exponent bytes). ValueError for a dtype the entry format does not know."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        self._element_bytes = DTYPES[dtype][1] if dtype != "uint8" else DEFAULT_ELEMENT_BYTES

    @property
    def pinned(self) -> bool:
        """Whether the arena is pinned (page-locked) memory."""
        return self._tensor is not None

    def used_bytes(self) -> int:
        """Bytes the stored entries (coded ones: their coded bytes) and open reservations hold."""
        with self._lock:
            return self._used

    def free_bytes(self) -> int:
        """Bytes in free pages: the most one more entry could take (pages round sizes up)."""
        with self._lock:
            return len(self._free) * self._page

    def offset_of(self, view: np.ndarray) -> int:
        """Byte offset in the arena of a view from ``views``/``borrow``/``reserve`` (for a
        process that maps the same ``shm_path``)."""
        return int(view.__array_interface__["data"][0] - self._arena.__array_interface__["data"][0])

    def footprint(self, nbytes: int) -> int:
        """Arena bytes an entry of ``nbytes`` occupies (whole pages)."""
        return -(-nbytes // self._page) * self._page

    # --- the protocol --------------------------------------------------------------------------

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._entries

    def contains_many(self, keys) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def size_of(self, key: Key) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.length

    def get_into(self, key: Key, out) -> int | None:
        """Copy ``key``'s payload into ``out`` (any writable contiguous buffer).

        Returns the byte count, or None on a miss or when ``out`` is too small (counted as an
        error). The tier keeps no reference to ``out``.
        """
        dst = _byte_view(out, writable=True)
        entry = self._acquire(key)
        if entry is None:
            self.stats.add(misses=1)
            return None
        try:
            if dst.nbytes < entry.length:
                self.stats.add(errors=1)
                return None
            if entry.codec:
                if not self._decode(entry, dst[: entry.length]):
                    self.stats.add(misses=1)
                    return None
            else:
                gather_into(self._spans(entry.extents), dst)
        finally:
            self._release(entry)
        self.stats.add(hits=1, bytes_read=entry.length)
        return entry.length

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Store a copy of ``data``; False (``stats.dropped``) when the free pages are too few.

        Replacing an existing key needs room for the new copy before the old one is freed. The
        tier keeps no reference to ``data``.
        """
        src = _byte_view(data, writable=False)
        length = src.nbytes
        dtype, shape = _check_meta(length, dtype, shape)
        entry = self._allocate(length, dtype, shape)
        if entry is None:
            self.stats.add(dropped=1)
            return False
        scatter(src, self._spans(entry.extents))
        self._publish(key, entry)
        self.stats.add(puts=1, bytes_written=length)
        return True

    def delete(self, key: Key) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._retire(entry)
        self.stats.add(deletes=1)
        return True

    def keys(self) -> Iterator[Key]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def close(self) -> None:
        """Stop the coder, drop every entry and the arena. Views handed out before are invalid
        afterwards."""
        with self._lock:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        if self._coder is not None and self._coder is not threading.current_thread():
            self._coder.join(timeout=10.0)
        with self._lock:
            self._entries.clear()
            self._reserved.clear()
            self._free = []
            self._used = 0
            self._arena = np.empty(0, dtype=np.uint8)
            self._tensor = None
        if self.config.shm_path:
            try:
                os.unlink(self.config.shm_path)
            except FileNotFoundError:
                pass

    # --- zero-copy path ------------------------------------------------------------------------

    def views(self, key: Key, count: bool = True) -> list[np.ndarray] | None:
        """Read-only uint8 views of ``key``'s extents, in order, or None when absent.

        Contract: the views alias arena pages and stay valid only until the key is deleted or
        replaced; the caller must make sure that does not happen while it reads them (or use
        ``borrow``, which guarantees it). Counts a hit or a miss unless ``count`` is False (the
        store's own copies of an entry down to a lower tier are not reads by a user).
        """
        if self._coder is not None:
            return self._private_views(key, count)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if count:
                    self.stats.add(misses=1)
                return None
            views = self._extent_views(entry)
        if count:
            self.stats.add(hits=1, bytes_read=entry.length)
        return views

    def _private_views(self, key: Key, count: bool) -> list[np.ndarray] | None:
        """``views`` of a coded arena: one private read-only copy of the raw bytes (decoded and
        verified for a coded entry), because the coder may move a raw entry's pages at any time.
        None when absent or corrupt (counted)."""
        entry = self._acquire(key)
        if entry is None:
            if count:
                self.stats.add(misses=1)
            return None
        try:
            out = np.empty(entry.length, dtype=np.uint8)
            if entry.codec:
                if not self._decode(entry, out):
                    return None
            else:
                gather_into(self._spans(entry.extents), out)
        finally:
            self._release(entry)
        if count:
            self.stats.add(hits=1, bytes_read=entry.length)
        out.flags.writeable = False
        return [out]

    @contextmanager
    def borrow(self, key: Key, count: bool = True) -> Iterator[list[np.ndarray] | None]:
        """Like ``views``, but the pages stay untouched until the ``with`` block ends, even if
        another thread deletes or replaces the key meanwhile. Yields None on a miss. Counts a
        hit or a miss unless ``count`` is False."""
        entry = self._acquire(key)
        if entry is None:
            if count:
                self.stats.add(misses=1)
            yield None
            return
        try:
            if count:
                self.stats.add(hits=1, bytes_read=entry.length)
            yield self._pinned_views(entry)
        finally:
            self._release(entry)

    @contextmanager
    def borrow_many(self, keys: Sequence[Key]) -> Iterator[list[list[np.ndarray] | None]]:
        """``borrow`` of each of ``keys``, pinned in one hold of the arena's lock and released in
        another (a batched read's pins cost one lock round trip, not one per key)."""
        entries = self._acquire_many(keys)
        hits = [entry for entry in entries if entry is not None]
        try:
            self.stats.add(hits=len(hits), misses=len(entries) - len(hits),
                           bytes_read=sum(entry.length for entry in hits))
            yield [None if entry is None else self._pinned_views(entry) for entry in entries]
        finally:
            self._release_many(hits)

    @contextmanager
    def borrow_stored(self, key: Key) -> Iterator[StoredEntry | None]:
        """The entry's pages as stored (coded or raw; see ``StoredEntry``), untouched until the
        ``with`` block ends, as ``borrow``. Yields None on a miss."""
        entry = self._acquire(key)
        if entry is None:
            self.stats.add(misses=1)
            yield None
            return
        try:
            self.stats.add(hits=1, bytes_read=entry.stored)
            yield StoredEntry(self._extent_views(entry), entry.codec,
                              entry.length, entry.checksum)
        finally:
            self._release(entry)

    def reserve(self, key: Key, nbytes: int, dtype: str = "uint8",
                shape: tuple[int, ...] | None = None) -> list[np.ndarray] | None:
        """Reserve arena pages for ``nbytes`` under ``key``; return writable views of them.

        Contract: the caller fills the views (in order, ``nbytes`` in all), then calls
        ``commit(key)`` to publish the entry or ``abort(key)`` to free the pages. Until
        ``commit``, the reservation is invisible to readers (``contains``, ``get_into``, ``keys``),
        but its bytes count in ``used_bytes``. Returns None (``stats.dropped``) when there is no
        room or ``key`` already has an open reservation.
        """
        dtype, shape = _check_meta(nbytes, dtype, shape)
        entry = self._allocate(nbytes, dtype, shape)
        if entry is None:
            self.stats.add(dropped=1)
            return None
        with self._lock:
            if key in self._reserved:
                self._retire(entry)
                self.stats.add(dropped=1)
                return None
            self._reserved[key] = entry
        return self._spans(entry.extents)

    def commit(self, key: Key) -> bool:
        """Publish ``key``'s reservation (replacing any entry under that key); False if none."""
        with self._lock:
            entry = self._reserved.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.stored  # _publish_locked counts it again
            self._publish_locked(key, entry)
        self.stats.add(puts=1, bytes_written=entry.length)
        return True

    def abort(self, key: Key) -> bool:
        """Free ``key``'s reservation; False if there was none."""
        with self._lock:
            entry = self._reserved.pop(key, None)
            if entry is None:
                return False
            self._retire(entry)
        return True

    # --- bookkeeping (no I/O) -------------------------------------------------------------------

    def _allocate(self, length: int, dtype: str, shape: tuple[int, ...]) -> _Entry | None:
        need = -(-length // self._page) if length else 0
        with self._lock:
            if need > len(self._free):
                return None
            pages = [heapq.heappop(self._free) for _ in range(need)]
            self._used += length
        return _Entry(pages, _extents(pages, self._page, length), length, dtype, shape)

    def _publish(self, key: Key, entry: _Entry) -> None:
        with self._lock:
            self._used -= entry.stored
            self._publish_locked(key, entry)

    def _publish_locked(self, key: Key, entry: _Entry) -> None:
        old = self._entries.get(key)
        self._entries[key] = entry
        self._used += entry.stored
        if old is not None:
            self._retire(old)
        if self._coder is not None and not self._stop:
            self._enqueue(key, 0)

    def _retire(self, entry: _Entry) -> None:
        """Take ``entry`` out of service (lock held); its pages return once no reader holds it."""
        self._used -= entry.stored
        entry.dead = True
        if entry.readers == 0 and not entry.moving:
            self._free_pages(entry)

    def _free_pages(self, entry: _Entry) -> None:
        for page in entry.pages:
            heapq.heappush(self._free, page)
        entry.pages = []

    def _acquire(self, key: Key) -> _Entry | None:
        """Pin ``key``'s entry (readers + 1), waiting out a move of its pages by the coder (one
        memcpy); None when absent."""
        with self._lock:
            return self._pin_locked(key)

    def _pin_locked(self, key: Key) -> _Entry | None:
        """``_acquire`` with the lock held (released meanwhile only while waiting on a move)."""
        entry = self._entries.get(key)
        while entry is not None and entry.moving:
            self._cond.wait()
            entry = self._entries.get(key)
        if entry is not None:
            entry.readers += 1
        return entry

    def _acquire_many(self, keys: Sequence[Key]) -> list[_Entry | None]:
        """``_acquire`` of each of ``keys``, in one hold of the lock (but for waits on moves). On
        any exception (an unhashable key, an interrupt during a wait) the pins already taken are
        released before it propagates."""
        with self._lock:
            out: list[_Entry | None] = []
            try:
                for key in keys:
                    out.append(self._pin_locked(key))
            except BaseException:
                for entry in out:
                    if entry is not None:
                        self._release_locked(entry)
                raise
            return out

    def _release_many(self, entries: list[_Entry]) -> None:
        """``_release`` of each of ``entries``, in one hold of the lock."""
        with self._lock:
            for entry in entries:
                self._release_locked(entry)

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            self._release_locked(entry)

    def _release_locked(self, entry: _Entry) -> None:
        """Unpin ``entry`` (lock held): free its pages if it died meanwhile and nobody reads it."""
        entry.readers -= 1
        if entry.readers == 0 and entry.deferred is not None:  # the coder skipped it for a reader
            deferred, entry.deferred = entry.deferred, None
            if not (entry.dead or self._stop):
                self._enqueue(*deferred)
        if entry.dead and entry.readers == 0 and not entry.moving:
            self._free_pages(entry)

    def _pinned_views(self, entry: _Entry) -> "list[np.ndarray] | _DecodedOnUse":
        """What a borrow of the pinned ``entry`` yields: its raw bytes' read-only views, or for a
        coded entry an object that decodes them on use."""
        return _DecodedOnUse(self, entry) if entry.codec else self._extent_views(entry)

    def _extent_views(self, entry: _Entry) -> list[np.ndarray]:
        """Read-only views of ``entry``'s extents, as stored."""
        return [self._readonly(start, end) for start, end in entry.extents]

    def _readonly(self, start: int, end: int) -> np.ndarray:
        view = self._arena[start:end]
        view.flags.writeable = False
        return view

    # --- the coder of a coded arena (its own thread; lock held only to decide and record) ------

    def _enqueue(self, key: Key, attempt: int) -> None:
        """Queue ``key`` for the coder (lock held); a full queue leaves it raw (counted)."""
        if len(self._queue) >= _CODER_QUEUE:
            self._coder_counts["queue_full"] += 1
            return
        self._queue.append((key, attempt))
        self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until the coder has handled every queued entry; False on timeout."""
        with self._lock:
            return self._cond.wait_for(lambda: self._stop or not (self._queue or self._coding), timeout)

    def codec_state(self) -> dict:
        """The codec setting and, for a coded arena, the coder's figures: entries waiting, coded
        now, raw and stored bytes of the entries, the arena's bytes and its free pages' bytes, and counts of entries kept raw (too small, not
        smaller by a page), skipped while a reader held them, left raw by a full queue, stored
        entries that failed to decode (corrupt), and entries left raw by a failure of the coder
        (errors)."""
        state = super().codec_state()
        if self._coder is None:
            return state
        with self._lock:
            coded = sum(1 for e in self._entries.values() if e.codec)
            raw_bytes = sum(e.length for e in self._entries.values())
            stored_bytes = sum(e.stored for e in self._entries.values())
            state.update(self._coder_counts, pending=len(self._queue), entries_coded=coded,
                         raw_bytes=raw_bytes, stored_bytes=stored_bytes, arena_bytes=self._capacity,
                         free_bytes=len(self._free) * self._page)
        return state

    def _code_loop(self) -> None:
        """The coder thread: code queued entries until ``close``."""
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                key, attempt = self._queue.popleft()
                self._coding = True
            try:
                self._code(key, attempt)
            except Exception:  # a bug must leave the entry raw, never stop the coder
                self._coder_failed()
            finally:
                with self._lock:
                    self._coding = False
                    self._cond.notify_all()

    def _coder_failed(self) -> None:
        """Count a failure to code an entry (it stays raw) and log it: the first with its
        traceback, then at most one line a ``_CODER_LOG_EVERY_S`` with the count since."""
        with self._lock:
            self._coder_counts["errors"] += 1
            errors = self._coder_counts["errors"]
            last, logged = self._coder_logged
            now = time.monotonic()
            if now - last < _CODER_LOG_EVERY_S:
                return
            self._coder_logged = (now, errors)
        if logged == 0:
            log.exception("ram tier %s: coding an entry failed; it stays raw (counted in codec errors)", self.name)
        else:
            log.error("ram tier %s: coding failed for %d more entries; they stay raw", self.name, errors - logged)

    def _code(self, key: Key, attempt: int) -> None:
        """Code one committed raw entry in place: encode it (lock not held), then, if it is still
        live and no reader holds it, mark it moving, copy the coded bytes into its first pages
        (lock not held; acquirers wait) and publish the coded form, freeing the pages it no
        longer needs. The encode holds no pin: an eviction or delete meanwhile frees the pages at
        once (a pin would hide them from the store, which would evict one entry more), and the
        work is dropped (what was read from reused pages is never written anywhere). An entry a
        reader holds is deferred (counted as busy): the last reader's release queues it again, so
        a lease held for long costs no encode meanwhile; one a reader took while it was encoded
        is encoded again at most ``_CODER_RETRIES`` times."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.codec:
                return
            if entry.readers:
                self._defer(key, entry, attempt)
                return
            extents, length = list(entry.extents), entry.length
        raw = self._contiguous(extents, length, "raw")
        coded = self.codec.encode(memoryview(raw), self._element_bytes)
        need = -(-len(coded) // self._page) if coded is not None else 0
        digest = checksum(raw) if coded is not None else 0
        with self._lock:
            if entry.dead or self._entries.get(key) is not entry:
                return  # evicted, deleted or replaced while it was encoded: ``raw`` may be another's
            if coded is None or need >= len(entry.pages):  # too small, or no page saved
                self._coder_counts["kept_raw"] += 1
                return
            if entry.readers:
                if attempt < _CODER_RETRIES:
                    self._defer(key, entry, attempt + 1)
                else:
                    self._coder_counts["busy"] += 1
                return
            entry.moving = True
        self._move(entry, coded, need, digest)

    def _defer(self, key: Key, entry: _Entry, attempt: int) -> None:
        """Leave ``entry``, which a reader holds, for its last reader's release to queue again
        (lock held; counted as busy)."""
        self._coder_counts["busy"] += 1
        entry.deferred = (key, attempt)

    def _move(self, entry: _Entry, coded: bytes, need: int, digest: int) -> None:
        """Copy ``coded`` into ``entry``'s first ``need`` pages (it is moving: nobody reads them
        and they stay its own even if it dies meanwhile) and publish the coded form, unless it
        died: then every page goes back."""
        extents = _extents(entry.pages[:need], self._page, len(coded))
        try:
            scatter(coded, self._spans(extents))
        finally:
            with self._lock:
                entry.moving = False
                if entry.dead:
                    if entry.readers == 0:
                        self._free_pages(entry)
                else:
                    for page in entry.pages[need:]:
                        heapq.heappush(self._free, page)
                    entry.pages = entry.pages[:need]
                    entry.extents = extents
                    self._used -= entry.stored - len(coded)
                    entry.codec, entry.stored, entry.checksum = LOSSLESS_ID, len(coded), digest
                    self._coder_counts["coded"] += 1
                    self.stats.add(coded=1)
                self._cond.notify_all()

    def _contiguous(self, extents: list[tuple[int, int]], nbytes: int, slot: str) -> np.ndarray:
        """The bytes of ``extents`` as one array: the arena view of a single run, else a copy in
        this thread's scratch ``slot``."""
        if len(extents) == 1:
            start, end = extents[0]
            return self._arena[start:end]
        buf = self._scratch.get(nbytes, slot)
        gather_into(self._spans(extents), buf)
        return buf

    def _spans(self, extents: list[tuple[int, int]]) -> list[np.ndarray]:
        """Writable arena views of byte runs ``extents``, in order."""
        return [self._arena[start:end] for start, end in extents]

    def _decode(self, entry: _Entry, out: np.ndarray) -> bool:
        """Decode a pinned coded entry into ``out`` (exactly its raw length) and verify its
        checksum; False (counted as corrupt) when either fails."""
        stored = self._contiguous(entry.extents, entry.stored, "stored")
        try:
            decode_into(entry.codec, memoryview(stored), memoryview(out), self._element_bytes)
            if checksum(out) != entry.checksum:
                raise CorruptEntry("checksum of the decoded bytes does not match")
        except CorruptEntry as exc:
            log.warning("ram tier %s: a coded entry does not decode (%s); a miss", self.name, exc)
            self.stats.add(corrupt=1)
            with self._lock:
                self._coder_counts["corrupt"] += 1
            return False
        return True


class _DecodedOnUse(Sequence):
    """What ``borrow`` yields for a coded entry: one segment, its raw bytes, decoded (and
    verified) on first access while the ``with`` block pins the entry, so a caller that only
    wanted the pin (the server, which hands the coded pages to its client) decodes nothing.
    CorruptEntry from that access when the stored bytes do not decode to the checksum."""

    def __init__(self, tier: RamTier, entry: _Entry):
        self._tier = tier
        self._entry = entry
        self._raw: np.ndarray | None = None

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(1))]
        if i not in (0, -1):
            raise IndexError("a decoded entry is one segment")
        if self._raw is None:
            raw = np.empty(self._entry.length, dtype=np.uint8)
            if not self._tier._decode(self._entry, raw):
                raise CorruptEntry(f"ram tier {self._tier.name}: a coded entry does not decode")
            raw.flags.writeable = False
            self._raw = raw
        return self._raw


def _extents(pages: list[int], page_size: int, length: int) -> list[tuple[int, int]]:
    """Merge ascending page numbers into contiguous byte runs covering exactly ``length`` bytes."""
    runs: list[tuple[int, int]] = []
    remaining = length
    for page in pages:
        start = page * page_size
        n = min(page_size, remaining)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + n)
        else:
            runs.append((start, start + n))
        remaining -= n
    return runs


def _byte_view(buf, writable: bool) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous buffer (bytes, bytearray, memoryview, ndarray)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        view = buf.reshape(-1).view(np.uint8)
    else:
        view = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    if writable and not view.flags.writeable:
        raise ValueError("output buffer is read-only")
    return view


def _check_meta(length: int, dtype: str, shape: tuple[int, ...] | None) -> tuple[str, tuple[int, ...]]:
    """Validate dtype/shape against the payload length (same rules as the entry format)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    itemsize = DTYPES[dtype][1]
    shape = tuple(int(d) for d in shape) if shape is not None else (length // itemsize,)
    count = 1
    for d in shape:
        count *= d
    if len(shape) > MAX_NDIM or count * itemsize != length:
        raise ValueError(f"shape {shape} x {dtype} does not match {length} payload bytes")
    return dtype, shape


def _map_shared(path: str, capacity: int, name: str) -> np.ndarray:
    """A uint8 array over a new shared-memory file of ``capacity`` bytes (mode 0600).

    Every byte of the file is backed by storage before it is mapped (``reserve_file``), so a full
    tmpfs raises ``OutOfSpace`` here instead of a SIGBUS at the first touch of a page; on that
    error the file is removed again. The mapping lives as long as the array (numpy holds the
    mmap); the file is unlinked by ``RamTier.close``.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, capacity)
        if not capacity:
            return np.empty(0, dtype=np.uint8)
        reserve_file(fd, capacity, path, f"ram tier {name}")
        return np.frombuffer(mmap.mmap(fd, capacity), dtype=np.uint8)
    except BaseException:
        os.close(fd)
        fd = -1
        unlink_quietly(path)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


_NOT_SUPPORTED = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
_TOUCH_CHUNK = 1 << 20


def reserve_file(fd: int, size: int, path: str, what: str) -> None:
    """Back bytes ``[0, size)`` of the open file ``fd`` with storage now, or raise ``OutOfSpace``.

    Contract: on return every page of the range is allocated, so a shared mapping of it cannot
    SIGBUS for lack of space; on ``OutOfSpace`` nothing was mapped and the caller removes the
    file. ``posix_fallocate`` does it in one call (tmpfs, ext4, xfs: fast, no data written); on a
    file system without it, zeros are written with ``pwrite`` (a full file system then fails
    that write with ENOSPC; no page is ever touched through a mapping). The error message is one
    line naming ``what``, the size asked, the directory and its free space.
    """
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in _NOT_SUPPORTED:
            raise _out_of_space(what, size, path, exc) from exc
    zeros = bytes(min(_TOUCH_CHUNK, size))
    offset = 0
    while offset < size:
        try:
            written = os.pwrite(fd, zeros[: min(len(zeros), size - offset)], offset)
        except OSError as exc:
            raise _out_of_space(what, size, path, exc) from exc
        if written <= 0:
            raise _out_of_space(what, size, path, OSError(errno.ENOSPC, "short write"))
        offset += written


def _out_of_space(what: str, size: int, path: str, exc: OSError) -> OutOfSpace:
    """The one-line error for a reservation of ``size`` bytes at ``path`` that failed."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(directory)
        room = f"{_human(st.f_bavail * st.f_frsize)} free of {_human(st.f_blocks * st.f_frsize)}"
    except OSError:
        room = "free space unknown"
    return OutOfSpace(
        f"{what}: cannot reserve {_human(size)} ({size} bytes) for {path}: {directory} has {room} "
        f"({exc.strerror or exc}); give it more room (e.g. docker run --shm-size, a larger tmpfs) "
        f"or lower the capacity"
    )


def _human(n: int) -> str:
    """``n`` bytes as a short binary-unit string (``64.0 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"


def _allocate(capacity: int, pin: Literal["auto"] | bool, name: str):
    """The arena: (pinned torch tensor or None, uint8 numpy array of ``capacity`` bytes)."""
    if pin is not False:
        try:
            import torch

            if torch.cuda.is_available():
                tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
                return tensor, tensor.numpy()
        except ImportError:
            pass
        except RuntimeError as exc:  # pinning can fail (ulimit -l); ordinary memory still works
            log.warning("ram tier %s: cannot pin %d bytes (%s); using ordinary memory", name, capacity, exc)
            return None, np.empty(capacity, dtype=np.uint8)
        if pin is True:
            log.warning("ram tier %s: pin_memory requested but CUDA is not available", name)
    return None, np.empty(capacity, dtype=np.uint8)

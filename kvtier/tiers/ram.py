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
"""

from __future__ import annotations

import errno
import heapq
import logging
import mmap
import os
import threading
from abc import abstractmethod
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Literal

import numpy as np

from kvtier.config import Size, out_of_range, ranged, validate
from kvtier.entry import DTYPES, MAX_NDIM
from kvtier.errors import ConfigError, OutOfSpace
from kvtier.fileio import unlink_quietly
from kvtier.keys import Key
from kvtier.tiers.base import RankShare, SchedulerView, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RamConfig:
    """Configuration of a RAM tier.

    capacity: arena bytes (rounded down to whole pages), e.g. "2GiB".
    page_size: allocation unit; an entry occupies ceil(size / page_size) pages.
    pin_memory: "auto" pins the arena when torch with CUDA is present; true asks for it (falls back
        to ordinary memory with a warning when CUDA is absent); false never pins.
    prefault: touch every arena page at construction, so resident memory is the full arena from
        the start instead of growing up to it on first use.
    shm_path: back the arena with this new file (e.g. under /dev/shm, mode 0600) so other
        processes of the same user can map it (the per-node cache server); the file is created
        exclusively and removed on ``close``. Never pinned.
    """

    capacity: Size = ranged(Size(1024**3), ge=1)
    page_size: Size = ranged(Size(256 * 1024), ge=1)
    pin_memory: Literal["auto"] | bool = "auto"
    prefault: bool = False
    shm_path: str | None = None

    def check(self, where: str) -> None:
        """Across fields: the arena holds at least one page (``config.validate`` calls this)."""
        if self.page_size > self.capacity:
            raise out_of_range(f"{where}.page_size", self.page_size, f"[1, capacity={self.capacity}]")


class _Entry:
    """One stored (or reserved) entry: its byte extents in the arena and its metadata."""

    __slots__ = ("pages", "extents", "length", "dtype", "shape", "readers", "dead")

    def __init__(self, pages: list[int], extents: list[tuple[int, int]], length: int,
                 dtype: str, shape: tuple[int, ...]):
        self.pages = pages  # page numbers, freed when the entry dies and has no readers
        self.extents = extents  # (start byte, end byte) runs covering exactly ``length`` bytes
        self.length = length
        self.dtype = dtype
        self.shape = shape
        self.readers = 0  # copies in progress outside the lock; pages are freed only at 0
        self.dead = False  # deleted or replaced while readers were still copying


class ArenaTier(Tier):
    """A store-managed tier over one arena of fixed pages that a caller can read and fill in
    place (the top tier of a store: a write is one memcpy into its pages).

    The store checks for this base once, when it is built; a top tier without it is read and
    written through the plain ``Tier`` methods (a copy more per call).
    """

    @abstractmethod
    def views(self, key: Key, count: bool = True) -> list[np.ndarray] | None:
        """Read-only views of ``key``'s extents, valid until the key is deleted or replaced
        (the caller keeps that from happening meanwhile); None when absent."""

    @abstractmethod
    def borrow(self, key: Key) -> AbstractContextManager[list[np.ndarray] | None]:
        """Like ``views``, but the pages stay untouched until the ``with`` block ends."""

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

    Thread-safety: every method may be called from any thread. Bookkeeping happens under one lock;
    the copies themselves run outside it (numpy releases the GIL), and an entry being read keeps
    its pages until the last reader finishes, so a concurrent delete or overwrite never changes
    bytes under a reader.
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
        self._used = 0  # payload bytes of committed entries and reservations
        self._lock = threading.Lock()

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
        """Arena bytes (configured capacity rounded down to whole pages)."""
        return self._capacity

    @property
    def pinned(self) -> bool:
        """Whether the arena is pinned (page-locked) memory."""
        return self._tensor is not None

    def used_bytes(self) -> int:
        """Payload bytes of the stored entries and open reservations."""
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
            pos = 0
            for start, end in entry.extents:
                n = end - start
                dst[pos : pos + n] = self._arena[start:end]
                pos += n
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
        pos = 0
        for start, end in entry.extents:
            n = end - start
            self._arena[start:end] = src[pos : pos + n]
            pos += n
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
        """Drop every entry and the arena. Views handed out before are invalid afterwards."""
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
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if count:
                    self.stats.add(misses=1)
                return None
            views = [self._readonly(start, end) for start, end in entry.extents]
        if count:
            self.stats.add(hits=1, bytes_read=entry.length)
        return views

    @contextmanager
    def borrow(self, key: Key) -> Iterator[list[np.ndarray] | None]:
        """Like ``views``, but the pages stay untouched until the ``with`` block ends, even if
        another thread deletes or replaces the key meanwhile. Yields None on a miss."""
        entry = self._acquire(key)
        if entry is None:
            self.stats.add(misses=1)
            yield None
            return
        try:
            self.stats.add(hits=1, bytes_read=entry.length)
            yield [self._readonly(start, end) for start, end in entry.extents]
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
        return [self._arena[start:end] for start, end in entry.extents]

    def commit(self, key: Key) -> bool:
        """Publish ``key``'s reservation (replacing any entry under that key); False if none."""
        with self._lock:
            entry = self._reserved.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.length  # _publish_locked counts it again
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
            self._used -= entry.length
            self._publish_locked(key, entry)

    def _publish_locked(self, key: Key, entry: _Entry) -> None:
        old = self._entries.get(key)
        self._entries[key] = entry
        self._used += entry.length
        if old is not None:
            self._retire(old)

    def _retire(self, entry: _Entry) -> None:
        """Take ``entry`` out of service (lock held); its pages return once no reader holds it."""
        self._used -= entry.length
        entry.dead = True
        if entry.readers == 0:
            self._free_pages(entry)

    def _free_pages(self, entry: _Entry) -> None:
        for page in entry.pages:
            heapq.heappush(self._free, page)
        entry.pages = []

    def _acquire(self, key: Key) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.readers += 1
            return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1
            if entry.dead and entry.readers == 0:
                self._free_pages(entry)

    def _readonly(self, start: int, end: int) -> np.ndarray:
        view = self._arena[start:end]
        view.flags.writeable = False
        return view


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

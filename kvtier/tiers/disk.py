"""The disk tier: one file per entry in one directory, with an index rebuilt at start.

A file is ``<dir>/<first key byte as hex>/<key hex>`` holding the entry header (``kvtier.entry``)
followed by the payload. Writes go to a temp file in the same directory and are renamed into
place (``os.replace``), so a reader or a crash sees the old entry or the new one, never half.

One tier owns a directory: at construction it takes an exclusive ``flock`` on
``<dir>/.kvtier.lock`` (held until ``close``), so two stores never manage one directory (each would
believe it owns the whole capacity). A second tier on a locked directory raises TierUnavailable
naming the path; ``TieredStore.from_config`` then leaves the tier out with a warning, as for any
tier that cannot start.

At construction the directory is scanned, reading headers only: the root and its fan-out
subdirectories (two hex digits) and nothing deeper or elsewhere. Temp files left by a crash are
removed, but only names this tier creates (``<key hex>.<12 hex>.tmp`` and its ``.probe-``/
``.direct-`` files), never another ``*.tmp``. Files whose header does not parse (or names another
key, announces more than the capacity, or whose size disagrees with the header) are removed and
counted in ``stats.corrupt``; the rest form the index, so entries survive a restart. On read the payload checksum is verified; a corrupt or truncated file is
removed, counted, and reported as a miss. Faults (ENOSPC, EACCES, EIO) are counted in
``stats.errors`` and reported as a miss / a False put, never raised.

Dirty page cache stays bounded: with ``drop_cache`` (the default) each written file is flushed
(``fdatasync``) and its pages dropped (``POSIX_FADV_DONTNEED``) before the rename, and at most
``max_writes_in_flight`` writes run at once, so a container's memory limit is not eaten by dirty
pages (the OOMKilled pitfall).
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import mmap
import os
import queue
import re
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Iterator

from kvtier.config import Size, ranged, validate
from kvtier.entry import MAX_HEADER_BYTES, check_key, decode_header, encode_header, verify
from kvtier.errors import CorruptEntry, TierUnavailable
from kvtier.fileio import ShortRead, fsync_dir, read_exact, read_upto, unlink_quietly, write_all
from kvtier.keys import Key
from kvtier.tiers.base import RankShare, SchedulerView, Tier

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
# The only temp names this tier creates (and so the only ones its start-up scan removes): an
# entry being written, and the start-up probes.
_OWN_TMP = re.compile(r"^(?:[0-9a-f]{64}\.[0-9a-f]{12}|\.(?:probe|direct)-[0-9a-f]{32})\.tmp$")
_FANOUT_DIR = re.compile(r"^[0-9a-f]{2}$")
LOCK_NAME = ".kvtier.lock"
_ALIGN = 4096  # O_DIRECT offset/length/buffer alignment that every Linux filesystem accepts
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DiskConfig:
    """Configuration of a disk tier.

    path: the directory (created if missing).
    capacity: payload bytes the tier may hold, e.g. "100GiB"; a put beyond it is dropped.
    o_direct: read and write with O_DIRECT through aligned bounce buffers, bypassing the page
        cache; where the filesystem refuses it (tmpfs) the tier falls back to buffered I/O.
    drop_cache: after writing a file, flush it and drop its pages from the page cache.
    fsync: make each put durable (fsync the file and the directory) before it returns True.
    max_writes_in_flight: writes running at once; further puts wait for a slot.
    fanout: spread files over 256 subdirectories by the first key byte.
    """

    path: str
    capacity: Size = ranged(Size(10 * 1024**3), ge=1)
    o_direct: bool = False
    drop_cache: bool = True
    fsync: bool = False
    max_writes_in_flight: int = ranged(4, ge=1, le=1024)
    fanout: bool = True


@dataclass(frozen=True)
class _Meta:
    """What the index knows of one file (from its header)."""

    header_bytes: int
    length: int
    checksum: int


class DiskTier(Tier):
    """A directory of entry files.

    Thread-safety: every method may be called from any thread. The index, renames and unlinks
    happen under one lock; reads and writes of file contents run outside it. A reader opens the
    file under the lock, so the file it reads is the one the index described even if another
    thread replaces or deletes the key meanwhile.
    """

    Config = DiskConfig
    medium = "DISK"
    self_managed = False

    def __init__(self, config: DiskConfig, name: str = "disk"):
        super().__init__(name)
        validate(config, name)
        self.config = config
        self.path = os.path.abspath(config.path)
        self._lock = threading.Lock()
        self._index: dict[Key, _Meta] = {}
        self._used = 0
        self._write_slots = threading.BoundedSemaphore(config.max_writes_in_flight)
        self._bounce: queue.SimpleQueue[_Bounce] = queue.SimpleQueue()
        for _ in range(config.max_writes_in_flight):
            self._bounce.put(_Bounce())
        self._prepare_directory()
        self._lock_file: io.FileIO | None = self._take_lock()
        try:
            self._direct = bool(config.o_direct and _O_DIRECT and self._probe_direct())
            self.scan_report = self._scan()
        except BaseException:
            self._release_lock()
            raise

    # --- capabilities --------------------------------------------------------------------------

    @classmethod
    def scheduler_view(cls) -> SchedulerView:
        """Files other processes can see: probed by existence (``DiskProbe``)."""
        return SchedulerView.PROBED

    @classmethod
    def scheduler_probe(cls, config: DiskConfig, name: str) -> "DiskProbe":
        """Existence checks on the directory without opening the tier (no scan, no lock)."""
        return DiskProbe(config)

    @classmethod
    def for_rank(cls, config: DiskConfig, share: RankShare) -> DiskConfig:
        """Each worker gets its share of the capacity and a subdirectory of its own
        (``path/<share.subdir>``), so no two stores manage one directory."""
        path = os.path.join(config.path, share.subdir) if config.path else config.path
        return replace(config, capacity=int(config.capacity) // share.workers, path=path)

    # --- start ---------------------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        """Create the directory and prove it writable; TierUnavailable with one line if not."""
        probe = os.path.join(self.path, f".probe-{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name}: cannot use directory {self.path}: {exc.strerror or exc}"
            ) from None

    def _take_lock(self) -> io.FileIO:
        """Exclusive flock on ``<dir>/.kvtier.lock`` (held while the tier is open or referenced,
        released by the kernel if the process dies); TierUnavailable naming the directory if
        another tier, in this process or another, holds it."""
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            lock = io.FileIO(lock_path, "a")  # O_CLOEXEC; a dropped tier's lock closes with it
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name}: cannot create lock file {lock_path}: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierUnavailable(
                    f"disk tier {self.name}: directory {self.path} is in use by another kvtier "
                    f"store (lock {lock_path} is held); give each store its own directory"
                ) from None
            raise TierUnavailable(
                f"disk tier {self.name}: cannot lock {lock_path}: {exc.strerror or exc}"
            ) from None
        return lock

    def _release_lock(self) -> None:
        lock, self._lock_file = self._lock_file, None
        if lock is not None:
            lock.close()  # closing the only descriptor releases the flock

    def _probe_direct(self) -> bool:
        probe = os.path.join(self.path, f".direct-{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
        except OSError as exc:
            log.info("disk tier %s: O_DIRECT unsupported in %s (%s); using buffered I/O",
                     self.name, self.path, exc.strerror)
            unlink_quietly(probe)
            return False
        os.close(fd)
        unlink_quietly(probe)
        return True

    def _scan(self) -> dict[str, int]:
        """Rebuild the index from the files' headers; remove temp and unparsable files."""
        report = {"entries": 0, "temp_removed": 0, "corrupt_removed": 0}
        for dirpath, fname in self._own_files():
            full = os.path.join(dirpath, fname)
            if _OWN_TMP.match(fname):
                unlink_quietly(full)
                report["temp_removed"] += 1
                continue
            key = _key_from_name(fname)
            if key is None or full != self._file(key):
                continue  # not ours: leave it alone
            meta = _read_meta(full, key, self.capacity_bytes)
            if meta is None:
                unlink_quietly(full)
                report["corrupt_removed"] += 1
                continue
            self._index[key] = meta
            self._used += meta.length
            report["entries"] += 1
        if report["corrupt_removed"]:
            self.stats.add(corrupt=report["corrupt_removed"])
        return report

    def _own_files(self) -> Iterator[tuple[str, str]]:
        """(directory, name) of the regular files in the root and its fan-out subdirectories:
        the only places this tier writes. Nothing deeper (a user's files) is ever visited."""
        dirs = [self.path]
        try:
            with os.scandir(self.path) as it:
                dirs += [e.path for e in it if _FANOUT_DIR.match(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for d in dirs:
            try:
                with os.scandir(d) as it:
                    names = [e.name for e in it if e.is_file(follow_symlinks=False)]
            except OSError:
                continue
            for name in names:
                yield d, name

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT is in use (asked for and supported here)."""
        return self._direct

    def used_bytes(self) -> int:
        """Payload bytes of the indexed files (headers not counted)."""
        with self._lock:
            return self._used

    # --- the protocol --------------------------------------------------------------------------

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._index

    def contains_many(self, keys) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def size_of(self, key: Key) -> int | None:
        with self._lock:
            meta = self._index.get(key)
            return None if meta is None else meta.length

    def keys(self) -> Iterator[Key]:
        with self._lock:
            snapshot = list(self._index)
        return iter(snapshot)

    def get_into(self, key: Key, out) -> int | None:
        """Read ``key``'s payload straight into ``out`` (a writable contiguous buffer).

        Returns the byte count, or None on a miss, a corrupt file (removed, ``stats.corrupt``), a
        fault or a too-small ``out`` (``stats.errors``). After a None, ``out``'s contents are
        unspecified; after a number, its first bytes are exactly the stored payload.
        """
        dst = memoryview(out).cast("B")
        if dst.readonly:
            raise ValueError("output buffer is read-only")
        with self._lock:
            meta = self._index.get(key)
            if meta is not None and dst.nbytes >= meta.length:
                try:
                    fd = os.open(self._file(key), os.O_RDONLY | (_O_DIRECT if self._direct else 0))
                except FileNotFoundError:  # removed behind our back
                    self._forget_locked(key, meta)
                    meta = None
                except OSError as exc:
                    self.stats.add(errors=1)
                    log.warning("disk tier %s: cannot open %s: %s", self.name, key.hex(), exc.strerror)
                    return None
        if meta is None:
            self.stats.add(misses=1)
            return None
        if dst.nbytes < meta.length:
            self.stats.add(errors=1)
            return None
        try:
            if self._direct:
                self._read_direct(fd, key, meta, dst)
            else:
                self._read_buffered(fd, key, meta, dst)
        except CorruptEntry as exc:
            self._drop_corrupt(key, meta, str(exc))
            return None
        except OSError as exc:
            self.stats.add(errors=1)
            log.warning("disk tier %s: read of %s failed: %s", self.name, key.hex(), exc.strerror)
            return None
        finally:
            os.close(fd)
        self.stats.add(hits=1, bytes_read=meta.length)
        return meta.length

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Write ``data`` atomically; False when over capacity (``stats.dropped``) or on a fault
        such as a full disk (``stats.errors``). Never raises for those. The tier keeps no
        reference to ``data``."""
        src = memoryview(data).cast("B")
        header = encode_header(key, src, dtype, shape)  # ValueError for a bad dtype/shape/key
        with self._lock:
            old = self._index.get(key)
            if self._used - (old.length if old else 0) + src.nbytes > self.capacity_bytes:
                self.stats.add(dropped=1)
                return False
        final = self._file(key)
        tmp = f"{final}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}"
        try:
            with self._write_slots:
                self._write_file(tmp, header, src)
            with self._lock:
                old = self._index.get(key)
                grow = src.nbytes - (old.length if old else 0)
                if self._used + grow > self.capacity_bytes:  # concurrent puts filled it meanwhile
                    unlink_quietly(tmp)
                    self.stats.add(dropped=1)
                    return False
                os.replace(tmp, final)
                self._index[key] = _Meta(len(header), src.nbytes, _checksum_of(header))
                self._used += grow
            if self.config.fsync:
                fsync_dir(os.path.dirname(final))
        except OSError as exc:
            unlink_quietly(tmp)
            self.stats.add(errors=1)
            log.warning("disk tier %s: write of %s failed: %s", self.name, key.hex(),
                        exc.strerror or exc)
            return False
        self.stats.add(puts=1, bytes_written=src.nbytes)
        return True

    def delete(self, key: Key) -> bool:
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is None:
                return False
            self._used -= meta.length
            unlink_quietly(self._file(key))
        self.stats.add(deletes=1)
        return True

    def close(self) -> None:
        """Forget the index (files stay on disk for the next start), free bounce buffers and
        release the directory's lock."""
        with self._lock:
            self._index.clear()
            self._used = 0
            self._release_lock()
        while True:
            try:
                self._bounce.get_nowait().free()
            except queue.Empty:
                break

    # --- file I/O ------------------------------------------------------------------------------

    def _file(self, key: Key) -> str:
        return entry_path(self.path, key, self.config.fanout)

    def _write_file(self, tmp: str, header: bytes, src: memoryview) -> None:
        if self.config.fanout:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
        if self._direct:
            try:
                self._write_direct(tmp, header, src)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("disk tier %s: O_DIRECT write refused (%s); using buffered I/O",
                         self.name, exc.strerror)
                self._direct = False
                unlink_quietly(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, [header, src])
            self._settle(fd)
        finally:
            os.close(fd)

    def _write_direct(self, tmp: str, header: bytes, src: memoryview) -> None:
        total = len(header) + src.nbytes
        bounce = self._bounce.get()
        try:
            buf = bounce.reserve(_round_up(total))
            buf[: len(header)] = header
            buf[len(header) : total] = src
            buf[total : _round_up(total)] = bytes(_round_up(total) - total)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
            try:
                write_all(fd, [buf[: _round_up(total)]])
                os.ftruncate(fd, total)
                self._settle(fd)
            finally:
                os.close(fd)
        finally:
            self._bounce.put(bounce)

    def _settle(self, fd: int) -> None:
        """Bound dirty page cache (flush + drop this file's pages); make durable if asked."""
        if self.config.fsync:
            os.fsync(fd)
        elif self.config.drop_cache:
            os.fdatasync(fd)
        if self.config.drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _read_buffered(self, fd: int, key: Key, meta: _Meta, dst: memoryview) -> None:
        """Header into a small buffer, payload straight into the caller's buffer: one preadv."""
        if os.fstat(fd).st_size != meta.header_bytes + meta.length:
            raise CorruptEntry("file size does not match its header")
        head = bytearray(meta.header_bytes)
        body = dst[: meta.length]
        try:
            read_exact(fd, [memoryview(head), body])
        except ShortRead:
            raise CorruptEntry("file is truncated") from None
        self._check(key, meta, head, body)

    def _read_direct(self, fd: int, key: Key, meta: _Meta, dst: memoryview) -> None:
        total = meta.header_bytes + meta.length
        if os.fstat(fd).st_size != total:
            raise CorruptEntry("file size does not match its header")
        bounce = self._bounce.get()
        try:
            buf = bounce.reserve(_round_up(total))
            got = read_upto(fd, [buf[: _round_up(total)]])
            if got < total:
                raise CorruptEntry("short read")
            self._check(key, meta, buf[: meta.header_bytes], buf[meta.header_bytes : total])
            dst[: meta.length] = buf[meta.header_bytes : total]
        finally:
            self._bounce.put(bounce)

    def _check(self, key: Key, meta: _Meta, head, body) -> None:
        header = decode_header(head)
        if header.header_bytes != meta.header_bytes or header.length != meta.length:
            raise CorruptEntry("header changed since it was indexed")
        verify(header, body, expected_key=key)

    def _drop_corrupt(self, key: Key, meta: _Meta, why: str) -> None:
        log.warning("disk tier %s: removing corrupt entry %s (%s)", self.name, key.hex(), why)
        self.stats.add(corrupt=1)
        with self._lock:
            # Only if nobody replaced it meanwhile: never remove a good new file.
            if self._index.get(key) is meta:
                self._forget_locked(key, meta)
                unlink_quietly(self._file(key))

    def _forget_locked(self, key: Key, meta: _Meta) -> None:
        if self._index.get(key) is meta:
            del self._index[key]
            self._used -= meta.length


class _Bounce:
    """A page-aligned buffer for O_DIRECT (anonymous mmap), grown on demand, reused."""

    def __init__(self):
        self._map: mmap.mmap | None = None

    def reserve(self, nbytes: int) -> memoryview:
        if self._map is None or len(self._map) < nbytes:
            self.free()
            self._map = mmap.mmap(-1, max(nbytes, _ALIGN))
        return memoryview(self._map)

    def free(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC frees it later
                pass
            self._map = None


def _read_meta(path: str, key: Key, max_length: int) -> _Meta | None:
    """Index record from a file's header, or None when the header or the file size is wrong or
    the header announces more than ``max_length`` payload bytes (a forged or foreign length)."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(MAX_HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
        header = decode_header(head, max_length)
    except (OSError, CorruptEntry):
        return None
    if header.key != key or size != header.header_bytes + header.length:
        return None
    return _Meta(header.header_bytes, header.length, header.checksum)


def _checksum_of(header_bytes: bytes) -> int:
    return decode_header(header_bytes).checksum


def _key_from_name(name: str) -> Key | None:
    if len(name) != 64:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


__all__ = ["DiskTier", "DiskConfig"]


def entry_path(root: str, key: Key, fanout: bool) -> str:
    """Where a disk tier rooted at ``root`` keeps ``key``'s file (InvalidKey for a non-key)."""
    name = check_key(key).hex()
    return os.path.join(root, name[:2], name) if fanout else os.path.join(root, name)


class DiskProbe:
    """Existence checks on a disk tier's directory without opening the tier.

    For a process that only answers lookups while another process owns the tier (vLLM's
    scheduler beside its worker): no scan, no clean-up, no writes. A file that exists may still
    turn out corrupt when read; the reader then reports a miss.
    """

    def __init__(self, config: DiskConfig):
        self.root = os.path.abspath(config.path)
        self.fanout = config.fanout

    def contains_many(self, keys) -> list[bool]:
        """Whether a file exists for each key, in order."""
        return [os.path.exists(entry_path(self.root, k, self.fanout)) for k in keys]

    def close(self) -> None:
        """Nothing to release (the probe holds no file open)."""

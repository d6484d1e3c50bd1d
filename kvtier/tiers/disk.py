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

A directory nobody else may write: at start the directory and each fan-out subdirectory must
belong to this process's user or root and be writable by neither group nor others (``kvtier
serve``'s rule for its socket directory, ``kvtier.fileio.untrusted_dir``); otherwise the tier
refuses to start (TierUnavailable, one line). Every file and subdirectory is opened relative to
a directory descriptor without following a symbolic link (the lock file too): a fan-out name that
is a symlink or not a directory is skipped (counted in ``stats.errors``, nothing written, read
or deleted through it), and an entry name that is not a regular file (a FIFO, a symlink) is a
counted corrupt miss, opened with ``O_NONBLOCK`` so it never blocks. No file is opened under
the tier lock, so a slow or odd file never holds up calls for other keys. Files are created with
``mode`` (default ``"0600"``, owner only; e.g. ``"0640"`` lets ``group`` read) and fan-out
directories with the same bits plus search (``0700``).

With ``o_direct`` (the default where the file system takes it) a file's bytes go to and come
from the device through an aligned buffer of the tier's, never through the page cache: no
kernel copy, no deferred writeback that a later re-read queues behind, no dirty pages.
Otherwise (``o_direct: false``, or a file system that refuses it), dirty page cache stays
bounded: with ``drop_cache`` (the default) each written file's writeback
starts as soon as it is written (``POSIX_FADV_DONTNEED``), and once more than
``DROP_BEHIND_BYTES`` (or ``DROP_BEHIND_FILES`` files) wait, the oldest is written back
(``kvtier.fileio.write_back``: no journal commit per file, unlike ``fdatasync``) and its pages
dropped; at most ``max_writes_in_flight`` writes run at once. So a container's memory limit is
not eaten by dirty pages (the OOMKilled pitfall), and a put costs no flush of its own (a
first-pass write-through competes less with the engine for the cores). Not a durability
promise: entries are checksummed, and ``fsync`` makes each put durable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import re
import stat
import threading
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator

from kvtier.config import Size, ranged, validate
from kvtier.entry import MAX_HEADER_BYTES, check_key, decode_header, encode_header, verify
from kvtier.errors import CorruptEntry, TierUnavailable
from kvtier.fastcopy import copy_pairs
from kvtier.fileio import (NotRegularFile, ShortRead, create_exclusive_at, dir_mode_for, make_dir_at, open_dir_at,
                           open_regular_at, parse_mode, read_exact, read_upto, resolve_group, set_direct,
                           unlink_quietly, untrusted_dir, write_all, write_back)
from kvtier.keys import Key
from kvtier.tiers.direct import O_DIRECT, BouncePool, DirectMode, round_up, write_new
from kvtier.tiers.direct import refused as direct_refused
from kvtier.tiers.base import RankShare, SchedulerView, Tier, check_file_modes

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
# The only temp names this tier creates (and so the only ones its start-up scan removes): an
# entry being written, and the start-up probes.
_OWN_TMP = re.compile(r"^(?:[0-9a-f]{64}\.[0-9a-f]{12}|\.(?:probe|direct)-[0-9a-f]{32})\.tmp$")
_FANOUT_DIR = re.compile(r"^[0-9a-f]{2}$")
LOCK_NAME = ".kvtier.lock"
# drop_cache: written files whose pages are dropped later (their writeback done by then)
DROP_BEHIND_BYTES = 64 << 20
DROP_BEHIND_FILES = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True)
class DiskConfig:
    """Configuration of a disk tier.

    path: the directory (created if missing).
    capacity: payload bytes the tier may hold, e.g. "100GiB"; a put beyond it is dropped.
    o_direct: read and write with O_DIRECT through aligned bounce buffers, bypassing the page
        cache (the default); where the filesystem refuses it (tmpfs) the tier falls back to
        buffered I/O (one info line). Measured in an engine (``kvtier demo --settings
        vllm,kvtier-ram+disk,kvtier-ram+disk-buffered``): a KV-heavy re-read from this tier took
        ~300 ms direct against ~1,000-1,150 ms buffered, the first pass's cost the same or lower;
        False writes into the page cache (faster for one thread outside an engine: 1.7-2.0
        against 0.9-1.1 GB/s with the flush).
    drop_cache: after writing a file through the page cache (buffered I/O), start its writeback,
        and drop its pages a few files later (at most DROP_BEHIND_BYTES of written files keep
        their pages); a file written with O_DIRECT has none.
    fsync: make each put durable (fsync the file and the directory) before it returns True.
    max_writes_in_flight: writes running at once; further puts wait for a slot.
    fanout: spread files over 256 subdirectories by the first key byte.
    mode: permission bits of created files, an octal string ("0600": owner only; "0640" lets the
        group read); group and others may never write. Directories get the same bits plus search.
    group: group name or gid given to created files and directories (None: the default).
    """

    path: str
    capacity: Size = ranged(Size(10 * 1024**3), ge=1)
    o_direct: bool = True
    drop_cache: bool = True
    fsync: bool = False
    max_writes_in_flight: int = ranged(4, ge=1, le=1024)
    fanout: bool = True
    mode: str = "0600"
    group: str | None = None

    def check(self, where: str) -> None:
        """ConfigError (one line) for a ``mode`` that is not an octal permission string keeping
        owner read/write without group/other write, or a ``group`` unknown here."""
        check_file_modes(self, where, no_shared_write=True)


@dataclass(frozen=True)
class _Meta:
    """What the index knows of one file (from its header)."""

    header_bytes: int
    length: int
    checksum: int
    ino: int = 0  # the file's identity when indexed: a reader retries if a put replaced it
    dev: int = 0


class _SkippedDir(Exception):
    """A fan-out name that is a symbolic link or not a directory (nothing goes through it)."""


class DiskTier(Tier):
    """A directory of entry files.

    Thread-safety: every method may be called from any thread. The index, renames and unlinks
    happen under one lock; opens, reads and writes of file contents run outside it. A reader
    opens the file after taking its index record and compares the file's inode with the
    record's: when a put replaced the file meanwhile it takes the new record (a deleted file is
    a miss), so it reads the file the index described, and the checksum decides the rest.
    """

    Config = DiskConfig
    medium = "DISK"
    kv_event_medium = "STORAGE"
    locality = "LOCAL"
    self_managed = False

    def __init__(self, config: DiskConfig, name: str = "disk"):
        super().__init__(config, name)
        validate(config, name)
        self.config = config
        self.path = os.path.abspath(config.path)
        self._mode = parse_mode(config.mode, no_shared_write=True)
        self._dir_mode = dir_mode_for(self._mode)
        self._gid = resolve_group(config.group)
        self.skipped_dirs: list[str] = []  # fan-out names skipped at start (symlinks, files)
        self._lock = threading.Lock()
        self._index: dict[Key, _Meta] = {}
        self._used = 0
        self._write_slots = threading.BoundedSemaphore(config.max_writes_in_flight)
        self._bounce = BouncePool(config.max_writes_in_flight)
        self._drop_behind = _DropBehind(DROP_BEHIND_BYTES, DROP_BEHIND_FILES, self.stats)
        self._prepare_directory()
        self._lock_file: io.FileIO | None = self._take_lock()
        try:
            with self._entry_dir("") as root:
                self._direct = DirectMode.start(config.o_direct, root, self._mode, self._gid, log,
                                                f"disk tier {self.name}", self.path, "using buffered I/O")
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
        """Create the directory (``mode`` bits), check that nobody else can write it and prove
        it writable; TierUnavailable with one line if not."""
        probe = f".probe-{uuid.uuid4().hex}{_TMP_SUFFIX}"
        try:
            if not os.path.isdir(self.path):
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                os.close(make_dir_at(None, self.path, self._dir_mode, self._gid))
            root = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name}: cannot use directory {self.path}: {exc.strerror or exc}"
            ) from exc
        try:
            self._refuse_untrusted(root, self.path)
            self._refuse_untrusted_fanouts(root)
            os.close(create_exclusive_at(root, probe, self._mode, self._gid))
            os.unlink(probe, dir_fd=root)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name}: cannot use directory {self.path}: {exc.strerror or exc}"
            ) from exc
        finally:
            os.close(root)

    def _refuse_untrusted_fanouts(self, root: int) -> None:
        """``_refuse_untrusted`` for each real fan-out directory, before anything is written."""
        with os.scandir(root) as it:
            subs = sorted(e.name for e in it if _FANOUT_DIR.match(e.name))
        for sub in subs:
            try:
                fd = self._open_fanout(root, sub, create=False)
            except (_SkippedDir, OSError):
                continue  # skipped (and counted) by the scan
            try:
                self._refuse_untrusted(fd, os.path.join(self.path, sub))
            finally:
                os.close(fd)

    def _refuse_untrusted(self, fd: int, path: str) -> None:
        """TierUnavailable (one line) unless the directory ``fd`` belongs to this user or root
        and neither group nor others can write it."""
        problem = untrusted_dir(os.fstat(fd), "process")
        if problem:
            raise TierUnavailable(
                f"disk tier {self.name}: directory {path} {problem}; another user could plant, swap or "
                f"remove entries in it: give the tier a directory only this user can write")

    def _take_lock(self) -> io.FileIO:
        """Exclusive flock on ``<dir>/.kvtier.lock`` (held while the tier is open or referenced,
        released by the kernel if the process dies); TierUnavailable naming the directory if
        another tier, in this process or another, holds it."""
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = self._open_lock_file()
            lock = io.FileIO(fd, "r+")  # O_CLOEXEC; a dropped tier's lock closes with it
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name}: cannot create lock file {lock_path}: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise TierUnavailable(
                    f"disk tier {self.name}: directory {self.path} is in use by another kvtier "
                    f"store (lock {lock_path} is held); give each store its own directory"
                ) from exc
            raise TierUnavailable(
                f"disk tier {self.name}: cannot lock {lock_path}: {exc.strerror or exc}"
            ) from exc
        return lock

    def _open_lock_file(self) -> int:
        """The lock file's descriptor, created (``mode``) if missing, never through a symbolic
        link and never blocking; NotRegularFile when something else holds the name."""
        root = os.open(self.path, _DIR_FLAGS)
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         self._mode, dir_fd=root)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegularFile(exc.errno, "it is a symbolic link") from exc
            raise
        finally:
            os.close(root)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotRegularFile(errno.EINVAL, "it is not a regular file")
        return fd

    def _release_lock(self) -> None:
        lock, self._lock_file = self._lock_file, None
        if lock is not None:
            lock.close()  # closing the only descriptor releases the flock

    def _scan(self) -> dict[str, int]:
        """Rebuild the index from the files' headers; remove temp and unparsable files."""
        report = {"entries": 0, "temp_removed": 0, "corrupt_removed": 0}
        for dfd, sub, fname in self._own_files():
            if _OWN_TMP.match(fname):
                unlink_quietly(fname, dfd)
                report["temp_removed"] += 1
                continue
            key = _key_from_name(fname)
            if key is None or sub != self._sub(key):
                continue  # not ours: leave it alone
            meta = _read_meta(dfd, fname, key, self.capacity_bytes)
            if meta is None:
                unlink_quietly(fname, dfd)
                report["corrupt_removed"] += 1
                continue
            self._index[key] = meta
            self._used += meta.length
            report["entries"] += 1
        if report["corrupt_removed"]:
            self.stats.add(corrupt=report["corrupt_removed"])
        return report

    def _own_files(self) -> Iterator[tuple[int, str, str]]:
        """(directory descriptor, fan-out name or "", name) of the regular files in the root and
        its fan-out subdirectories: the only places this tier writes. Nothing deeper (a user's
        files) is ever visited; a fan-out name that is a symlink or not a directory is skipped
        and counted; a fan-out directory another user could write refuses the start."""
        try:
            root = os.open(self.path, _DIR_FLAGS)
        except OSError:
            return
        try:
            with os.scandir(root) as it:
                subs = sorted(e.name for e in it if _FANOUT_DIR.match(e.name))
            yield from self._files_in(root, "")
            for sub in subs:
                try:
                    dfd = self._open_fanout(root, sub, create=False)
                except _SkippedDir as exc:
                    self._skip(sub, str(exc))
                    continue
                except OSError:
                    continue
                try:
                    self._refuse_untrusted(dfd, os.path.join(self.path, sub))
                    yield from self._files_in(dfd, sub)
                finally:
                    os.close(dfd)
        except OSError:
            return
        finally:
            os.close(root)

    @staticmethod
    def _files_in(dfd: int, sub: str) -> Iterator[tuple[int, str, str]]:
        with os.scandir(dfd) as it:
            names = [e.name for e in it if e.is_file(follow_symlinks=False)]
        for name in names:
            yield dfd, sub, name

    def _skip(self, sub: str, why: str) -> None:
        """Count a fan-out name that is not used (warned once per name)."""
        self.stats.add(errors=1)
        if sub not in self.skipped_dirs:
            self.skipped_dirs.append(sub)
            log.warning("disk tier %s: skipping %s: it %s; nothing is written, read or deleted through it",
                        self.name, os.path.join(self.path, sub), why)

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT is in use (asked for and supported here)."""
        return self._direct.on

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
        opened = self._open_indexed(key, dst.nbytes)
        if opened is None:
            return None
        fd, meta, direct = opened
        try:
            if direct:
                try:
                    self._read_direct(fd, key, meta, dst)
                except OSError as exc:
                    if not direct_refused(exc):
                        raise
                    self._direct.refuse("read", exc)  # then this read, buffered
                    set_direct(fd, False)
                    self._read_buffered(fd, key, meta, dst)
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

    def _open_indexed(self, key: Key, room: int) -> tuple[int, _Meta, bool] | None:
        """(descriptor, index record, whether it is open with O_DIRECT) of ``key``'s file, opened
        outside the tier lock and without blocking; None (counted) on a miss, a too-small buffer
        (``room`` bytes), a fault, or a name that is not a regular file (a corrupt miss: dropped).
        When a put replaced the file between the record and the open, the new record is taken (a
        few tries). O_DIRECT refused on the file (EINVAL) turns the tier buffered (one info line)
        and the file is opened again without it."""
        for _attempt in range(5):
            with self._lock:
                meta = self._index.get(key)
            if meta is None:
                self.stats.add(misses=1)
                return None
            if room < meta.length:
                self.stats.add(errors=1)
                return None
            direct = self._direct.on
            try:
                with self._entry_dir(self._sub(key)) as dfd:  # an indexed key is a valid key
                    fd, st = open_regular_at(dfd, bytes(key).hex(), O_DIRECT if direct else 0)
            except FileNotFoundError:  # removed behind our back (or by a delete just now)
                with self._lock:
                    self._forget_locked(key, meta)
                self.stats.add(misses=1)
                return None
            except (NotRegularFile, _SkippedDir) as exc:
                self._drop_corrupt(key, meta, str(exc) or "not a regular file")
                return None
            except OSError as exc:
                if direct and direct_refused(exc):
                    self._direct.refuse("open", exc)
                    continue
                self.stats.add(errors=1)
                log.warning("disk tier %s: cannot open %s: %s", self.name, key.hex(), exc.strerror)
                return None
            if (st.st_ino, st.st_dev) == (meta.ino, meta.dev):
                return fd, meta, direct
            with self._lock:
                replaced = self._index.get(key) is not meta
            if not replaced:
                return fd, meta, direct  # swapped behind the index: the header and checksum decide
            os.close(fd)
        self.stats.add(misses=1)
        return None

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Write ``data`` atomically; False when over capacity (``stats.dropped``) or on a fault
        such as a full disk (``stats.errors``). Never raises for those. The tier keeps no
        reference to ``data``."""
        src = memoryview(data).cast("B")
        header = encode_header(key, src, dtype, shape, self.auth)  # ValueError for a bad dtype/shape/key
        with self._lock:
            old = self._index.get(key)
            if self._used - (old.length if old else 0) + src.nbytes > self.capacity_bytes:
                self.stats.add(dropped=1)
                return False
        name = key.hex()
        tmp = f"{name}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}"
        try:
            with self._entry_dir(self._sub(key), create=True) as dfd:
                if not self._publish(dfd, key, tmp, header, src):
                    return False
        except _SkippedDir as exc:
            self._skip(self._sub(key), str(exc))
            self.stats.add(dropped=1)
            return False
        except OSError as exc:
            self.stats.add(errors=1)
            log.warning("disk tier %s: write of %s failed: %s", self.name, key.hex(),
                        exc.strerror or exc)
            return False
        self.stats.add(puts=1, bytes_written=src.nbytes)
        return True

    def _publish(self, dfd: int, key: Key, tmp: str, header: bytes, src: memoryview) -> bool:
        """Write the temp file in ``dfd`` and rename it over the key's name; False (dropped,
        temp removed) when concurrent puts filled the capacity meanwhile. OSError for faults
        (the temp is removed)."""
        try:
            with self._write_slots:
                st = self._write_file(dfd, tmp, header, src)
            with self._lock:
                old = self._index.get(key)
                grow = src.nbytes - (old.length if old else 0)
                if self._used + grow > self.capacity_bytes:  # concurrent puts filled it meanwhile
                    unlink_quietly(tmp, dfd)
                    self.stats.add(dropped=1)
                    return False
                os.replace(tmp, key.hex(), src_dir_fd=dfd, dst_dir_fd=dfd)
                self._index[key] = _Meta(len(header), src.nbytes, _checksum_of(header), st.st_ino, st.st_dev)
                self._used += grow
            if self.config.fsync:
                os.fsync(dfd)
        except OSError:
            unlink_quietly(tmp, dfd)
            raise
        return True

    def delete(self, key: Key) -> bool:
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is None:
                return False
            self._used -= meta.length
            self._unlink_entry(key)
        self.stats.add(deletes=1)
        return True

    def _unlink_entry(self, key: Key) -> None:
        """Remove ``key``'s name from its real fan-out directory (no link followed; a
        directory open never blocks, so this may run under the tier lock)."""
        try:
            with self._entry_dir(self._sub(key)) as dfd:
                unlink_quietly(key.hex(), dfd)
        except (OSError, _SkippedDir):
            pass

    def drop_cached(self) -> None:
        """Write back the files whose pages ``drop_cache`` has not dropped yet and drop them now
        (e.g. before timing cold reads); nothing to do without ``drop_cache``."""
        self._drop_behind.flush()

    def close(self) -> None:
        """Forget the index (files stay on disk for the next start), free bounce buffers and
        release the directory's lock.

        The bounce pool keeps its slots (``BouncePool.release_memory``): a direct put or read
        that runs after ``close`` (or races it) maps its buffer again."""
        with self._lock:
            self._index.clear()
            self._used = 0
            self._release_lock()
        self._drop_behind.close()
        self._bounce.release_memory()

    # --- file I/O ------------------------------------------------------------------------------

    def _file(self, key: Key) -> str:
        """The key's file path (for people and tests; I/O goes through ``_entry_dir``)."""
        return entry_path(self.path, key, self.config.fanout)

    def _sub(self, key: Key) -> str:
        """The fan-out directory name of ``key`` ("" without fan-out)."""
        return check_key(key).hex()[:2] if self.config.fanout else ""

    def _open_fanout(self, root: int, sub: str, create: bool) -> int:
        """Descriptor of the real fan-out directory ``sub`` in ``root`` (created with ``mode``
        when ``create``); _SkippedDir for a symlink or a non-directory."""
        try:
            try:  # opened first: a mkdir that fails with EEXIST is a system call on every put
                return open_dir_at(root, sub)
            except FileNotFoundError:
                if not create:
                    raise
            return make_dir_at(root, sub, self._dir_mode, self._gid)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _SkippedDir("is a symbolic link or not a directory") from exc
            raise

    @contextlib.contextmanager
    def _entry_dir(self, sub: str, create: bool = False):
        """The directory descriptor that holds entries of fan-out ``sub`` ("": the root),
        closed on exit. No open here can block (directories only, no link followed)."""
        root = os.open(self.path, _DIR_FLAGS)
        if not sub:
            try:
                yield root
            finally:
                os.close(root)
            return
        try:
            fd = self._open_fanout(root, sub, create)
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    def _write_file(self, dfd: int, tmp: str, header: bytes, src: memoryview) -> os.stat_result:
        """Write header + payload to the new file ``tmp`` in ``dfd``; its fstat."""
        if self._direct.on:
            try:
                return self._write_direct(dfd, tmp, header, src)
            except OSError as exc:
                if not direct_refused(exc):
                    raise
                self._direct.refuse("write", exc)
                unlink_quietly(tmp, dfd)
        fd = create_exclusive_at(dfd, tmp, self._mode, self._gid)
        try:
            write_all(fd, [header, src])
            self._settle(fd, len(header) + src.nbytes)
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _write_direct(self, dfd: int, tmp: str, header: bytes, src: memoryview) -> os.stat_result:
        """Write header + payload through an aligned bounce buffer with O_DIRECT
        (``kvtier.tiers.direct``: the page cache, its writeback and the engine's Python threads
        are left alone); its fstat."""
        with self._bounce.take() as buf:
            fd = write_new(dfd, tmp, self._mode, self._gid, header, src, buf)
        try:
            self._settle(fd, len(header) + src.nbytes, cached=False)
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _settle(self, fd: int, size: int, cached: bool = True) -> None:
        """Make the new file (``size`` bytes) durable if asked (``fsync``, then its pages
        dropped), or with ``drop_cache`` hand a duplicate of ``fd`` to the drop-behind (its
        writeback starts now). ``cached``: False for a file written with O_DIRECT, which left no
        pages in the page cache to write back or drop (only ``fsync`` applies)."""
        if self.config.fsync:
            os.fsync(fd)
            if cached and self.config.drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif cached and self.config.drop_cache:
            self._drop_behind.add(os.dup(fd), size)

    def _read_buffered(self, fd: int, key: Key, meta: _Meta, dst: memoryview) -> None:
        """Header into a small buffer, payload straight into the caller's buffer: one preadv."""
        if os.fstat(fd).st_size != meta.header_bytes + meta.length:
            raise CorruptEntry("file size does not match its header")
        head = bytearray(meta.header_bytes)
        body = dst[: meta.length]
        try:
            read_exact(fd, [memoryview(head), body])
        except ShortRead as exc:
            raise CorruptEntry("file is truncated") from exc
        self._check(key, meta, head, body)

    def _read_direct(self, fd: int, key: Key, meta: _Meta, dst: memoryview) -> None:
        total = meta.header_bytes + meta.length
        if os.fstat(fd).st_size != total:
            raise CorruptEntry("file size does not match its header")
        with self._bounce.take() as bounce:
            buf = bounce.reserve(round_up(total))
            got = read_upto(fd, [buf[: round_up(total)]])
            if got < total:
                raise CorruptEntry("short read")
            self._check(key, meta, buf[: meta.header_bytes], buf[meta.header_bytes : total])
            copy_pairs([(dst[: meta.length], buf[meta.header_bytes : total])])

    def _check(self, key: Key, meta: _Meta, head, body) -> None:
        header = decode_header(head, auth=self.auth)
        if header.header_bytes != meta.header_bytes or header.length != meta.length:
            raise CorruptEntry("header changed since it was indexed")
        verify(header, body, expected_key=key, auth=self.auth)  # raw only: this tier has no codec

    def _drop_corrupt(self, key: Key, meta: _Meta, why: str) -> None:
        """Remove ``key``'s entry, found corrupt under the record ``meta`` (counted, one warning),
        unless a put replaced it meanwhile: then the file read was the new one under the old
        record (its inode number reused), a miss, and the good new file stays."""
        with self._lock:
            current = self._index.get(key) is meta
            if current:
                self._forget_locked(key, meta)
                self._unlink_entry(key)
        if not current:
            self.stats.add(misses=1)
            return
        log.warning("disk tier %s: removing corrupt entry %s (%s)", self.name, key.hex(), why)
        self.stats.add(corrupt=1)

    def _forget_locked(self, key: Key, meta: _Meta) -> None:
        if self._index.get(key) is meta:
            del self._index[key]
            self._used -= meta.length


class _DropBehind:
    """Files written with ``drop_cache``, their pages dropped a little later, off the write path.

    ``add(fd, size)`` takes ownership of a descriptor of a just-written file and starts its
    writeback (``POSIX_FADV_DONTNEED`` starts it and drops the pages already clean). Once more
    than ``max_bytes`` or ``max_files`` wait, the oldest are settled on the adding thread: written
    back (``write_back``, normally done by then; no journal commit), their pages dropped, their
    descriptors closed. ``close`` settles every file left. A fault while settling is counted in
    ``stats.errors`` (the entry's checksum catches bad data on read). Thread-safe."""

    def __init__(self, max_bytes: int, max_files: int, stats):
        self._max_bytes = max_bytes
        self._max_files = max_files
        self._stats = stats
        self._lock = threading.Lock()
        self._files: deque[tuple[int, int]] = deque()  # (fd, size), oldest first
        self._bytes = 0
        self._closed = False  # after close, each file is settled on its own put

    def add(self, fd: int, size: int) -> None:
        """Own ``fd`` (a written file of ``size`` bytes); settle the oldest files over the bounds."""
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            self._stats.add(errors=1)
        due = []
        with self._lock:
            self._files.append((fd, size))
            self._bytes += size
            while self._files and (self._closed or self._bytes > self._max_bytes
                                   or len(self._files) > self._max_files):
                due.append(self._files.popleft())
                self._bytes -= due[-1][1]
        for old, _ in due:
            self._settle(old)

    def flush(self) -> None:
        """Settle every file waiting now: written back, pages dropped, descriptors closed."""
        with self._lock:
            due, self._bytes = list(self._files), 0
            self._files.clear()
        for fd, _ in due:
            self._settle(fd)

    def close(self) -> None:
        """Settle every file still waiting (and, from now on, each file on its own put)."""
        with self._lock:
            self._closed = True
        self.flush()

    def _settle(self, fd: int) -> None:
        """Write back, drop and close one file; never raises (a fault is counted)."""
        try:
            write_back(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except Exception:  # an OSError, or a platform without the calls: the checksum guards reads
            self._stats.add(errors=1)
        try:
            os.close(fd)
        except OSError:  # NFS/FUSE report write errors at close
            self._stats.add(errors=1)


def _read_meta(dfd: int, name: str, key: Key, max_length: int) -> _Meta | None:
    """Index record from the header of file ``name`` in ``dfd``, or None when it is not a
    regular file, or the header or the file size is wrong, or the header announces more than
    ``max_length`` payload bytes (a forged or foreign length)."""
    try:
        fd, st = open_regular_at(dfd, name)
        try:
            head = os.pread(fd, MAX_HEADER_BYTES, 0)
        finally:
            os.close(fd)
        header = decode_header(head, max_length, check_auth=False)  # checked on every read
        if header.codec != 0:
            raise CorruptEntry("coded entry in a disk tier")
    except (OSError, CorruptEntry):
        return None
    if header.key != key or st.st_size != header.header_bytes + header.length:
        return None
    return _Meta(header.header_bytes, header.length, header.checksum, st.st_ino, st.st_dev)


def _is_regular_entry(path: str, fanout: bool) -> bool:
    """Whether ``path`` is a regular file in a real (not symlinked) fan-out directory."""
    try:
        if fanout and not stat.S_ISDIR(os.lstat(os.path.dirname(path)).st_mode):
            return False
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _checksum_of(header_bytes: bytes) -> int:
    return decode_header(header_bytes, check_auth=False).checksum


def _key_from_name(name: str) -> Key | None:
    if len(name) != 64:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


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
        """Whether a regular file exists for each key, in order (no link followed, nothing
        opened: a FIFO or a symlink at the name, or a symlinked fan-out directory, is absent)."""
        return [_is_regular_entry(entry_path(self.root, k, self.fanout), self.fanout) for k in keys]

    def close(self) -> None:
        """Nothing to release (the probe holds no file open)."""

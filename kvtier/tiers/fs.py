"""The ``fs`` tier: entry files in a shared POSIX directory (NFS, Lustre, CephFS) used by many nodes.

A file is ``<path>/<first key byte hex>/<key hex>`` holding the entry header followed by the
payload. Nothing is cached about which keys exist: another node may add or remove files at any
time, so ``contains``, ``size_of``, ``keys`` and ``get_into`` ask the file system each time.

Atomic publish: a writer writes a temp file named ``.<key hex>.<host>.<pid>.<tier>.<n>.tmp``
(``tier`` random per tier object, ``n`` its sequence; created exclusively) in the same directory
and renames it over the final name (``os.replace``). Concurrent writers of one key
(on one node or many) each publish a complete entry; the last rename wins, and a reader sees one
whole entry or none, never a torn one. A file that fails its header or checksum (a truncated copy,
bit rot, a foreign file) is a counted miss and is removed, but only if it is still the same file
(same inode) that was read, so a concurrent good publish is not removed.

A directory others write (hostile names): every file and fan-out directory is opened relative to
a directory descriptor, never through a symbolic link (``O_NOFOLLOW``). A fan-out name that is
not a real directory (a symlink to elsewhere, a file) is skipped and counted in ``stats.errors``:
nothing is written, read or deleted through it. An entry name that is not a regular file (a
FIFO, a symlink, a device) is a counted corrupt miss, opened with ``O_NONBLOCK`` so it never
blocks, and left alone; ``contains`` and ``keys`` do not report it. Files are created with
``mode`` (default ``"0600"``, owner only) and fan-out directories with the same bits plus search
(``0700``), in ``group`` when given, so sharing with other users is a deliberate setting. The
root and the fan-out directories may belong to anyone (the directory is shared by design), but
one that every user can write without the sticky bit is refused (at start: TierUnavailable with
one line; a fan-out directory that becomes so later: skipped and counted) unless ``mode`` grants
others write, which declares that sharing with every user is intended.

Byte budget (payload bytes, see ``_payload``): file sizes are summed by scanning the directory;
when over budget the oldest files by mtime are removed until ``low_watermark x capacity`` is
reached. Several nodes may scan at once; removing a file twice is harmless. Temp files older
than ``stale_tmp_s`` (a writer that crashed) are removed by the scan. A background thread scans
every ``usage_refresh_s`` seconds (the first scan right after start; 0: no thread, one scan at
start); a put scans on its own thread when this process's count goes over ``capacity`` or the
last scan is older than ``scan_interval_s``. The walk of a scan (a stat per entry) runs in a
helper process at the lowest CPU priority (``fs_scan.py``), never on this process's interpreter
lock: the scanning thread waits for its listing, sums it with numpy and removes what the budget
says; only when no helper can start does it walk here, pausing every ``_PACE_EVERY`` entries.
``used_bytes`` never scans: it answers from a counter, the last scan's total plus this process's
puts and deletes since (exact for this process's own changes, including those made while a scan
ran; other nodes' changes appear at the next scan).

Faults (EACCES, ENOSPC, EIO, a vanished mount) are counted in ``stats.errors`` and reported as a
miss / a False put, never raised. ``get_into`` reads straight into ``out`` and then verifies, so on
a corrupt miss ``out`` may hold garbage (it returns None; the caller must not use it).
All methods are thread-safe; ``close`` stops the scan thread.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from kvtier import entry
from kvtier.codecs import CodecName
from kvtier.config import Size, ranged, validate
from kvtier.errors import CorruptEntry, TierUnavailable
from kvtier.fileio import (NotRegularFile, ShortRead, create_exclusive_at, dir_mode_for, make_dir_at, open_dir_at,
                           open_regular_at, parse_mode, read_exact, resolve_group, unlink_at, write_all)
from kvtier.tiers import fs_scan
from kvtier.tiers.base import Key, Tier, check_file_modes
from kvtier.tiers.direct import BouncePool, DirectMode, write_new
from kvtier.tiers.direct import refused as direct_refused

log = logging.getLogger(__name__)

_TMP = fs_scan.TMP
_PACE_EVERY = 256  # entries a walk in this process (or removals by a scan) between pauses
_PACE_S = 0.001  # each pause: ~0.4 s more per 100,000 entries

_FANOUT = fs_scan.FANOUT
_DIR_FLAGS = fs_scan.DIR_FLAGS
# one record of a scan's listing (fs_scan.RECORD), sorted by key
_LISTING = np.dtype([("key", "S32"), ("size", "<i8"), ("mtime", "<f8"), ("ino", "<u8"), ("dev", "<u8")])
_DIRECT_SLOTS = 4  # O_DIRECT writes at once (each holds an aligned buffer as large as its entry)
_STUCK_RESCAN_S = 1.0  # least time between put-triggered scans while a scan could not get under budget


@dataclass(frozen=True)
class FsConfig:
    """Options of the ``fs`` tier.

    ``path``: the shared directory (created if missing). ``capacity``: bytes of entry files the
    tier keeps (all nodes together). ``fsync``: fsync each file before publishing it (durable
    across a node crash; slower). ``scan_interval_s``: a put scans when the last scan is older.
    ``usage_refresh_s``: period of the background scan that keeps ``used_bytes`` current with
    other writers (0: no background thread). ``mode``: permission bits of created files as an
    octal string (``"0600"``: owner only; e.g. ``"0640"`` to let a group read, ``"0660"`` to let
    it write too); directories get the same bits plus search. ``group``: group name or gid
    given to created files and directories (None: the process's default). ``codec``: ``none``
    (default), ``lossless`` (``kvtier.codecs``: entries that shrink are stored coded)
    or ``auto`` (coded only when the break-even rule says it pays on this tier),
    or ``fp8`` (lossy, opt-in: 16/32-bit float KV as E4M3 with a power-of-two scale per 32
    elements, 0.52 x the bytes; the engine's key namespace records it). ``o_direct``: write
    entry files with O_DIRECT through an aligned buffer of the tier's (``kvtier.tiers.direct``),
    so what this node writes skips its page cache (on NFS and Lustre: goes to the server
    without the client's cache); reads stay buffered, straight into the caller's buffer. Where
    the file system refuses it (tmpfs, some FUSE mounts) the tier writes buffered (one info
    line). Off by default: a shared file system's O_DIRECT semantics vary (NFS sends each write
    synchronously). On a CPU engine the buffered write's copy into the page cache is most of the
    writer's core time; measured with ``kvtier demo --settings
    vllm,kvtier-ram+fs,kvtier-ram+fs-direct --first-pairs 12`` (docs/benchmarks.md).
    """

    path: str
    capacity: Size = ranged(Size(100 * 1024**3), ge=1)
    fsync: bool = False
    scan_interval_s: float = ranged(30.0, ge=0)
    low_watermark: float = ranged(0.9, gt=0, le=1)
    stale_tmp_s: float = ranged(3600.0, ge=0)
    usage_refresh_s: float = ranged(10.0, ge=0, le=86400)
    mode: str = "0600"
    group: str | None = None
    codec: CodecName = "none"
    o_direct: bool = False

    def check(self, where: str) -> None:
        """ConfigError (one line) for a ``mode`` that is not an octal permission string keeping
        owner read/write, or a ``group`` unknown here."""
        check_file_modes(self, where)


_ForeignDir = fs_scan.ForeignDir


class _ScanFailed(Exception):
    """A scan's listing could not be taken (counted): the usage counter keeps its value."""


class _Ident(NamedTuple):
    """The identity of a file a scan listed: what ``unlink_at``'s ``same_as`` compares."""

    st_ino: int
    st_dev: int


class _Listing:
    """What one scan found: a record array (``_LISTING``) of entry files sorted by key, and the
    payload bytes of each (``_payload`` of its size)."""

    def __init__(self, records: np.ndarray):
        self.records = records
        self.payload = np.maximum(records["size"] - (entry.FIXED_BYTES + 8), 0)

    def total(self) -> int:
        return int(self.payload.sum())

    def payload_of(self, name: str) -> int:
        """Payload bytes listed for entry ``name`` (key hex); 0 when it was not listed."""
        keys = self.records["key"]
        # compared as S32 arrays: a scalar taken out of one loses its trailing NUL bytes
        k = np.array([bytes.fromhex(name)], dtype=keys.dtype)
        i = int(np.searchsorted(keys, k)[0])
        return int(self.payload[i]) if i < len(keys) and keys[i:i + 1] == k else 0


class FsTier(Tier):
    """Entry files in a shared directory; a shared tier with a scanned byte budget."""

    Config = FsConfig
    medium = "FS"
    kv_event_medium = "STORAGE"
    locality = "REMOTE"
    self_managed = True

    def __init__(self, config: FsConfig, name: str = "fs"):
        super().__init__(config, name)
        validate(config, name)
        self.config = config
        self._mode = parse_mode(config.mode)
        self._dir_mode = dir_mode_for(self._mode)
        self._gid = resolve_group(config.group)
        self._root = os.path.abspath(config.path)
        # temp names: host, process, this tier and a sequence (no random read per put); O_EXCL
        # makes a clash an error, never a shared file
        self._tag = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._seq = itertools.count()
        self._warned: set[str] = set()
        self._prepare_root()
        self._bounce = BouncePool(_DIRECT_SLOTS)
        root = os.open(self._root, _DIR_FLAGS)
        try:
            self._direct = DirectMode.start(config.o_direct, root, self._mode, self._gid, log, f"fs tier {name}",
                                            self._root, "writing through the page cache")
        finally:
            os.close(root)
        self._usage_lock = threading.Lock()  # guards _used/_pending/_last_scan; never held across I/O
        self._scan_lock = threading.Lock()  # one scan at a time in this process
        self._used = 0
        self._pending: dict[str, int] | None = None  # during a scan: key hex -> payload after our last change
        self._inflight: dict[str, int] = {}  # key hex -> this process's renames/unlinks of it under way
        self._scanned: dict[str, int] = {}  # in-flight key hex -> what the last scan counted for it
        self._last_scan = time.monotonic()
        self._stuck_until = 0.0  # a scan that could not get under budget: no put-triggered rescan before
        self._stop = threading.Event()
        self._helper: subprocess.Popen | None = None  # a scan's helper process while it runs
        self._helper_lock = threading.Lock()  # guards _helper (close kills it)
        self._thread: threading.Thread | None = None
        if config.usage_refresh_s > 0:
            self._thread = threading.Thread(target=_refresh_loop, name=f"kvtier-{name}-usage", daemon=True,
                                            args=(weakref.ref(self), self._stop, config.usage_refresh_s))
            self._thread.start()
        else:
            self._scan()

    # -- start ------------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        """Create the root if missing (``mode`` bits, ``group``); TierUnavailable with one line if
        it cannot be used or it, or a fan-out directory in it, is writable by every user without
        the sticky bit while ``mode`` does not declare sharing with every user."""
        try:
            if not os.path.isdir(self._root):
                os.makedirs(os.path.dirname(self._root), exist_ok=True)
                os.close(make_dir_at(None, self._root, self._dir_mode, self._gid))
            root = os.open(self._root, _DIR_FLAGS)
        except OSError as exc:
            raise TierUnavailable(f"fs tier {self.name}: cannot use directory {self._root}: "
                                  f"{exc.strerror or exc}") from exc
        try:
            problem = self._open_problem(os.fstat(root))
            if problem:
                raise TierUnavailable(f"fs tier {self.name}: directory {self._root} {problem}")
            with os.scandir(root) as it:
                subs = sorted(e.name for e in it if _FANOUT.match(e.name))
            for sub in subs:
                try:
                    os.close(self._open_fanout(root, sub, create=False))
                except _ForeignDir as exc:
                    if exc.unsafe:
                        raise TierUnavailable(f"fs tier {self.name}: directory {os.path.join(self._root, sub)} "
                                              f"{exc}") from exc
                    self._foreign(sub, str(exc))
                except OSError:
                    continue
        finally:
            os.close(root)

    @property
    def direct_io(self) -> bool:
        """Whether entry files are written with O_DIRECT (asked for and supported here)."""
        return self._direct.on

    def _open_problem(self, st: os.stat_result) -> str | None:
        """Why a directory with status ``st`` is refused, or None: every user may write it, it
        has no sticky bit, and ``mode`` does not grant others write (sharing with everyone)."""
        return fs_scan.open_problem(st, bool(self._mode & 0o002))

    # -- paths ------------------------------------------------------------------------------

    def _name(self, key: Key) -> str:
        return entry.check_key(key).hex()

    def _path(self, key: Key) -> str:
        name = self._name(key)
        return os.path.join(self._root, name[:2], name)

    def _open_fanout(self, root: int, sub: str, create: bool) -> int:
        """Descriptor of the real fan-out directory ``sub`` under the root descriptor (created
        with ``mode`` when ``create``). _ForeignDir when the name is a symlink or not a directory
        or the directory is refused (``_open_problem``); FileNotFoundError when absent."""
        try:
            try:  # opened first: a mkdir that fails with EEXIST is a system call on every put
                fd = open_dir_at(root, sub)
            except FileNotFoundError:
                if not create:
                    raise
                fd = make_dir_at(root, sub, self._dir_mode, self._gid)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _ForeignDir("is not a real directory (a symbolic link or a file)") from exc
            raise
        return fs_scan.vetted(fd, bool(self._mode & 0o002))

    @contextlib.contextmanager
    def _fanout(self, name: str, create: bool = False):
        """The fan-out directory of entry ``name`` as a descriptor (closed on exit)."""
        root = os.open(self._root, _DIR_FLAGS)
        try:
            fd = self._open_fanout(root, name[:2], create)
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    def _foreign(self, sub: str, why: str) -> None:
        """Count a fan-out name that is skipped (warned once per name)."""
        self.stats.add(errors=1)
        if sub not in self._warned:
            self._warned.add(sub)
            log.warning("fs tier %s: skipping %s: it %s", self.name, os.path.join(self._root, sub), why)

    # -- Tier protocol ----------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    def used_bytes(self) -> int:
        """Payload bytes of the entry files, from counters (never a walk): the last scan's total
        plus this process's puts and deletes since."""
        with self._usage_lock:
            return max(0, self._used)

    def contains(self, key: Key) -> bool:
        """Whether a regular entry file exists in a real fan-out directory (two lstat calls; a
        hint: the file may vanish before it is read)."""
        path = self._path(key)
        try:
            sub = os.lstat(os.path.dirname(path))
            if not stat.S_ISDIR(sub.st_mode) or self._open_problem(sub):
                return False
            return stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False
        except OSError:
            self.stats.add(errors=1)
            return False

    def size_of(self, key: Key) -> int | None:
        """Payload bytes from the file's header, or None when absent or corrupt (a header that
        does not parse, names another key, disagrees with the file's size or announces more than
        the tier can hold: counted and removed; not a regular file: counted)."""
        name = self._name(key)
        try:
            with self._fanout(name) as dfd:
                fd, st = open_regular_at(dfd, name)
                try:
                    header = self._checked_header(fd, key, st)
                finally:
                    os.close(fd)
                if header is None:
                    self._corrupt(dfd, name, st, count_miss=False)
                    return None
                return header.length
        except FileNotFoundError:
            return None
        except NotRegularFile:
            self.stats.add(corrupt=1)
            return None
        except _ForeignDir as exc:
            self._foreign(name[:2], str(exc))
            return None
        except OSError:
            self.stats.add(errors=1)
            return None

    def _checked_header(self, fd: int, key: Key, st: os.stat_result) -> entry.EntryHeader | None:
        """The file's header if it parses, names ``key``, fits the tier and matches the file's
        size; None (corrupt) otherwise. Nothing is allocated from the header's length."""
        try:
            header = entry.decode_header(os.pread(fd, entry.MAX_HEADER_BYTES, 0), self.max_entry_bytes, self.auth)
        except CorruptEntry:
            return None
        if header.key != bytes(key) or st.st_size != header.header_bytes + header.stored:
            return None
        return header

    def get_into(self, key: Key, out) -> int | None:
        name = self._name(key)
        dest = memoryview(out).cast("B")
        try:
            with self._fanout(name) as dfd:
                fd, st = open_regular_at(dfd, name)
                try:
                    return self._read(fd, dfd, name, st, key, dest)
                finally:
                    os.close(fd)
        except FileNotFoundError:
            self.stats.add(misses=1)
        except NotRegularFile:
            self.stats.add(corrupt=1, misses=1)
        except _ForeignDir as exc:
            self._foreign(name[:2], str(exc))
            self.stats.add(misses=1)
        except OSError:
            self.stats.add(errors=1, misses=1)
        return None

    def _read(self, fd: int, dfd: int, name: str, st: os.stat_result, key: Key, dest: memoryview) -> int | None:
        header = self._checked_header(fd, key, st)
        if header is None:
            return self._corrupt(dfd, name, st)
        if dest.nbytes < header.length:
            self.stats.add(errors=1, misses=1)
            return None
        target = dest[: header.length]
        try:
            if header.codec == 0:
                read_exact(fd, [target], header.header_bytes)  # short reads happen on network file systems
                entry.verify(header, target, auth=self.auth)
            else:  # coded: stored < length <= max_entry_bytes, checked by the header
                stored = bytearray(header.stored)
                read_exact(fd, [memoryview(stored)], header.header_bytes)
                entry.open_into(header, stored, target, auth=self.auth,  # the tag before decoding
                                lossy_ok=self.serves_lossy)
        except (ShortRead, CorruptEntry):
            return self._corrupt(dfd, name, st)
        self._note_read(header.stored)
        self.stats.add(hits=1, bytes_read=header.length)
        return header.length

    def _corrupt(self, dfd: int, name: str, st: os.stat_result, count_miss: bool = True) -> None:
        """Count a corrupt entry (as a miss when ``count_miss``); remove it if it is still the
        file that was read."""
        self.stats.add(corrupt=1, misses=int(count_miss))
        with self._changing(name) as change:
            if unlink_at(dfd, name, same_as=st):
                change[:] = [_payload(st.st_size), 0]
        return None

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Write header + payload to a unique temp file and rename it into place (atomic)."""
        sealed = self._seal(key, memoryview(data).cast("B"), dtype, shape)
        if sealed is None:
            return False
        header, view = sealed  # view: the stored bytes (coded when the tier's codec shrinks them)
        size = view.nbytes
        if size > self.config.capacity:
            self.stats.add(dropped=1)
            return False
        name = bytes(key).hex()
        tmp = f".{name}.{self._tag}.{next(self._seq)}{_TMP}"
        try:
            with self._fanout(name, create=True) as dfd:
                try:
                    self._write(dfd, tmp, header, view)
                    with self._changing(name) as change:
                        old = _regular_payload(dfd, name)
                        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                        change[:] = [old, _payload(len(header) + size)]
                except OSError:
                    unlink_at(dfd, tmp)
                    raise
        except _ForeignDir as exc:
            self._foreign(name[:2], str(exc))
            self.stats.add(dropped=1)
            return False
        except OSError:
            self.stats.add(errors=1, dropped=1)
            return False
        self.stats.add(puts=1, bytes_written=size)
        self._account()
        return True

    def _write(self, dfd: int, tmp: str, header: bytes, view: memoryview) -> None:
        """Create the temp file ``tmp`` in ``dfd`` holding header + payload (fsync'd if asked);
        OSError for faults (the caller removes the temp)."""
        fd = self._write_direct(dfd, tmp, header, view) if self._direct.on else None
        if fd is None:
            fd = create_exclusive_at(dfd, tmp, self._mode, self._gid)
            try:
                write_all(fd, [header, view])
            except BaseException:
                os.close(fd)
                raise
        try:
            if self.config.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, dfd: int, tmp: str, header: bytes, view: memoryview) -> int | None:
        """The written temp file's descriptor, written with O_DIRECT; None (no file left) when
        the file system refused O_DIRECT, after which the tier writes buffered."""
        try:
            with self._bounce.take() as buf:
                return write_new(dfd, tmp, self._mode, self._gid, header, view, buf)
        except OSError as exc:
            if not direct_refused(exc):
                raise
            self._direct.refuse("", exc)
        return None

    def delete(self, key: Key) -> bool:
        """Remove the key's entry file (only a regular file: anything else at the name is left)."""
        name = self._name(key)
        try:
            with self._changing(name) as change, self._fanout(name) as dfd:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return False
                os.unlink(name, dir_fd=dfd)
                change[:] = [_payload(st.st_size), 0]
        except FileNotFoundError:
            return False
        except _ForeignDir as exc:
            self._foreign(name[:2], str(exc))
            return False
        except OSError:
            self.stats.add(errors=1)
            return False
        self.stats.add(deletes=1)
        return True

    def keys(self) -> Iterator[Key]:
        """Keys whose regular files exist now (listed from the file system; a weak snapshot)."""
        return iter([bytes.fromhex(name) for _sub, name, _st in self._walk()])

    def close(self) -> None:
        """Stop the background scan (its helper process is killed; waits briefly for the thread)
        and unmap the O_DIRECT buffers (a put after this maps one again)."""
        self._stop.set()
        self._bounce.release_memory()
        with self._helper_lock:
            if self._helper is not None:
                self._helper.kill()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- budget -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _changing(self, name: str):
        """Bracket this process's rename or unlink of entry ``name``: the body sets the yielded
        list to ``[old, new]`` payload bytes (0: absent) once the change happened, and the
        counter moves by ``new - old``. A scan that ends while the change is under way cannot
        know whether its walk saw the old file or the new one, so it records what it counted
        (``_scanned``) and that, not ``old``, is what the change then replaces."""
        change: list[int] = []
        with self._usage_lock:
            self._inflight[name] = self._inflight.get(name, 0) + 1
        try:
            yield change
        finally:
            with self._usage_lock:
                left = self._inflight.pop(name) - 1
                if left:
                    self._inflight[name] = left
                counted = self._scanned.pop(name, None)
                if change:
                    old, new = change
                    self._used += new - (old if counted is None else counted)
                    if self._pending is not None:
                        self._pending[name] = new

    def _account(self) -> None:
        """After a put: scan now when this process's count is over budget or the last scan is
        older than ``scan_interval_s``; while the last scan could not get under budget, at most
        every ``_STUCK_RESCAN_S`` (a directory full of files this process cannot remove must
        not make every put walk it)."""
        with self._usage_lock:
            now = time.monotonic()
            due = now - self._last_scan >= self.config.scan_interval_s
            over = self._used > self.config.capacity and now >= self._stuck_until
        if due or over:
            self._scan(unless_fresh=True)

    def _scan(self, unless_fresh: bool = False) -> None:
        """Sum file sizes; remove the oldest by mtime until under the low watermark; drop stale
        temps. With ``unless_fresh``, skipped when a scan that finished meanwhile left the count
        within budget and recent (another thread scanned while this one waited)."""
        with self._scan_lock:
            with self._usage_lock:
                if unless_fresh and self._used <= self.config.capacity and (
                        time.monotonic() - self._last_scan < self.config.scan_interval_s):
                    return
                self._pending = {}
            try:
                seen = self._listing()
                if seen is None:
                    return  # failed, or closed mid-walk: a partial walk says nothing (the counter keeps its value)
                total = seen.total()
                evicted = self._evict(seen, total) if total > self.config.capacity else {}
                total -= sum(evicted.values())
            finally:
                with self._usage_lock:
                    pending, self._pending = self._pending or {}, None
            with self._usage_lock:
                for name, new in pending.items():  # this process's changes while the walk ran
                    if name in evicted:
                        continue
                    total += new - seen.payload_of(name)
                for name in self._inflight:  # changes still under way: what this total counted for them
                    self._scanned[name] = (0 if name in evicted else pending[name] if name in pending else
                                           seen.payload_of(name))
                self._used = total
                self._last_scan = time.monotonic()
                # files this process cannot remove (another user's, a read-only share) keep the
                # count over budget: without this every put would walk the directory again
                self._stuck_until = self._last_scan + _STUCK_RESCAN_S if total > self.config.capacity else 0.0

    def _listing(self) -> _Listing | None:
        """The entry files now, from a walk in the helper process (or here, paced, when none can
        start); None when the walk failed (counted) or the tier was closed meanwhile."""
        try:
            data = self._list_in_helper()
            if data is None:
                data = fs_scan.pack([(name, st) for _sub, name, st in self._walk(now=time.time(), stoppable=True)])
        except _ScanFailed:
            self.stats.add(errors=1)
            return None
        if self._stop.is_set():
            return None
        return _Listing(np.frombuffer(data, dtype=_LISTING))

    def _list_in_helper(self) -> bytes | None:
        """The helper's listing (``fs_scan.RECORD``s); None when no helper could start (the
        caller walks here). _ScanFailed when it ran and failed."""
        script = fs_scan.__file__
        if not sys.executable or not script or not script.endswith(".py"):
            return None
        cmd = [sys.executable, "-I", script, self._root, "1" if self._mode & 0o002 else "0",
               repr(float(self.config.stale_tmp_s))]
        with self._helper_lock:
            if self._stop.is_set():
                raise _ScanFailed("closed")
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, close_fds=True)
            except OSError as exc:
                if "helper" not in self._warned:
                    self._warned.add("helper")
                    log.warning("fs tier %s: scans walk in this process (no helper process: %s)", self.name, exc)
                return None
            self._helper = proc
        try:
            out, err = proc.communicate()  # the wait releases the interpreter lock
        finally:
            with self._helper_lock:
                self._helper = None
        if proc.returncode != 0 or len(out) % fs_scan.RECORD.size:
            if not self._stop.is_set():
                log.warning("fs tier %s: scan failed: %s", self.name,
                            err.decode(errors="replace").strip()[-500:] or f"exit {proc.returncode}")
            raise _ScanFailed(proc.returncode)
        for line in err.decode(errors="replace").splitlines():
            sub, _unsafe, why = (line.split("\t", 2) + ["", ""])[:3]
            self._foreign(sub, why)
        return out

    def _evict(self, seen: _Listing, total: int) -> dict[str, int]:
        """Remove the oldest entries of ``seen`` (still the same files) until ``total`` is under
        the low watermark; {name: payload} of those gone (removed here or by another node).
        Pauses every ``_PACE_EVERY`` removals (this runs on the process's interpreter lock)."""
        goal = self.config.capacity * self.config.low_watermark
        gone: dict[str, int] = {}
        dirs: dict[str, int] = {}
        removed = 0
        try:
            root = os.open(self._root, _DIR_FLAGS)
        except OSError:
            self.stats.add(errors=1)
            return gone
        records = seen.records
        try:
            for n, i in enumerate(np.argsort(records["mtime"], kind="stable")):
                if total <= goal:
                    break
                if n and n % _PACE_EVERY == 0:
                    time.sleep(_PACE_S)
                rec = records[i]
                name = bytes(rec["key"]).ljust(32, b"\0").hex()
                sub, size, st = name[:2], int(seen.payload[i]), _Ident(int(rec["ino"]), int(rec["dev"]))
                if sub not in dirs:
                    try:
                        dirs[sub] = self._open_fanout(root, sub, create=False)
                    except (OSError, _ForeignDir):
                        dirs[sub] = -1
                if dirs[sub] < 0:
                    continue
                if unlink_at(dirs[sub], name, same_as=st):
                    removed += 1
                elif _exists(dirs[sub], name):
                    continue  # not ours to remove (another user's), or a new file published meanwhile
                gone[name] = size  # we removed it or another node did
                total -= size
        finally:
            for fd in dirs.values():
                if fd >= 0:
                    os.close(fd)
            os.close(root)
        if removed:
            self.stats.add(evictions=removed)
        return gone

    def _walk(self, now: float | None = None, stoppable: bool = False):
        """Yield (fan-out name, key-hex name, lstat) of the regular entry files in real fan-out
        directories, each where its key puts it (``fs_scan.walk``, in this process); remove stale
        temps when ``now``. When ``stoppable`` (a scan that could not use the helper process),
        stops early once the tier is closed and pauses ``_PACE_S`` every ``_PACE_EVERY``
        entries to hand the interpreter lock back to the engine's threads."""

        def pause(walked: int) -> None:
            if stoppable and walked % _PACE_EVERY == 0:
                time.sleep(_PACE_S)

        try:
            yield from fs_scan.walk(self._root, bool(self._mode & 0o002),
                                    self.config.stale_tmp_s if now is not None else None,
                                    lambda sub, exc: self._foreign(sub, str(exc)),
                                    stop=lambda: stoppable and self._stop.is_set(), pause=pause)
        except OSError:
            self.stats.add(errors=1)

    def __repr__(self) -> str:
        return f"FsTier(name={self.name!r}, path={self._root!r})"


def _refresh_loop(ref: "weakref.ref[FsTier]", stop: threading.Event, interval: float) -> None:
    """Scan at once, then every ``interval`` seconds until ``stop`` is set or the tier is gone."""
    delay = 0.0
    while not stop.wait(delay):
        tier = ref()
        if tier is None:
            return
        try:
            tier._scan()
        except Exception:  # a scan must never kill the thread: count it and go on
            tier.stats.add(errors=1)
            log.exception("fs tier %s: usage scan failed", tier.name)
        del tier
        delay = interval


def _exists(dfd: int, name: str) -> bool:
    """Whether anything holds the name ``name`` in ``dfd`` (no link followed)."""
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _regular_payload(dfd: int, name: str) -> int:
    """Payload bytes of the regular file ``name`` in ``dfd`` now (0 if absent or not regular)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return 0
    return _payload(st.st_size) if stat.S_ISREG(st.st_mode) else 0


def _payload(file_bytes: int) -> int:
    """Payload bytes of an entry file, taking its header as one-dimensional (the default shape).

    Exact for entries put without a shape; higher-dimensional headers are 8 bytes per extra
    dimension longer, which the budget then counts as payload (a negligible overestimate).
    """
    return max(0, file_bytes - entry.FIXED_BYTES - 8)

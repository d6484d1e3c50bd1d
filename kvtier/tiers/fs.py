"""The ``fs`` tier: entry files in a shared POSIX directory (NFS, Lustre, CephFS) used by many nodes.

A file is ``<path>/<first key byte hex>/<key hex>`` holding the entry header followed by the
payload. Nothing is cached about which keys exist: another node may add or remove files at any
time, so ``contains``, ``size_of``, ``keys`` and ``get_into`` ask the file system each time.

Atomic publish: a writer writes a temp file named ``.<key hex>.<host>.<pid>.<random>.tmp`` in the
same directory and renames it over the final name (``os.replace``). Concurrent writers of one key
(on one node or many) each publish a complete entry; the last rename wins, and a reader sees one
whole entry or none, never a torn one. A file that fails its header or checksum (a truncated copy,
bit rot, a foreign file) is a counted miss and is removed, but only if it is still the same file
(same inode) that was read, so a concurrent good publish is not removed.

Byte budget (payload bytes, see ``_payload``): file sizes are summed by scanning the directory, at most every ``scan_interval_s``
seconds or sooner when this process's writes since the last scan would cross ``capacity``; when
over budget the oldest files by mtime are removed until ``low_watermark x capacity`` is reached.
Several nodes may scan at once; removing a file twice is harmless. Temp files older than
``stale_tmp_s`` (a writer that crashed) are removed by the scan.

Faults (EACCES, ENOSPC, EIO, a vanished mount) are counted in ``stats.errors`` and reported as a
miss / a False put, never raised. ``get_into`` reads straight into ``out`` and then verifies, so on
a corrupt miss ``out`` may hold garbage (it returns None; the caller must not use it).
All methods are thread-safe.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from kvtier import entry
from kvtier.config import Size, ranged, validate
from kvtier.errors import CorruptEntry
from kvtier.fileio import ShortRead, read_exact, unlink_quietly, write_all
from kvtier.tiers.base import Key, Tier

_TMP = ".tmp"


@dataclass(frozen=True)
class FsConfig:
    """Options of the ``fs`` tier.

    ``path``: the shared directory (created if missing). ``capacity``: bytes of entry files the
    tier keeps (all nodes together). ``fsync``: fsync each file before publishing it (durable
    across a node crash; slower). ``scan_interval_s``: at most this long between budget scans.
    """

    path: str
    capacity: Size = ranged(Size(100 * 1024**3), ge=1)
    fsync: bool = False
    scan_interval_s: float = ranged(30.0, ge=0)
    low_watermark: float = ranged(0.9, gt=0, le=1)
    stale_tmp_s: float = ranged(3600.0, ge=0)


class FsTier(Tier):
    """Entry files in a shared directory; a shared tier with a scanned byte budget."""

    Config = FsConfig
    medium = "FS"
    self_managed = True

    def __init__(self, config: FsConfig, name: str = "fs"):
        super().__init__(name)
        validate(config, name)
        self.config = config
        self._root = os.path.abspath(config.path)
        os.makedirs(self._root, exist_ok=True)
        self._tag = f"{socket.gethostname()}.{os.getpid()}"
        self._lock = threading.Lock()  # guards the budget counters and scans
        self._scanned_bytes = 0
        self._written_since_scan = 0
        self._last_scan = 0.0
        self._scan()

    # -- paths ------------------------------------------------------------------------------

    def _dir(self, key: Key) -> str:
        return os.path.join(self._root, f"{entry.check_key(key)[0]:02x}")

    def _path(self, key: Key) -> str:
        return os.path.join(self._dir(key), bytes(key).hex())

    # -- Tier protocol ----------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    def used_bytes(self) -> int:
        """Payload bytes of the entry files present now (a fresh directory walk; see ``_payload``)."""
        return sum(_payload(st.st_size) for _p, _n, st in self._walk(stat=True))

    def contains(self, key: Key) -> bool:
        try:
            os.stat(self._path(key))
            return True
        except FileNotFoundError:
            return False
        except OSError:
            self.stats.add(errors=1)
            return False

    def size_of(self, key: Key) -> int | None:
        """Payload bytes from the file's header, or None when absent or corrupt (a header that
        does not parse, names another key, disagrees with the file's size or announces more than
        the tier can hold: counted and removed)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError:
            self.stats.add(errors=1)
            return None
        try:
            st = os.fstat(fd)
            header = self._checked_header(fd, key, st)
        except OSError:
            self.stats.add(errors=1)
            return None
        finally:
            os.close(fd)
        if header is None:
            self._corrupt(path, st, count_miss=False)
            return None
        return header.length

    def _checked_header(self, fd: int, key: Key, st: os.stat_result) -> entry.EntryHeader | None:
        """The file's header if it parses, names ``key``, fits the tier and matches the file's
        size; None (corrupt) otherwise. Nothing is allocated from the header's length."""
        try:
            header = entry.decode_header(os.pread(fd, entry.MAX_HEADER_BYTES, 0), self.max_entry_bytes)
        except CorruptEntry:
            return None
        if header.key != bytes(key) or st.st_size != header.header_bytes + header.length:
            return None
        return header

    def get_into(self, key: Key, out) -> int | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.stats.add(misses=1)
            return None
        except OSError:
            self.stats.add(errors=1, misses=1)
            return None
        try:
            return self._read(fd, path, key, memoryview(out).cast("B"))
        except OSError:
            self.stats.add(errors=1, misses=1)
            return None
        finally:
            os.close(fd)

    def _read(self, fd: int, path: str, key: Key, dest: memoryview) -> int | None:
        st = os.fstat(fd)
        header = self._checked_header(fd, key, st)
        if header is None:
            return self._corrupt(path, st)
        if dest.nbytes < header.length:
            self.stats.add(errors=1, misses=1)
            return None
        target = dest[: header.length]
        try:
            read_exact(fd, [target], header.header_bytes)  # short reads happen on network file systems
            entry.verify(header, target)
        except (ShortRead, CorruptEntry):
            return self._corrupt(path, st)
        self.stats.add(hits=1, bytes_read=header.length)
        return header.length

    def _corrupt(self, path: str, st: os.stat_result, count_miss: bool = True) -> None:
        """Count a corrupt entry (as a miss when ``count_miss``); remove it if it is still the
        file that was read."""
        self.stats.add(corrupt=1, misses=int(count_miss))
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except OSError:
            pass  # already replaced or removed by another node
        return None

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Write header + payload to a unique temp file and rename it into place (atomic)."""
        view = memoryview(data).cast("B")
        header = self._header(key, view, dtype, shape)
        if header is None:
            return False
        size = view.nbytes
        if size > self.config.capacity:
            self.stats.add(dropped=1)
            return False
        directory = self._dir(key)
        tmp = os.path.join(directory, f".{bytes(key).hex()}.{self._tag}.{uuid.uuid4().hex[:12]}{_TMP}")
        try:
            self._write(directory, tmp, header, view)
            os.replace(tmp, self._path(key))
        except OSError:
            self.stats.add(errors=1, dropped=1)
            unlink_quietly(tmp)
            return False
        self.stats.add(puts=1, bytes_written=view.nbytes)
        self._account(size)
        return True

    def _write(self, directory: str, tmp: str, header: bytes, view: memoryview) -> None:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # the fan-out directory is new (or another node removed it)
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, [header, view])
            if self.config.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: Key) -> bool:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        except OSError:
            self.stats.add(errors=1)
            return False
        self.stats.add(deletes=1)
        return True

    def keys(self) -> Iterator[Key]:
        """Keys whose files exist now (listed from the file system; a weak snapshot)."""
        return iter([bytes.fromhex(name) for _path, name, _st in self._walk(stat=False)])

    # -- budget -----------------------------------------------------------------------------

    def _account(self, size: int) -> None:
        with self._lock:
            self._written_since_scan += size
            due = time.monotonic() - self._last_scan >= self.config.scan_interval_s
            over = self._scanned_bytes + self._written_since_scan > self.config.capacity
        if due or over:
            self._scan()

    def _scan(self) -> None:
        """Sum file sizes; remove the oldest by mtime until under the low watermark; drop stale temps."""
        with self._lock:
            files = []
            now = time.time()
            for path, _name, st in self._walk(stat=True, now=now):
                files.append((st.st_mtime, _payload(st.st_size), path))
            total = sum(size for _m, size, _p in files)
            evicted = 0
            if total > self.config.capacity:
                goal = self.config.capacity * self.config.low_watermark
                for _mtime, size, path in sorted(files):
                    if total <= goal:
                        break
                    if unlink_quietly(path):
                        evicted += 1
                    total -= size  # gone either way: we removed it or another node did
            self._scanned_bytes = total
            self._written_since_scan = 0
            self._last_scan = time.monotonic()
        if evicted:
            self.stats.add(evictions=evicted)

    def _walk(self, stat: bool, now: float | None = None):
        """Yield (path, key-hex name, stat or None) of entry files; remove stale temps when ``now``."""
        try:
            subdirs = [e for e in os.scandir(self._root) if len(e.name) == 2]
        except OSError:
            self.stats.add(errors=1)
            return
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue  # removed by another node meanwhile
            for e in entries:
                name = e.name
                if name.endswith(_TMP):
                    if now is not None:
                        self._maybe_drop_tmp(e, now)
                    continue
                if len(name) != 64:
                    continue
                if not stat:
                    yield e.path, name, None
                    continue
                try:
                    yield e.path, name, e.stat()
                except OSError:
                    continue

    def _maybe_drop_tmp(self, e: os.DirEntry, now: float) -> None:
        try:
            if now - e.stat().st_mtime > self.config.stale_tmp_s:
                unlink_quietly(e.path)
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"FsTier(name={self.name!r}, path={self._root!r})"


def _payload(file_bytes: int) -> int:
    """Payload bytes of an entry file, taking its header as one-dimensional (the default shape).

    Exact for entries put without a shape; higher-dimensional headers are 8 bytes per extra
    dimension longer, which the budget then counts as payload (a negligible overestimate).
    """
    return max(0, file_bytes - entry.FIXED_BYTES - 8)

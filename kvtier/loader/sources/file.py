"""Local files: positional reads (``preadv``) that release the GIL, scattered into the caller's buffers."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Sequence

from kvtier.errors import LoaderError
from kvtier.fileio import ShortRead, read_exact, read_upto
from kvtier.loader.sources.base import Source, short_read


def local_path(uri: str) -> str:
    """The path of a ``file://`` URI or a plain path."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


class FileSource(Source):
    """A local file opened once; ``read_into`` is ``preadv`` (no shared file position: thread-safe)."""

    default_concurrency = 16

    def __init__(self, uri: str, config: object | None = None):
        super().__init__(uri)
        self.path = local_path(uri)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise LoaderError(f"{self.path}: cannot open ({exc.strerror})") from exc
        self._size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._direct_fd: int | None = None

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        try:
            read_exact(self._fd, buffers, offset)
        except ShortRead as exc:
            raise short_read(self.path, offset, exc.wanted, exc.got) from exc
        except OSError as exc:
            raise LoaderError(f"{self.path}: read failed at offset {offset} ({exc.strerror})") from exc

    def mapping(self) -> mmap.mmap:
        """A private (copy-on-write) mapping of the whole file, made once.

        Tensors built on it belong to the caller: writes stay in the caller's pages and the
        reader never reuses the memory. As with any mapping, truncating the file under it is
        undefined behaviour (SIGBUS).
        """
        with self._lock:
            if self._map is None:
                self._map = mmap.mmap(self._fd, 0, flags=mmap.MAP_PRIVATE,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return self._map

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading ``[offset, offset+length)`` into the page cache (one large readahead)."""
        os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)

    def is_cached(self, samples: int = 8) -> bool:
        """True when sampled 4 KiB pages across the file are all in the page cache (a hint).

        Uses ``preadv(RWF_NOWAIT)``, which fails instead of waiting for the disk.
        """
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None or self._size == 0:
            return False
        buf = bytearray(4096)
        step = max(1, self._size // samples)
        for off in range(0, self._size, step):
            try:
                os.preadv(self._fd, [buf], off, flag)
            except BlockingIOError:
                return False
            except OSError:
                return False
        return True

    def read_direct(self, offset: int, buf: memoryview) -> int:
        """``O_DIRECT`` read of ``len(buf)`` bytes at ``offset`` (all 4 KiB aligned, ``buf`` too),
        bypassing the page cache; returns the bytes read (fewer only at the end of the file).
        Falls back to a buffered read where the file system refuses ``O_DIRECT`` (tmpfs)."""
        with self._lock:
            if self._direct_fd is None:
                try:
                    self._direct_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                except OSError:
                    self._direct_fd = -1
            fd = self._direct_fd if self._direct_fd >= 0 else self._fd
        try:
            return read_upto(fd, [buf], offset)
        except OSError as exc:
            if fd != self._fd and exc.errno == errno.EINVAL:  # O_DIRECT not supported here
                return self._read_buffered(offset, buf)
            raise LoaderError(f"{self.path}: read failed at offset {offset} ({exc.strerror})") from exc

    def _read_buffered(self, offset: int, buf: memoryview) -> int:
        try:
            return read_upto(self._fd, [buf], offset)
        except OSError as exc:
            raise LoaderError(f"{self.path}: read failed at offset {offset} ({exc.strerror})") from exc

    @classmethod
    def list_dir(cls, uri: str) -> list[tuple[str, int]]:
        path = local_path(uri)
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise LoaderError(f"{path}: cannot list ({exc.strerror})") from exc
        out = []
        for name in names:
            full = os.path.join(path, name)
            if os.path.isfile(full):
                out.append((name, os.path.getsize(full)))
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._direct_fd is not None and self._direct_fd >= 0:
                os.close(self._direct_fd)
            self._direct_fd = None
            self._map = None  # tensors still using it keep it alive


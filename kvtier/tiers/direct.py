"""O_DIRECT entry writes through page-aligned bounce buffers, shared by the ``disk`` and ``fs`` tiers.

An entry (header + payload) is staged in an aligned buffer, zero-padded to ``ALIGN``, written to
a new file opened with ``O_DIRECT`` in one call and truncated to its real length: the bytes go
from the buffer to the device (or, on NFS and Lustre, to the server) without a copy into this
node's page cache. On a CPU engine that copy is most of a buffered writer's core time (the
kernel's ``copy_folio_from_iter_atomic`` under the engine's memory traffic), and the page cache
it fills competes with the engine for memory. The staging copy uses ``kvtier.fastcopy``
(streaming stores where the extension is built), so it does not evict the engine's caches.

A file system that refuses ``O_DIRECT`` answers EINVAL (or EOPNOTSUPP), at open or at the write:
``probe`` says so at a tier's start, and a tier that meets it later (``refused``) goes buffered
(its callers decide).

Imports: ``kvtier.fastcopy`` and ``kvtier.fileio``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import queue
import threading
import uuid

from kvtier.fastcopy import copy_pairs
from kvtier.fileio import create_exclusive_at, unlink_quietly, write_all

ALIGN = 4096  # O_DIRECT offset/length/buffer alignment that every Linux file system accepts
O_DIRECT = getattr(os, "O_DIRECT", 0)


def refused(exc: OSError) -> bool:
    """Whether ``exc`` says the file system does not take O_DIRECT here (EINVAL, EOPNOTSUPP),
    as opposed to a fault (a full disk, EIO) that buffered I/O would meet too."""
    return exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


class AlignedBuffer:
    """A page-aligned buffer (anonymous mmap), grown on demand, reused."""

    def __init__(self):
        self._map: mmap.mmap | None = None

    def reserve(self, nbytes: int) -> memoryview:
        """A view of at least ``nbytes`` aligned bytes (the old contents are not kept when it grows)."""
        if self._map is None or len(self._map) < nbytes:
            self.free()
            self._map = mmap.mmap(-1, max(nbytes, ALIGN))
        return memoryview(self._map)

    def free(self) -> None:
        """Unmap the memory (a later ``reserve`` maps it again)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC frees it later
                pass
            self._map = None


class BouncePool:
    """``slots`` aligned buffers; ``take`` waits for a free one, so at most ``slots`` direct
    transfers run at once and the memory held is at most ``slots`` x the largest entry."""

    def __init__(self, slots: int):
        self._free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(slots):
            self._free.put(AlignedBuffer())

    @contextlib.contextmanager
    def take(self):
        """A buffer of the pool for the body of the ``with`` (given back on exit)."""
        buf = self._free.get()
        try:
            yield buf
        finally:
            self._free.put(buf)

    def release_memory(self) -> None:
        """Unmap every idle buffer's memory. The slots stay in the pool: a transfer after this
        maps its buffer again (with the slots gone it would wait forever)."""
        idle = []
        while True:
            try:
                idle.append(self._free.get_nowait())
            except queue.Empty:
                break
        for buf in idle:
            buf.free()
            self._free.put(buf)


def write_new(dir_fd: int, name: str, mode: int, gid: int, header: bytes, payload: memoryview,
              buf: AlignedBuffer) -> int:
    """Create ``name`` in ``dir_fd`` (exclusively, ``mode``/``gid`` as ``create_exclusive_at``)
    with O_DIRECT and write ``header`` + ``payload`` into it through ``buf``; the file is exactly
    that long. Returns the open descriptor (the caller settles and closes it). OSError for faults,
    EINVAL where the file system refuses O_DIRECT; the file is removed on any error."""
    total = len(header) + payload.nbytes
    padded = round_up(total)
    view = buf.reserve(padded)
    view[: len(header)] = header
    copy_pairs([(view[len(header) : total], payload)])
    view[total:padded] = bytes(padded - total)
    fd = create_exclusive_at(dir_fd, name, mode, gid, flags=O_DIRECT)
    try:
        write_all(fd, [view[:padded]])
        os.ftruncate(fd, total)
    except BaseException:
        os.close(fd)
        unlink_quietly(name, dir_fd)
        raise
    return fd


def probe(dir_fd: int, mode: int, gid: int) -> OSError | None:
    """Whether the file system under ``dir_fd`` takes O_DIRECT: None if a new file opens with it
    and takes an aligned write, else the OSError that refused it (EINVAL, EOPNOTSUPP; the probe
    file is removed). Another fault (a full disk, EIO) is not a refusal: None, and the tier's
    own writes meet and count it."""
    if not O_DIRECT:
        return OSError(errno.EOPNOTSUPP, "O_DIRECT is not available on this system")
    name = f".direct-{uuid.uuid4().hex}.tmp"
    buf = AlignedBuffer()
    try:
        os.close(write_new(dir_fd, name, mode, gid, b"", memoryview(bytes(ALIGN)), buf))
    except OSError as exc:
        if refused(exc):
            return exc
    finally:
        buf.free()
        unlink_quietly(name, dir_fd)
    return None


class DirectMode:
    """Whether a tier does O_DIRECT now: what its start-up probe found (``start``), then off for
    good from the first refusal after it (``refuse``); each said once, in one info line on the
    tier's own logger. Thread-safe."""

    def __init__(self, on: bool, log: logging.Logger, tier: str, path: str, fallback: str):
        """``tier``: how the lines name the tier (e.g. "disk tier d0"); ``fallback``: what it does
        instead (e.g. "using buffered I/O")."""
        self._on = on
        self._lock = threading.Lock()
        self._log, self._tier, self._path, self._fallback = log, tier, path, fallback

    @classmethod
    def start(cls, asked: bool, dir_fd: int, mode: int, gid: int, log: logging.Logger, tier: str, path: str,
              fallback: str) -> "DirectMode":
        """On when ``asked`` and ``probe`` finds the file system under ``dir_fd`` takes O_DIRECT."""
        refusal = probe(dir_fd, mode, gid) if asked else None
        if refusal is not None:
            log.info("%s: O_DIRECT unsupported in %s (%s); %s", tier, path, refusal.strerror, fallback)
        return cls(asked and refusal is None, log, tier, path, fallback)

    @property
    def on(self) -> bool:
        """Whether O_DIRECT is in use."""
        return self._on

    def refuse(self, what: str, exc: OSError) -> None:
        """The file system refused O_DIRECT (``refused(exc)``) at ``what`` ("read", "write", ...;
        "" to leave it unsaid) after the probe took it: off for good, said by the first caller."""
        with self._lock:
            was, self._on = self._on, False
        if was:
            self._log.info("%s: O_DIRECT %srefused in %s (%s); %s", self._tier, f"{what} " if what else "",
                           self._path, exc.strerror, self._fallback)


__all__ = ["ALIGN", "AlignedBuffer", "BouncePool", "DirectMode", "O_DIRECT", "probe", "refused", "round_up",
           "write_new"]

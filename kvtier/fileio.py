"""Whole-buffer file I/O on raw descriptors, shared by the disk and fs tiers and the loader's
file source.

``os.writev``/``os.preadv`` may move fewer bytes than asked; these helpers loop until every byte
is moved (or the file ends) and never allocate a copy of the caller's buffers. Faults are the
``OSError`` the system call raised; callers decide what a fault or a short file means to them (a
corrupt entry, a loader error). Thread-safe as far as the descriptor is: ``read_*`` use
positioned reads and never move the file offset.

Imports: the standard library only (the ground floor).
"""

from __future__ import annotations

import errno
import os
from typing import Sequence


class ShortRead(EOFError):
    """The file ended before every buffer was filled; ``got`` bytes were read."""

    def __init__(self, wanted: int, got: int):
        super().__init__(f"file ended after {got} of {wanted} bytes")
        self.wanted = wanted
        self.got = got


def write_all(fd: int, bufs: Sequence) -> None:
    """Write every bytes-like in ``bufs``, in order, at the descriptor's offset.

    Loops over partial ``writev``s; OSError(EIO) if the system writes nothing.
    """
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if v.nbytes]
    while views:
        n = os.writev(fd, views)
        if n == 0:
            raise OSError(errno.EIO, "write returned 0")
        views = advance(views, n)


def read_upto(fd: int, bufs: Sequence[memoryview], offset: int = 0) -> int:
    """Fill ``bufs`` in order with the bytes from ``offset`` until they are full or the file
    ends; return the bytes read (less than their total only at the end of the file)."""
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if v.nbytes]
    done = 0
    while views:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        views = advance(views, n)
    return done


def read_exact(fd: int, bufs: Sequence[memoryview], offset: int = 0) -> None:
    """Fill every buffer in ``bufs`` with the bytes from ``offset``; ShortRead if the file ends
    first (the buffers' contents are then unspecified)."""
    wanted = sum(memoryview(b).nbytes for b in bufs)
    got = read_upto(fd, bufs, offset)
    if got < wanted:
        raise ShortRead(wanted, got)


def advance(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """The byte views left after the first ``n`` bytes of ``views`` were moved."""
    out: list[memoryview] = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out


def unlink_quietly(path: str) -> bool:
    """Remove ``path``; True if removed, False if it was absent or could not be removed."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["ShortRead", "advance", "fsync_dir", "read_exact", "read_upto", "unlink_quietly", "write_all"]

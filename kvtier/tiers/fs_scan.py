"""The ``fs`` tier's directory walk, and the helper process that runs it for a usage scan.

A usage scan stats every entry file of the shared directory: ~5 us of CPU per entry in Python
(0.5 s per 100,000 entries, a million entries 5 s every ``usage_refresh_s``), most of it holding
the interpreter's lock. Run on a thread of the engine's process, it took that lock from the
engine's threads in slices of a few hundred microseconds, again and again, for the whole walk.
``FsTier`` therefore runs the walk here, as a child process (``python -I fs_scan.py ...``) at
the lowest CPU priority: the engine's process only reads the listing, ``RECORD.size`` bytes per
entry, and sums it with numpy. The same ``walk`` serves ``FsTier.keys`` and, when no helper can
be started, the scan on the tier's own thread (paced).

Standard library only, no ``kvtier`` import: the helper starts in ~20 ms and needs nothing
beyond the interpreter (``-I``: no site packages, no environment, no script directory).

Command line: ``fs_scan.py ROOT OTHERS_WRITE STALE_TMP_S``. Output on stdout: one ``RECORD``
per regular entry file in a real fan-out directory where its key puts it, sorted by key: the
key (32 bytes), ``st_size``, ``st_mtime``, ``st_ino``, ``st_dev``. On stderr, one line per
fan-out name skipped: ``<name> TAB <1: unsafe, 0: not a real directory> TAB <why>``. Temp files
older than ``STALE_TMP_S`` seconds are removed (a writer that crashed). Exit 0, or 2 when the
root cannot be opened. Nothing else is written or removed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import sys
import time
from typing import Callable, Iterator

RECORD = struct.Struct("<32sqdQQ")  # key, size, mtime, inode, device: 64 bytes
TMP = ".tmp"
FANOUT = re.compile(r"^[0-9a-f]{2}$")
ENTRY = re.compile(r"^[0-9a-f]{64}$")
# an O_DIRECT start-up probe's file in the root (``kvtier.tiers.direct.probe``), left by a crash
PROBE = re.compile(r"^\.direct-[0-9a-f]{32}\.tmp$")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class ForeignDir(Exception):
    """A fan-out name that is not a real directory, or (``unsafe``) one every user may write."""

    def __init__(self, why: str, unsafe: bool = False):
        super().__init__(why)
        self.unsafe = unsafe


def open_problem(st: os.stat_result, others_write: bool) -> str | None:
    """Why a directory with status ``st`` is refused, or None: every user may write it, it has no
    sticky bit, and the tier's mode does not grant others write (``others_write``: sharing with
    everyone declared)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX and not others_write:
        return (f"is writable by every user (mode {mode:04o}) without the sticky bit, so any local user "
                f"could replace or remove entries; restrict it (e.g. chmod 1777 or 0770 with a group), or "
                f"set mode to grant others write (e.g. \"0666\") if sharing with every user is deliberate")
    return None


def open_fanout(root: int, sub: str, others_write: bool) -> int:
    """Descriptor of the existing real fan-out directory ``sub`` under ``root``. ForeignDir when
    the name is a symlink or no directory, or the directory is refused (``open_problem``);
    OSError (FileNotFoundError when absent) otherwise."""
    try:
        fd = os.open(sub, _SUBDIR_FLAGS, dir_fd=root)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ForeignDir("is not a real directory (a symbolic link or a file)") from exc
        raise
    return vetted(fd, others_write)


def vetted(fd: int, others_write: bool) -> int:
    """``fd``, an open directory, when ``open_problem`` finds nothing wrong with it; otherwise
    ``fd`` is closed and ForeignDir (``unsafe``) raised (an OSError of ``fstat`` closes it too)."""
    try:
        problem = open_problem(os.fstat(fd), others_write)
    except OSError:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise ForeignDir(problem, unsafe=True)
    return fd


def walk(root_path: str, others_write: bool, stale_tmp_s: float | None,
         on_foreign: Callable[[str, ForeignDir], None], stop: Callable[[], bool] = lambda: False,
         pause: Callable[[int], None] = lambda walked: None) -> Iterator[tuple[str, str, os.stat_result]]:
    """Yield (fan-out name, key-hex name, lstat) of the regular entry files in real fan-out
    directories, each where its key puts it, in fan-out order; remove temps older than
    ``stale_tmp_s`` seconds (None: leave them). ``on_foreign(name, exc)`` for each fan-out name
    skipped; ``stop()`` checked before each fan-out directory (True: end early); ``pause(n)``
    after each entry (``n`` walked so far). OSError when the root cannot be opened."""
    now = time.time()
    root = os.open(root_path, DIR_FLAGS)
    walked = 0
    try:
        subs = []
        with os.scandir(root) as it:  # streamed: the root's other names cost no memory
            for name in (e.name for e in it):
                if FANOUT.match(name):
                    subs.append(name)
                elif stale_tmp_s is not None and PROBE.match(name):
                    _maybe_drop_tmp(root, name, now, stale_tmp_s)
        subs.sort()
        for sub in subs:
            if stop():
                return
            try:
                dfd = open_fanout(root, sub, others_write)
            except ForeignDir as exc:
                on_foreign(sub, exc)
                continue
            except OSError:
                continue  # removed by another node meanwhile
            try:
                for item in _walk_fanout(dfd, sub, now, stale_tmp_s):
                    yield item
                    walked += 1
                    pause(walked)
            except OSError:
                continue  # the directory went away mid-walk
            finally:
                os.close(dfd)
    finally:
        os.close(root)


def _walk_fanout(dfd: int, sub: str, now: float, stale_tmp_s: float | None):
    with os.scandir(dfd) as it:  # streamed, never listed whole: junk names cost no memory
        for name in (e.name for e in it):
            if name.endswith(TMP):
                if stale_tmp_s is not None:
                    _maybe_drop_tmp(dfd, name, now, stale_tmp_s)
                continue
            if not ENTRY.match(name) or not name.startswith(sub):
                continue  # not where the tier would keep that key: not its
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield sub, name, st


def _maybe_drop_tmp(dfd: int, name: str, now: float, stale_tmp_s: float) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and now - st.st_mtime > stale_tmp_s:
        try:  # only if it is still that file
            again = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if (again.st_ino, again.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass


def pack(records: list[tuple[str, os.stat_result]]) -> bytes:
    """``records`` (key-hex name, lstat) as ``RECORD``s, sorted by key."""
    records.sort(key=lambda r: r[0])
    return b"".join(RECORD.pack(bytes.fromhex(name), st.st_size, st.st_mtime, st.st_ino, st.st_dev)
                    for name, st in records)


def main(argv: list[str]) -> int:
    """The helper process (see the module docstring)."""
    root, others_write, stale = argv[0], argv[1] == "1", float(argv[2])
    try:
        os.nice(19)  # the engine's threads come first: a scan may take longer, never them
    except OSError:
        pass
    out, err = sys.stdout.buffer, sys.stderr

    def foreign(sub: str, exc: ForeignDir) -> None:
        err.write(f"{sub}\t{int(exc.unsafe)}\t{exc}\n")

    batch: list[tuple[str, os.stat_result]] = []
    current = None
    try:
        for sub, name, st in walk(root, others_write, stale, foreign):
            if sub != current:  # fan-out directories come in order: write each one sorted
                out.write(pack(batch))
                batch, current = [], sub
            batch.append((name, st))
    except OSError as exc:
        err.write(f"root\t0\t{exc.strerror or exc}\n")
        return 2
    out.write(pack(batch))
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

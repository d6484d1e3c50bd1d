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
import fcntl
import os
import stat
from typing import Sequence

# Flags of every open that must not follow a symbolic link planted at the name.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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


def unlink_quietly(path: str, dir_fd: int | None = None) -> bool:
    """Remove ``path`` (relative to ``dir_fd`` when given); True if removed, False if it was
    absent or could not be removed."""
    try:
        os.unlink(path, dir_fd=dir_fd)
        return True
    except OSError:
        return False


# sync_file_range(2) flags: wait for writeback already under way, start it, wait for it
_SYNC_RANGE_WAIT = 1 | 2 | 4


def _sync_file_range():
    """libc's ``sync_file_range`` through ctypes (it releases the GIL while it waits), or None
    where there is none (not Linux)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range() if os.uname().sysname == "Linux" else None


def write_back(fd: int) -> None:
    """Write the file's dirty pages to its device and wait until they are written, without the
    metadata journal commit that ``fdatasync`` forces (so not durable: use ``fsync`` for that).
    Where ``sync_file_range`` is missing, ``fdatasync`` (``fsync`` where that is missing too).
    OSError on a fault."""
    if _SYNC_FILE_RANGE is None:
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
        return
    if _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_RANGE_WAIT) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def drop_page_cache(directory) -> int:
    """Drop every file under ``directory`` from the page cache: each written back first
    (``write_back``: files still under writeback have clean pages only after it), then
    ``POSIX_FADV_DONTNEED``. Targeted (only these files), needs no privileges; a file that
    cannot be opened or written back is skipped; a mapped page may stay. The files dropped."""
    count = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                write_back(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            except OSError:
                continue
            finally:
                os.close(fd)
    return count


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    """The name is a symbolic link, a FIFO, a device, a socket or a directory, not a regular file."""


def open_dir_at(dir_fd: int | None, name: str) -> int:
    """A descriptor of the real directory ``name`` (relative to ``dir_fd``; None: the current
    directory), opened without following a symbolic link at ``name``.

    OSError (ENOTDIR or ELOOP for a symlink, ENOTDIR for anything else that is not a
    directory, FileNotFoundError when absent). Never blocks (a FIFO is not opened). The caller
    closes the descriptor.
    """
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)


def open_regular_at(dir_fd: int | None, name: str, flags: int = 0) -> tuple[int, os.stat_result]:
    """Open the regular file ``name`` (relative to ``dir_fd``) for reading: (descriptor, fstat).

    Never blocks and never follows a link: the open is ``O_NONBLOCK | O_NOFOLLOW`` (a FIFO or a
    device opens at once and is then refused; on a regular file O_NONBLOCK changes nothing), and
    ``fstat`` must say regular file. NotRegularFile when it is not (a symlink included);
    FileNotFoundError when absent; other OSError for faults. ``flags`` are added; O_DIRECT among
    them is set only once the file is known to be regular (``fcntl``), since opening a FIFO or a
    device with it fails with EINVAL before the file could be told apart (OSError EINVAL when
    the file system refuses it on a regular file).
    """
    direct = flags & _O_DIRECT
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | (flags & ~direct), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # symlink; directory; socket
            raise NotRegularFile(exc.errno, f"{name} is not a regular file") from exc
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"{name} is not a regular file")
    if direct:
        try:
            set_direct(fd, True)
        except OSError:
            os.close(fd)
            raise
    return fd, st


def set_direct(fd: int, on: bool) -> None:
    """Set or clear O_DIRECT on an open descriptor (``fcntl``); nothing where the platform has
    no O_DIRECT. OSError (EINVAL) when the file system refuses it."""
    if not _O_DIRECT:
        return
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)


def create_exclusive_at(dir_fd: int | None, name: str, mode: int, gid: int = -1, flags: int = 0) -> int:
    """Create ``name`` (relative to ``dir_fd``) for writing, failing if anything (a symlink
    included) is there; its mode is exactly ``mode`` (the umask does not apply) and its group
    ``gid`` when not -1. The caller closes the descriptor."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | flags, mode, dir_fd=dir_fd)
    try:
        _set_group_and_mode(fd, mode, gid)
    except OSError:
        unlink_quietly(name, dir_fd)
        raise
    return fd


def make_dir_at(dir_fd: int | None, name: str, mode: int, gid: int = -1) -> int:
    """The real directory ``name`` (relative to ``dir_fd``), created with exactly ``mode`` (and
    group ``gid`` when not -1) if absent; an existing one is opened as it is. OSError (ELOOP,
    ENOTDIR) when a symlink or a non-directory holds the name. The caller closes the descriptor."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False
    fd = open_dir_at(dir_fd, name)
    if created:
        _set_group_and_mode(fd, mode, gid)
    return fd


def _set_group_and_mode(fd: int, mode: int, gid: int) -> None:
    """Give the just-created ``fd`` group ``gid`` (when not -1) and exactly ``mode``; on OSError
    the descriptor is closed and the error raised."""
    try:
        if gid != -1:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise


def parse_mode(text: object, no_shared_write: bool = False) -> int:
    """The permission bits of an octal mode string such as ``"0600"`` or ``"640"``.

    ValueError (a phrase naming the valid form) unless it is a string of 3 or 4 octal digits
    whose value keeps read and write for the owner (the tier must read what it wrote) and sets
    nothing above the permission bits; with ``no_shared_write``, group and others may not write.
    """
    if not isinstance(text, str) or not 3 <= len(text) <= 4 or any(c not in "01234567" for c in text):
        raise ValueError(f"must be an octal permission string like \"0600\" or \"0640\" (quote it in YAML), "
                         f"got {text!r}"[:200])
    mode = int(text, 8)
    if mode > 0o777:
        raise ValueError(f"must hold permission bits only (at most \"0777\"), got {text!r}")
    if mode & 0o600 != 0o600:
        raise ValueError(f"must let the owner read and write (at least \"0600\"), got {text!r}")
    if no_shared_write and mode & 0o022:
        raise ValueError(f"must not let group or others write (e.g. \"0600\" or \"0640\"), got {text!r}")
    return mode


def dir_mode_for(file_mode: int) -> int:
    """The mode of a directory holding files of ``file_mode``: the same bits, plus search (x)
    wherever read is granted (0600 -> 0700, 0640 -> 0750, 0660 -> 0770)."""
    return file_mode | ((file_mode & 0o444) >> 2)


def resolve_group(group: object) -> int:
    """The gid of ``group`` (a group name or a decimal gid); -1 for None (keep the default).
    ValueError naming the problem for an unknown group."""
    import grp

    if group is None:
        return -1
    if isinstance(group, bool) or not isinstance(group, (str, int)) or group == "":
        raise ValueError(f"must be a group name or a numeric gid, got {group!r}"[:200])
    if isinstance(group, int) or group.isdigit():
        gid = int(group)
        if not 0 <= gid < 2**32 - 1:
            raise ValueError(f"must be a gid in [0, 4294967294], got {group!r}")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise ValueError(f"no group named {group!r} on this machine"[:200]) from exc


def untrusted_dir(st: os.stat_result, who: str = "process") -> str | None:
    """Why a directory with status ``st`` cannot be trusted with private files, or None.

    ``kvtier serve``'s rule for its socket directory, shared by the disk tier: the directory must
    belong to this process's user or root, and neither its group nor others may write it (they
    could plant, rename or remove names in it). The reason is a phrase that follows the path.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return (f"belongs to uid {st.st_uid}, not to this {who}'s user (uid {os.geteuid()}) or root")
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def unlink_at(dir_fd: int | None, name: str, same_as: os.stat_result | None = None) -> bool:
    """Remove the name ``name`` in ``dir_fd`` (never follows a link: a symlink itself is what
    goes); with ``same_as``, only if it is still that file (same inode), so a file published
    meanwhile under the name is kept. True if removed."""
    try:
        if same_as is not None:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_ino, now.st_dev) != (same_as.st_ino, same_as.st_dev):
                return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


__all__ = ["NotRegularFile", "ShortRead", "advance", "create_exclusive_at", "dir_mode_for", "drop_page_cache",
           "fsync_dir",
           "make_dir_at", "open_dir_at", "open_regular_at", "parse_mode", "read_exact", "read_upto",
           "resolve_group", "unlink_at", "unlink_quietly", "untrusted_dir", "write_all", "write_back"]

"""Faults and edges of the disk tier's drop-behind (``_DropBehind``, ``fileio.write_back``)."""

from __future__ import annotations

import errno
import os
import types

import pytest

import kvtier.fileio as fileio
import kvtier.tiers.disk as disk_mod
from kvtier.bench import tiers as bench_tiers
from kvtier.tiers.disk import DiskTier

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")


def make(path, **kw) -> DiskTier:
    """A buffered disk tier: the drop-behind settles files written through the page cache."""
    return DiskTier(DiskTier.Config(path=str(path), capacity=1 << 30, o_direct=False, **kw), name="disk")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failing_close_of_an_old_file_neither_fails_this_put_nor_leaks_the_other_descriptors(tmp_path, monkeypatch):
    """``_DropBehind._settle`` closes in ``finally``; a close that reports an error (EIO/ENOSPC/
    EDQUOT from close(2) on NFS, FUSE, ... -- the fd is released anyway) propagates out of
    ``add``: the files still in ``due`` are never settled nor closed (leaked for the process's
    life), and the put whose own file was written fine fails (``DiskTier.put`` -> False, its
    entry thrown away)."""
    monkeypatch.setattr(disk_mod, "DROP_BEHIND_BYTES", 100 << 10)
    before = _open_fds()
    tier = make(tmp_path / "d")
    try:
        for i in range(3):
            assert tier.put(key(i), os.urandom(20 << 10))
        waiting = [fd for fd, _ in tier._drop_behind._files]
        assert len(waiting) == 3
        real_os = os

        def close(fd):
            real_os.close(fd)  # Linux releases the descriptor even when close reports an error
            if fd == waiting[0]:
                raise OSError(errno.EIO, "Input/output error (deferred write error reported by close)")

        proxy = types.SimpleNamespace(**{n: getattr(real_os, n) for n in dir(real_os) if not n.startswith("__")})
        proxy.close = close
        monkeypatch.setattr(disk_mod, "os", proxy)
        ok = tier.put(key(9), os.urandom(200 << 10))  # over the byte bound: every waiting file is due
        monkeypatch.setattr(disk_mod, "os", real_os)
        leaked = [fd for fd in waiting[1:] if _is_open(fd)]
        assert ok, "the put failed although its own file was written: an older file's close failed"
        assert not leaked, f"descriptors {leaked} of settled files were never closed"
    finally:
        tier.close()
        assert _open_fds() == before


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_write_back_fallback_where_there_is_no_sync_file_range_nor_fdatasync(tmp_path, monkeypatch):
    """``write_back`` falls back to ``os.fdatasync`` where ``sync_file_range`` is missing (its
    docstring: "not Linux"); macOS's ``os`` has no ``fdatasync``. The AttributeError is not an
    OSError: it escapes ``_DropBehind._settle`` and ``DiskTier.put`` (whose contract is "never
    raises" for faults) on the 65th put and every later one that settles a file."""
    monkeypatch.setattr(fileio, "_SYNC_FILE_RANGE", None)
    monkeypatch.delattr(os, "fdatasync")
    monkeypatch.setattr(disk_mod, "DROP_BEHIND_FILES", 2)
    tier = make(tmp_path / "d")
    try:
        for i in range(4):
            assert tier.put(key(i), os.urandom(4096))  # AttributeError from the third on
    finally:
        tier.close()


def test_bench_tiers_file_baseline_does_what_the_disk_tier_does(tmp_path, monkeypatch):
    """``kvtier bench tiers``'s ``file`` baseline does what the disk tier does on a put (start
    the writeback, no flush of its own), so its "disk vs file" ratios compare like work; both
    write back and drop the rest before the timed reads (``drop_cached``)."""
    flushes = {"file": 0, "disk": 0}
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (flushes.__setitem__(who[0], flushes[who[0]] + 1), real(fd)))
    real_sfr = fileio._SYNC_FILE_RANGE
    if real_sfr is not None:
        monkeypatch.setattr(fileio, "_SYNC_FILE_RANGE",
                            lambda *a: (flushes.__setitem__(who[0], flushes[who[0]] + 1), real_sfr(*a))[1])
    who = ["file"]
    target = bench_tiers._FileTarget(str(tmp_path / "file"))
    for i in range(8):
        target.put(key(i), os.urandom(64 << 10))
    target.close()
    who[0] = "disk"
    tier = make(tmp_path / "d")
    for i in range(8):
        assert tier.put(key(i), os.urandom(64 << 10))
    tier_flushes_before_close = flushes["disk"]
    tier.close()
    assert tier_flushes_before_close == flushes["file"], flushes

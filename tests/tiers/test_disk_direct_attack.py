"""Attacks on the disk tier's O_DIRECT default: file systems that take or refuse it, faults
after the probe, odd sizes, peers that swap files, concurrency and the bounce pool."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest

import kvtier.fileio as fileio
from kvtier.tiers.disk import DiskTier
from tests.tiers.test_disk import key, make, payload

_O_DIRECT = getattr(os, "O_DIRECT", 0)
SIZES = [0, 1, 4095, 4096, 4097, 8192 - 200, 65_537]




def direct(path, **kw) -> DiskTier:
    tier = make(path, o_direct=True, **kw)
    if not tier.direct_io:
        tier.close()
        pytest.skip("O_DIRECT unsupported here")
    return tier


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-direct-attack-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_tmpfs_directory_round_trips_odd_sizes_without_warnings(shm_dir, caplog):
    """The default (o_direct) on tmpfs, whichever way the kernel answers the probe: every odd
    size round-trips, survives a restart, and nothing is logged at WARNING or counted."""
    caplog.set_level(logging.INFO, logger="kvtier")
    with make(shm_dir) as tier:
        for i, n in enumerate(SIZES):
            assert tier.put(key(i), payload(n, i))
        for i, n in enumerate(SIZES):
            assert tier.get(key(i)) == payload(n, i)
        assert tier.stats.errors == tier.stats.corrupt == 0
    with make(shm_dir) as again:
        assert again.scan_report["entries"] == len(SIZES)
        for i, n in enumerate(SIZES):
            assert again.get(key(i)) == payload(n, i)
        assert again.stats.errors == again.stats.corrupt == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) <= 2  # one per start


def test_tmpfs_that_refuses_o_direct_falls_back_once_per_start(shm_dir, monkeypatch, caplog):
    """A file system that refuses O_DIRECT at open (tmpfs before Linux 6.6; injected): the
    tier starts buffered with one info line, and puts/gets never touch O_DIRECT again."""
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & _O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    caplog.set_level(logging.INFO, logger="kvtier")
    with make(shm_dir) as tier:
        assert not tier.direct_io
        for i, n in enumerate(SIZES):
            assert tier.put(key(i), payload(n, i))
            assert tier.get(key(i)) == payload(n, i)
        assert tier.stats.errors == 0
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1


@pytest.mark.parametrize("writer_direct, reader_direct", [(True, False), (False, True), (True, True)])
def test_entries_written_in_one_mode_read_in_the_other_after_restart(tmp_path, writer_direct, reader_direct):
    """A restart over a directory written by the other mode: the scan indexes every odd-sized
    entry (0 and 1 byte included) and each reads back exact."""
    with make(tmp_path, o_direct=writer_direct) as w:
        for i, n in enumerate(SIZES):
            assert w.put(key(i), payload(n, i))
    with make(tmp_path, o_direct=reader_direct) as r:
        assert r.scan_report == {"entries": len(SIZES), "temp_removed": 0, "corrupt_removed": 0}
        for i, n in enumerate(SIZES):
            assert r.get(key(i)) == payload(n, i)
        assert r.stats.errors == r.stats.corrupt == 0


class _RefuseDirectSetfl:
    """``fcntl`` as seen from kvtier.fileio, refusing to set O_DIRECT (EINVAL)."""

    def __getattr__(self, name):
        return getattr(fcntl, name)

    @staticmethod
    def fcntl(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & _O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return fcntl.fcntl(fd, cmd, arg)


def test_a_read_whose_fcntl_o_direct_is_refused_after_the_probe_still_hits(tmp_path, monkeypatch, caplog):
    """The probe took O_DIRECT, but setting it on an entry's descriptor is refused (EINVAL,
    injected): reads must fall back to buffered I/O, not miss every entry with a warning each."""
    tier = direct(tmp_path)
    for i, n in enumerate(SIZES):
        assert tier.put(key(i), payload(n, i))
    monkeypatch.setattr(fileio, "fcntl", _RefuseDirectSetfl())
    caplog.set_level(logging.INFO, logger="kvtier")
    for _ in range(3):
        for i, n in enumerate(SIZES):
            assert tier.get(key(i)) == payload(n, i)
    assert tier.stats.corrupt == 0 and tier.stats.errors == 0
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 0
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) <= 1
    tier.close()


def test_a_direct_read_refused_with_einval_after_the_probe_still_hits(tmp_path, monkeypatch, caplog):
    """The probe and the open took O_DIRECT, but the read itself is refused (EINVAL on a
    direct descriptor, injected; e.g. a larger logical block): the entry must still be read
    (buffered), kept, and the fault not repeated for every get."""
    tier = direct(tmp_path)
    for i, n in enumerate(SIZES):
        assert tier.put(key(i), payload(n, i))
    real = os.preadv

    def refusing_preadv(fd, bufs, offset, *a):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(os, "preadv", refusing_preadv)
    caplog.set_level(logging.INFO, logger="kvtier")
    for _ in range(3):
        for i, n in enumerate(SIZES):
            assert tier.get(key(i)) == payload(n, i)
    assert tier.stats.corrupt == 0
    assert tier.stats.errors <= 1
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 1
    monkeypatch.undo()
    assert all(tier.contains(key(i)) for i in range(len(SIZES)))
    tier.close()


def test_a_read_opened_direct_while_a_writer_falls_back_still_hits(tmp_path, monkeypatch):
    """A writer's EINVAL turns the tier buffered between a reader's direct open and its read
    (injected right after the open): the reader decided once, so it reads its O_DIRECT
    descriptor through the bounce buffer and hits (it used to read it buffered: EINVAL, a miss)."""
    tier = direct(tmp_path)
    data = payload(70_001, 6)
    assert tier.put(key(1), data)
    real = DiskTier._open_indexed

    def open_then_fall_back(self, k, room):
        opened = real(self, k, room)
        self._direct.refuse("write", OSError(errno.EINVAL, "refused"))  # what a writer's fallback does
        return opened

    monkeypatch.setattr(DiskTier, "_open_indexed", open_then_fall_back)
    assert tier.get(key(1)) == data
    assert tier.stats.errors == tier.stats.corrupt == 0
    tier.close()


def test_a_direct_write_refused_with_einval_falls_back_and_loses_nothing(tmp_path, monkeypatch, caplog):
    """O_DIRECT writes refused after the probe (EINVAL on writev of a direct descriptor,
    injected): every put still lands (buffered), no temp file is left, one info line."""
    tier = direct(tmp_path)
    real = os.writev

    def refusing_writev(fd, bufs):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs)

    monkeypatch.setattr(os, "writev", refusing_writev)
    caplog.set_level(logging.INFO, logger="kvtier")
    for i, n in enumerate(SIZES):
        assert tier.put(key(i), payload(n, i))
    monkeypatch.undo()
    for i, n in enumerate(SIZES):
        assert tier.get(key(i)) == payload(n, i)
    assert not tier.direct_io and tier.stats.errors == 0
    assert not [p for p in tmp_path.rglob("*.tmp")]
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1
    tier.close()


@pytest.mark.parametrize("new_size", [0, 1, 4096, 4097, 8192, "grow-aligned", "grow-odd"])
def test_a_peer_truncating_or_extending_an_entry_is_a_corrupt_miss(tmp_path, new_size):
    """A peer changes an indexed entry's size (aligned or not, smaller or larger): a direct
    read is a counted corrupt miss (file removed), never wrong data or an error."""
    tier = direct(tmp_path)
    data = payload(5000, 1)
    assert tier.put(key(1), data)
    path = tier._file(key(1))
    size = os.path.getsize(path)
    if new_size == "grow-aligned":
        new_size = -(-size // 4096) * 4096 + 4096
    elif new_size == "grow-odd":
        new_size = size + 123
    os.truncate(path, new_size)
    assert tier.get(key(1)) is None
    assert tier.stats.corrupt == 1 and tier.stats.errors == 0
    assert not os.path.exists(path) and not tier.contains(key(1))
    tier.close()


@pytest.mark.parametrize("swap", ["fifo", "symlink", "directory", "hardlink-other-key", "devnull", "socket"])
def test_a_peer_swapping_an_entry_for_a_non_entry_is_a_corrupt_miss(tmp_path, swap, monkeypatch):
    """A peer replaces an indexed entry's name by a FIFO, a symlink, a directory, a hard link
    of another key's file, a character device or a socket: a direct read never blocks, never
    returns bytes, counts one corrupt miss; the other key is untouched."""
    import socket

    tier = direct(tmp_path)
    assert tier.put(key(1), payload(5000, 1))
    assert tier.put(key(2), payload(5000, 2))
    path, other = tier._file(key(1)), tier._file(key(2))
    os.unlink(path)
    sock = None
    if swap == "fifo":
        os.mkfifo(path)
    elif swap == "symlink":
        os.symlink(other, path)
    elif swap == "directory":
        os.mkdir(path)
    elif swap == "hardlink-other-key":
        os.link(other, path)
    elif swap == "devnull":
        try:
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs privileges")
    else:
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(os.path.dirname(path))  # an AF_UNIX path is short
        sock.bind(os.path.basename(path))
    done = []
    t = threading.Thread(target=lambda: done.append(tier.get(key(1))), daemon=True)
    t.start()
    t.join(10)
    if sock:
        sock.close()
    assert done == [None]
    assert tier.stats.corrupt == 1 and tier.stats.errors == 0
    assert tier.get(key(2)) == payload(5000, 2)
    tier.close()


def test_concurrent_puts_gets_deletes_and_close_on_a_direct_tier(tmp_path):
    """Eight threads put, get and delete odd-sized entries on a direct tier with two bounce
    slots, and the tier is closed under them: no exception, no hang, every hit exact, and no
    bounce buffer left mapped once they stop."""
    tier = direct(tmp_path, max_writes_in_flight=2)
    stop, bad, errors = threading.Event(), [], []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                k = int(rng.integers(8))
                n = int(rng.choice(SIZES))
                r = rng.random()
                if r < 0.4:
                    tier.put(key(k), payload(n, k))
                elif r < 0.8:
                    got = tier.get(key(k))
                    if got is not None and got != payload(len(got), k):
                        bad.append(k)
                else:
                    tier.delete(key(k))
        except Exception as exc:  # noqa: BLE001 - any exception is the failure looked for
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    threading.Event().wait(1.0)
    tier.close()
    threading.Event().wait(0.3)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and bad == []
    tier.close()
    assert all(b._map is None for b in _bounces(tier))


def _bounces(tier: DiskTier) -> list:
    got = []
    while True:
        try:
            got.append(tier._bounce._free.get_nowait())
        except Exception:  # noqa: BLE001 - queue.Empty
            break
    for b in got:
        tier._bounce._free.put(b)
    return got


def test_bounce_pool_memory_is_bounded_and_freed_on_close(tmp_path):
    """Entries of growing and varying sizes through a direct tier: the pool never holds more
    than its slots (max_writes_in_flight) and none more than the largest entry rounded up;
    close unmaps every one."""
    tier = direct(tmp_path, max_writes_in_flight=3, capacity=256 << 20)
    largest = 0
    for i, n in enumerate([10, 5 << 20, 4097, 3 << 20, 1, 7 << 20, 12345]):
        assert tier.put(key(i % 4), payload(n, i))
        assert tier.get(key(i % 4)) == payload(n, i)
        largest = max(largest, n)
    pool = _bounces(tier)
    assert len(pool) == 3
    limit = -(-(largest + 4096) // 4096) * 4096
    assert all(b._map is None or len(b._map) <= limit for b in pool)
    tier.close()
    assert all(b._map is None for b in _bounces(tier))

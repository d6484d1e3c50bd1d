"""Disk tier specifics: restart recovery, corruption, faults, O_DIRECT."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import kvtier.tiers.direct as direct_mod
import kvtier.tiers.disk as disk_mod
from kvtier.errors import TierUnavailable
from kvtier.tiers.disk import DiskTier


def make(path, **kw) -> DiskTier:
    kw.setdefault("capacity", 64 * 1024 * 1024)
    return DiskTier(DiskTier.Config(path=str(path), **kw), name="disk")


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def file_of(tier: DiskTier, k: bytes) -> str:
    return tier._file(k)


def test_entries_survive_a_restart(tmp_path):
    with make(tmp_path) as tier:
        for i in range(5):
            assert tier.put(key(i), payload(10_000 + i, i))
        tier.delete(key(4))
    with make(tmp_path) as again:
        assert again.scan_report == {"entries": 4, "temp_removed": 0, "corrupt_removed": 0}
        assert set(again.keys()) == {key(i) for i in range(4)}
        assert again.used_bytes() == sum(10_000 + i for i in range(4))
        assert all(again.get(key(i)) == payload(10_000 + i, i) for i in range(4))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: str, offset: int) -> None:
    os.truncate(path, os.path.getsize(path) + offset)  # offset < 0


CORRUPTIONS = {
    "payload byte": lambda p: _flip(p, os.path.getsize(p) - 100),
    "header byte": lambda p: _flip(p, 10),
    "truncated": lambda p: _truncate(p, -1),
    "garbage": lambda p: open(p, "wb").write(b"not an entry" * 500),
}


@pytest.mark.parametrize("damage", CORRUPTIONS, ids=list(CORRUPTIONS))
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "odirect"])
def test_corrupt_file_is_a_counted_miss_and_removed_on_read(tmp_path, damage, o_direct):
    tier = make(tmp_path, o_direct=o_direct)
    k = key(1)
    tier.put(k, payload(5000))
    CORRUPTIONS[damage](file_of(tier, k))
    assert tier.get_into(k, bytearray(5000)) is None
    assert tier.stats.corrupt == 1
    assert not os.path.exists(file_of(tier, k))
    assert not tier.contains(k) and tier.used_bytes() == 0


@pytest.mark.parametrize("damage", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_corrupt_header_is_removed_at_start(tmp_path, damage):
    tier = make(tmp_path)
    tier.put(key(1), payload(5000))
    tier.put(key(2), payload(5000, 2))
    CORRUPTIONS[damage](file_of(tier, key(1)))
    tier.close()
    again = make(tmp_path)
    if damage == "payload byte":  # headers only at start: found on first read instead
        assert again.contains(key(1))
        assert again.get(key(1)) is None
    else:
        assert again.scan_report["corrupt_removed"] == 1
        assert not again.contains(key(1))
    assert again.stats.corrupt == 1
    assert not os.path.exists(file_of(again, key(1)))
    assert again.get(key(2)) == payload(5000, 2)


def test_file_of_another_key_is_a_miss(tmp_path):
    tier = make(tmp_path)
    tier.put(key(1), payload(5000, 1))
    tier.put(key(2), payload(5000, 2))
    os.replace(file_of(tier, key(1)), file_of(tier, key(2)))  # same sizes, wrong key inside
    assert tier.get(key(2)) is None
    assert tier.stats.corrupt == 1
    tier.put(key(3), payload(100))
    os.makedirs(os.path.dirname(file_of(tier, key(4))), exist_ok=True)
    os.link(file_of(tier, key(3)), file_of(tier, key(4)))  # a name the header contradicts
    tier.close()
    again = make(tmp_path)
    assert again.scan_report["corrupt_removed"] == 1 and not again.contains(key(4))
    assert again.get(key(3)) == payload(100)


def test_temp_files_are_removed_at_start(tmp_path):
    tier = make(tmp_path)
    tier.put(key(1), payload(100))
    stale = file_of(tier, key(2)) + ".0123456789ab.tmp"  # the name a crashed put leaves
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    open(stale, "wb").write(b"half written")
    unrelated = tmp_path / "README"
    unrelated.write_text("not ours")
    tier.close()
    again = make(tmp_path)
    assert again.scan_report == {"entries": 1, "temp_removed": 1, "corrupt_removed": 0}
    assert not os.path.exists(stale) and unrelated.exists()


def test_unusable_directory_raises_tier_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TierUnavailable, match="cannot use directory"):
        make(blocker / "sub")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
def test_write_fault_is_a_counted_false_put(tmp_path, monkeypatch, code):
    tier = make(tmp_path)
    tier.put(key(1), payload(1000, 1))

    def failing_write(fd, bufs):  # a fake only to inject the fault
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_mod, "write_all", failing_write)  # buffered writes
    monkeypatch.setattr(direct_mod, "write_all", failing_write)  # O_DIRECT writes
    assert tier.put(key(1), payload(2000, 2)) is False
    assert tier.put(key(2), payload(2000, 2)) is False
    assert tier.stats.errors == 2
    monkeypatch.undo()
    assert tier.get(key(1)) == payload(1000, 1)  # the old entry is intact
    assert not tier.contains(key(2)) and tier.used_bytes() == 1000
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "odirect"])
def test_read_fault_is_a_counted_miss_that_keeps_the_file(tmp_path, monkeypatch, o_direct):
    tier = make(tmp_path, o_direct=o_direct)
    tier.put(key(1), payload(1000))

    def failing_read(fd, bufs):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(disk_mod, "read_upto" if tier.direct_io else "read_exact", failing_read)
    assert tier.get(key(1)) is None
    assert tier.stats.errors == 1 and tier.stats.corrupt == 0
    monkeypatch.undo()
    assert tier.get(key(1)) == payload(1000)


def test_o_direct_falls_back_when_refused(tmp_path, monkeypatch):
    tier = make(tmp_path, o_direct=True)
    if not tier.direct_io:
        pytest.skip("O_DIRECT unsupported here")

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(DiskTier, "_write_direct", refuse)
    assert tier.put(key(1), payload(5000))
    assert not tier.direct_io
    assert tier.get(key(1)) == payload(5000)


def test_o_direct_and_buffered_files_are_interchangeable(tmp_path):
    with make(tmp_path, o_direct=True) as direct:
        direct.put(key(1), payload(12_345))
    with make(tmp_path, o_direct=False) as buffered:
        assert buffered.get(key(1)) == payload(12_345)
        buffered.put(key(2), payload(777, 2))
    with make(tmp_path, o_direct=True) as direct:
        assert direct.get(key(2)) == payload(777, 2)


def test_o_direct_copies_its_bounce_buffer_without_the_gil(tmp_path, monkeypatch):
    """A direct write's payload goes into the aligned buffer, and a direct read's out of it,
    through ``copy_pairs`` with the GIL released (a memoryview slice assignment holds it for the
    whole copy, stalling the engine's threads in the same process); the bytes are the caller's."""
    tier = make(tmp_path, o_direct=True)
    if not tier.direct_io:
        pytest.skip("O_DIRECT unsupported here")
    calls = []
    real = disk_mod.copy_pairs

    def recording(pairs, release_gil=True):
        calls.append((sum(memoryview(src).nbytes for _, src in pairs), release_gil))
        real(pairs, release_gil)

    monkeypatch.setattr(direct_mod, "copy_pairs", recording)  # the write's staging copy
    monkeypatch.setattr(disk_mod, "copy_pairs", recording)  # the read's copy out
    data = np.random.default_rng(5).integers(0, 256, (3 << 20) + 17, dtype=np.uint8)
    assert tier.put(key(1), data)
    out = np.zeros_like(data)
    assert tier.get_into(key(1), out) == data.nbytes and np.array_equal(out, data)
    assert calls == [(data.nbytes, True), (data.nbytes, True)]


def test_durable_mode_and_flat_layout(tmp_path):
    tier = make(tmp_path, fsync=True, fanout=False)
    assert tier.put(key(1), payload(100))
    assert os.path.exists(tmp_path / key(1).hex())
    tier.close()
    assert make(tmp_path, fanout=False).get(key(1)) == payload(100)


# ------------------------------------------------------------------------------ hardening (issue 9)


def test_forged_length_within_a_sparse_file_is_removed_at_start(tmp_path):
    """A file whose size matches a header announcing 1 TiB (sparse): beyond the capacity, so the
    scan removes it as corrupt instead of indexing an entry nobody can allocate for."""
    from tests.tiers.forge import forged_header

    tier = make(tmp_path)
    tier.put(key(1), payload(100))
    tier.put(key(2), payload(100, 2))
    path = file_of(tier, key(1))
    tier.close()
    header = forged_header(key(1), 2**40)
    with open(path, "wb") as f:
        f.write(header)
        try:
            f.truncate(len(header) + 2**40)
        except OSError:
            pytest.skip("this file system does not allow a 1 TiB sparse file")
    again = make(tmp_path)
    assert again.scan_report["corrupt_removed"] == 1 and again.stats.corrupt == 1
    assert not again.contains(key(1)) and again.size_of(key(1)) is None
    assert not os.path.exists(path)
    assert again.get(key(2)) == payload(100, 2)


def test_start_up_scan_removes_only_its_own_temp_files(tmp_path):
    """A user's notes.tmp, another program's temp files and anything below the fan-out
    directories survive a start; a temp file named as kvtier names them does not."""
    tier = make(tmp_path)
    tier.put(key(1), payload(100))
    fan = os.path.dirname(file_of(tier, key(1)))
    ours = file_of(tier, key(2)) + ".0123456789ab.tmp"
    os.makedirs(os.path.dirname(ours), exist_ok=True)
    theirs = [tmp_path / "notes.tmp", os.path.join(fan, "notes.tmp"),
              os.path.join(fan, key(3).hex() + ".in-flight.tmp"), tmp_path / "user" / "deep" / "x.tmp",
              tmp_path / "ab" / "cd" / (key(4).hex() + ".0123456789ab.tmp")]
    for path in [ours, *theirs]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"someone's bytes")
    tier.close()
    again = make(tmp_path)
    assert again.scan_report == {"entries": 1, "temp_removed": 1, "corrupt_removed": 0}
    assert not os.path.exists(ours)
    assert all(os.path.exists(p) for p in theirs)


def test_a_second_tier_on_the_same_directory_is_refused_naming_it(tmp_path):
    """Two tiers (in one process or two) never manage one directory; the lock goes with close."""
    import subprocess
    import sys

    first = make(tmp_path)
    with pytest.raises(TierUnavailable, match=str(tmp_path)):
        make(tmp_path)
    code = ("import sys\nfrom kvtier.errors import TierUnavailable\nfrom kvtier.tiers.disk import DiskTier\n"
            "try:\n    DiskTier(DiskTier.Config(path=sys.argv[1]))\nexcept TierUnavailable as e:\n"
            "    print(e)\n    sys.exit(3)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=120)
    assert other.returncode == 3 and "in use by another kvtier store" in other.stdout, other
    assert first.put(key(1), payload(100))
    first.close()
    with make(tmp_path) as again:
        assert again.get(key(1)) == payload(100)


def test_keys_that_are_not_digests_are_refused_not_written(tmp_path):
    from kvtier.errors import InvalidKey

    tier = make(tmp_path)
    for bad in (b"", b"abc"):
        with pytest.raises(InvalidKey, match="32 bytes"):
            tier.put(bad, payload(10))
        assert tier.get_into(bad, bytearray(16)) is None and not tier.contains(bad)
    assert tier.used_bytes() == 0 and list(tier.keys()) == []


# --- drop_cache: writeback started at once, pages dropped a few files later -----------------------


def _resident_pages(path: str) -> int:
    """Pages of the file at ``path`` in the page cache now (``mincore`` on a private mapping)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        buf = ctypes.c_char.from_buffer(mm)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        assert libc.mincore(ctypes.addressof(buf), size, vec) == 0, os.strerror(ctypes.get_errno())
        del buf
        return sum(v & 1 for v in vec)
    finally:
        mm.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "posix_fadvise"),
                    reason="Linux page cache behaviour")
def test_drop_cache_drops_the_pages_of_older_files_and_keeps_a_bounded_few_descriptors(tmp_path, monkeypatch):
    """With ``drop_cache`` a put returns without a flush of its own; once more than the bound
    of written files wait, the oldest are written back and their pages dropped, so no more
    than the bound keep pages (or descriptors) after their puts; ``close`` settles the rest.
    Every entry still reads back."""
    monkeypatch.setattr(disk_mod, "DROP_BEHIND_FILES", 4)
    monkeypatch.setattr(disk_mod, "DROP_BEHIND_BYTES", 1 << 30)
    fds = _open_fds()
    tier = make(tmp_path, o_direct=False)  # drop-behind is the buffered path's
    try:
        data = [payload(256 << 10, i) for i in range(12)]
        for i, d in enumerate(data):
            assert tier.put(key(i), d)
        held = _open_fds() - fds
        assert 4 <= held <= 4 + 2  # the four newest files (and the tier's lock and directory)
        resident = [_resident_pages(file_of(tier, key(i))) for i in range(12)]
        assert all(r == 0 for r in resident[:8]), resident  # written back and dropped
        assert all(tier.get(key(i)) == d for i, d in enumerate(data))
    finally:
        tier.close()
    assert _open_fds() == fds  # close settled (and closed) the rest


def test_a_direct_write_leaves_nothing_for_the_drop_behind(tmp_path):
    """A file written with O_DIRECT has no pages in the page cache: no descriptor of it waits
    to be written back and dropped (a dup and three syscalls per put, for nothing)."""
    tier = make(tmp_path, o_direct=True)
    if not tier.direct_io:
        pytest.skip("O_DIRECT unsupported here")
    try:
        for i in range(3):
            assert tier.put(key(i), payload(64 << 10, i))
        assert not tier._drop_behind._files
        assert tier.get(key(2)) == payload(64 << 10, 2)
    finally:
        tier.close()


def test_drop_cache_bounds_the_bytes_waiting_too(tmp_path, monkeypatch):
    """The byte bound settles a file as soon as the waiting files exceed it, a file larger than
    the bound on its own put."""
    monkeypatch.setattr(disk_mod, "DROP_BEHIND_BYTES", 300 << 10)
    tier = make(tmp_path, o_direct=False)  # drop-behind is the buffered path's
    try:
        assert tier.put(key(0), payload(200 << 10))
        assert len(tier._drop_behind._files) == 1
        assert tier.put(key(1), payload(200 << 10, 1))  # 400 KiB waiting: the first is settled
        assert [size for _, size in tier._drop_behind._files] == [os.path.getsize(file_of(tier, key(1)))]
        assert tier.put(key(2), payload(1 << 20, 2))  # over the bound alone: settled at once
        assert not tier._drop_behind._files
    finally:
        tier.close()


def test_without_drop_cache_nothing_waits(tmp_path):
    tier = make(tmp_path, drop_cache=False)
    try:
        assert tier.put(key(0), payload(4096))
        assert not tier._drop_behind._files
    finally:
        tier.close()


def test_a_put_racing_close_leaves_no_descriptor_behind(tmp_path):
    """After ``close`` the drop-behind settles each file on its own put: nothing waits, so
    nothing is left open for a later close to miss."""
    fds = _open_fds()
    tier = make(tmp_path)
    tier._drop_behind.close()  # as close() does, with a put still running on another thread
    tier._drop_behind.add(os.open(os.path.join(tmp_path, ".kvtier.lock"), os.O_RDONLY), 1)
    assert not tier._drop_behind._files
    tier.close()
    assert _open_fds() == fds

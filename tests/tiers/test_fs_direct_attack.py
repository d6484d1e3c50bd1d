"""Attacks on the fs tier's ``o_direct`` writes (and the O_DIRECT code it now shares with the disk
tier, ``kvtier.tiers.direct``): a careless operator and a hostile co-tenant of the shared
directory. Real directories under ``tmp_path``; fakes only to inject faults."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid

import numpy as np
import pytest

import kvtier.tiers.direct as direct_mod
import kvtier.tiers.fs as fs_mod
from kvtier import entry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.fs import FsTier
from tests.tiers.test_fs_direct import direct_tier, entry_files, key, make, resident_pages


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def temps(root) -> list[str]:
    """Every ``*.tmp`` name in the root and its fan-out directories."""
    out = [n for n in os.listdir(root) if n.endswith(".tmp")]
    for sub in os.listdir(root):
        p = os.path.join(root, sub)
        if len(sub) == 2 and os.path.isdir(p) and not os.path.islink(p):
            out += [os.path.join(sub, n) for n in os.listdir(p) if n.endswith(".tmp")]
    return out


def pool_buffers(pool) -> list:
    """The idle buffers of a BouncePool (put back after looking)."""
    got = []
    while True:
        try:
            got.append(pool._free.get_nowait())
        except Exception:  # noqa: BLE001 - queue.Empty
            break
    for buf in got:
        pool._free.put(buf)
    return got


def mapped_bytes(pool) -> int:
    return sum(len(b._map) for b in pool_buffers(pool) if b._map is not None)


def header_bytes() -> int:
    """Bytes of a one-dimensional raw entry header (what a put adds to its payload)."""
    return entry.FIXED_BYTES + 8


def einval(*_a, **_k):
    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))


# --- sizes and codecs ------------------------------------------------------------------------

@pytest.mark.parametrize("delta", ["zero", -1, 0, 1, 4096 - 1, 4096, 4096 + 1])
def test_sizes_at_the_alignment_edges_read_back_exactly(tmp_path, delta):
    """Payload 0 and header+payload one short of, at, and one past a page (and two pages)."""
    tier = direct_tier(tmp_path)
    size = 0 if delta == "zero" else 4096 - header_bytes() + delta
    data = payload(size, seed=size)
    assert tier.put(key(1), data)
    (path,) = entry_files(tmp_path)
    assert os.path.getsize(path) == size + header_bytes()
    assert tier.get(key(1)) == data and tier.size_of(key(1)) == size
    with make(tmp_path) as buffered:
        assert buffered.get(key(1)) == data
    assert tier.stats.errors == 0 and tier.stats.corrupt == 0 and temps(tmp_path) == []
    tier.close()


@pytest.mark.parametrize("n", [1, 3, 4097, 100_003])
def test_coded_odd_sized_entries_are_exact_for_a_buffered_reader(tmp_path, n):
    pytest.importorskip("blosc2")
    tier = direct_tier(tmp_path, codec="lossless")
    raw = (np.arange(n, dtype=np.uint32) % 7).astype(np.uint8)  # compressible, odd byte count
    assert tier.put(key(5), raw)
    (path,) = entry_files(tmp_path)
    assert resident_pages(path) == 0
    with make(tmp_path) as buffered:
        out = np.zeros(n, dtype=np.uint8)
        assert buffered.get_into(key(5), out) == n and np.array_equal(out, raw)
        assert buffered.stats.corrupt == 0
    assert temps(tmp_path) == []
    tier.close()


# --- concurrency -----------------------------------------------------------------------------

def test_more_threads_than_slots_putting_one_key_all_land_whole(tmp_path):
    tier = direct_tier(tmp_path)
    threads_n, rounds = 16, 6  # 16 writers > the pool's 4 slots
    datas = {(t, r): payload(1000 + 4096 * (t % 3) + 7 * r + t, seed=t * 100 + r)
             for t in range(threads_n) for r in range(rounds)}
    results: list[bool] = []
    barrier = threading.Barrier(threads_n)

    def writer(t: int) -> None:
        barrier.wait()
        for r in range(rounds):
            results.append(tier.put(key(7), datas[(t, r)]))

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts), "a writer is stuck on the bounce pool"
    assert results == [True] * (threads_n * rounds)
    assert tier.get(key(7)) in set(datas.values())
    assert tier.stats.errors == 0 and tier.direct_io
    assert temps(tmp_path) == []
    assert len(pool_buffers(tier._bounce)) == fs_mod._DIRECT_SLOTS  # every slot given back
    tier.close()


def test_a_buffered_reader_never_sees_a_torn_or_wrong_entry_while_direct_writes_publish(tmp_path):
    writer = direct_tier(tmp_path)
    reader = make(tmp_path)  # another node, buffered
    versions = [payload(5000 + 4096 * i + i, seed=i) for i in range(4)]
    stop = threading.Event()
    seen: list[bytes | None] = []

    def write() -> None:
        i = 0
        while not stop.is_set():
            assert writer.put(key(9), versions[i % len(versions)])
            i += 1

    w = threading.Thread(target=write)
    w.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            seen.append(reader.get(key(9)))
    finally:
        stop.set()
        w.join(timeout=30)
    assert not w.is_alive()
    good = set(versions)
    assert all(s is None or s in good for s in seen)
    assert sum(s is not None for s in seen) > 0
    assert reader.stats.corrupt == 0 and writer.stats.errors == 0
    assert temps(tmp_path) == []
    writer.close()
    reader.close()


def test_puts_racing_close_neither_hang_nor_fail_and_a_last_close_unmaps(tmp_path):
    tier = direct_tier(tmp_path)
    results: list[bool] = []
    start = threading.Barrier(9)

    def writer(t: int) -> None:
        start.wait()
        for r in range(25):
            results.append(tier.put(key(100 + t), payload(70_000 + r, seed=t)))

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in ts:
        t.start()
    start.wait()
    for _ in range(20):
        tier.close()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts)
    assert results == [True] * 200
    assert len(pool_buffers(tier._bounce)) == fs_mod._DIRECT_SLOTS
    tier.close()
    assert mapped_bytes(tier._bounce) == 0
    assert temps(tmp_path) == []


def test_einval_on_one_thread_while_another_is_mid_direct_write(tmp_path, monkeypatch, caplog):
    """Thread A is inside its O_DIRECT write when thread B's write is refused (EINVAL): the tier
    goes buffered, A's direct file still lands whole, B's entry lands buffered, one info line."""
    tier = direct_tier(tmp_path)
    real = direct_mod.write_all
    a_inside, a_go = threading.Event(), threading.Event()

    def faulty(fd, bufs):  # a fake only to inject the fault on thread B and to hold thread A
        if threading.current_thread().name == "A":
            a_inside.set()
            assert a_go.wait(10)
            return real(fd, bufs)
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_mod, "write_all", faulty)
    out: dict[str, bool] = {}
    a = threading.Thread(target=lambda: out.__setitem__("A", tier.put(key(1), payload(50_001, 1))), name="A")
    b = threading.Thread(target=lambda: out.__setitem__("B", tier.put(key(2), payload(50_002, 2))), name="B")
    with caplog.at_level(logging.INFO, logger=fs_mod.__name__):
        a.start()
        assert a_inside.wait(10)
        b.start()
        b.join(10)
        assert out.get("B") is True and not tier.direct_io
        a_go.set()
        a.join(10)
    assert out == {"A": True, "B": True}
    assert tier.get(key(1)) == payload(50_001, 1) and tier.get(key(2)) == payload(50_002, 2)
    assert len([r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]) == 1
    assert tier.stats.errors == 0 and temps(tmp_path) == []
    tier.close()


# --- faults ----------------------------------------------------------------------------------

def test_probe_refused_only_for_o_direct_opens_leaves_buffered_puts_working(tmp_path, monkeypatch):
    real = direct_mod.create_exclusive_at

    def no_direct(dir_fd, name, mode, gid=-1, flags=0):  # a file system that refuses O_DIRECT at open
        if flags & direct_mod.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(dir_fd, name, mode, gid, flags)

    monkeypatch.setattr(direct_mod, "create_exclusive_at", no_direct)
    tier = make(tmp_path, o_direct=True)
    assert not tier.direct_io
    for i in range(3):
        assert tier.put(key(i), payload(9000 + i, i))
    assert all(tier.get(key(i)) == payload(9000 + i, i) for i in range(3))
    assert temps(tmp_path) == [] and tier.stats.errors == 0
    tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_full_file_system_at_a_direct_create_is_a_false_put_not_a_refusal(tmp_path, monkeypatch, code):
    tier = direct_tier(tmp_path)
    assert tier.put(key(1), b"old" * 5000)

    def full(*_a, **_k):  # a fake only to inject the fault
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(direct_mod, "create_exclusive_at", full)
    assert tier.put(key(1), b"new" * 5000) is False
    monkeypatch.undo()
    assert tier.direct_io and tier.stats.errors == 1
    assert tier.get(key(1)) == b"old" * 5000 and temps(tmp_path) == []
    tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_fs_probe_fault_is_not_taken_for_a_refusal_of_o_direct(tmp_path, monkeypatch, code):
    """Regression (failed at 16cefd2, fixed by 2609773): a full file system / exhausted quota /
    I/O error while the start-up probe writes
    its 4 KiB makes ``probe`` report O_DIRECT as unsupported, so the tier writes buffered for the
    rest of its life (and logs 'O_DIRECT unsupported ... (No space left on device)'), although
    the write path itself treats these as faults, not refusals (only EINVAL refuses)."""

    def full(fd, bufs):  # a fake only to inject the fault while the probe writes
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(direct_mod, "write_all", full)
    tier = make(tmp_path, o_direct=True)
    monkeypatch.undo()  # the space comes back (another node's scan evicted)
    try:
        assert tier.direct_io, f"errno {errno.errorcode[code]} in the probe turned O_DIRECT off for good"
    finally:
        tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_disk_probe_fault_is_not_taken_for_a_refusal_of_o_direct(tmp_path, monkeypatch, code):
    """Regression (failed at 16cefd2, fixed by 2609773) of the disk tier: its old probe only opened a file with O_DIRECT, so a
    full disk at start kept O_DIRECT on; the shared probe also writes, and any OSError there
    (ENOSPC, EIO) turns the disk tier buffered for good."""

    def full(fd, bufs):  # a fake only to inject the fault while the probe writes
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(direct_mod, "write_all", full)
    tier = DiskTier(DiskTier.Config(path=str(tmp_path / "d"), capacity=1 << 24, o_direct=True), name="disk")
    monkeypatch.undo()
    try:
        assert tier.direct_io, f"errno {errno.errorcode[code]} in the probe turned O_DIRECT off for good"
    finally:
        tier.close()


def test_a_failed_direct_write_leaves_the_pool_whole_and_unmappable(tmp_path, monkeypatch):
    tier = direct_tier(tmp_path)

    def failing(fd, bufs):  # a fake only to inject the fault
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(direct_mod, "write_all", failing)
    for i in range(6):
        assert tier.put(key(i), payload(300_000 + i, i)) is False
    monkeypatch.undo()
    assert len(pool_buffers(tier._bounce)) == fs_mod._DIRECT_SLOTS and tier.direct_io
    tier.close()
    assert mapped_bytes(tier._bounce) == 0
    assert temps(tmp_path) == []


# --- a hostile co-tenant of the shared directory --------------------------------------------

def _next_tmp(tier: FsTier, k: bytes) -> str:
    """The temp name the tier's next put of ``k`` uses (a co-tenant reads the tag off the
    directory listing and counts: the sequence is visible in every temp name)."""
    n = next(tier._seq)  # consumed here, so the put uses n + 1
    return f".{k.hex()}.{tier._tag}.{n + 1}{fs_mod._TMP}"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dir"])
def test_a_thing_planted_at_the_temp_name_neither_blocks_nor_is_written_through(tmp_path, kind):
    tier = direct_tier(tmp_path)
    assert tier.put(key(3), b"first" * 1000)
    sub = os.path.join(tmp_path, key(3).hex()[:2])
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch")
    planted = os.path.join(sub, _next_tmp(tier, key(3)))
    if kind == "fifo":
        os.mkfifo(planted)
    elif kind == "symlink":
        os.symlink(victim, planted)
    else:
        os.mkdir(planted)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(tier.put(key(3), b"second" * 1000)))
    t.start()
    t.join(10)
    assert not t.is_alive(), "the put blocked on the planted name"
    assert done == [False]  # O_EXCL: never written through
    assert victim.read_bytes() == b"do not touch"
    assert tier.direct_io  # EEXIST is not a refusal of O_DIRECT
    assert tier.get(key(3)) == b"first" * 1000
    assert tier.put(key(3), b"third" * 1000) and tier.get(key(3)) == b"third" * 1000
    tier.close()


def test_a_symlinked_fanout_dir_gets_no_direct_write(tmp_path):
    tier = direct_tier(tmp_path / "shared")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "shared" / key(4).hex()[:2])
    assert tier.put(key(4), payload(10_000)) is False
    assert os.listdir(elsewhere) == []
    assert tier.stats.errors >= 1 and tier.direct_io
    tier.close()


# --- memory ----------------------------------------------------------------------------------

def test_bounce_memory_is_bounded_by_slots_times_the_largest_entry_and_freed_by_close(tmp_path):
    tier = direct_tier(tmp_path)
    big = 8 << 20
    barrier = threading.Barrier(8)

    def writer(t: int) -> None:
        barrier.wait()
        assert tier.put(key(200 + t), payload(big + t, t))

    ts = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    for i in range(20):  # small entries afterwards reuse the buffers, never add more
        assert tier.put(key(300 + i), b"s" * 100)
    limit = fs_mod._DIRECT_SLOTS * direct_mod.round_up(big + 7 + header_bytes())
    assert 0 < mapped_bytes(tier._bounce) <= limit
    tier.close()
    assert mapped_bytes(tier._bounce) == 0


# --- leftovers of a crash --------------------------------------------------------------------

def _plant_probe_leftover(root, age_s: float = 7200.0) -> str:
    name = f".direct-{uuid.uuid4().hex}.tmp"
    path = os.path.join(root, name)
    with open(path, "wb") as f:
        f.write(bytes(direct_mod.ALIGN))
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_a_leftover_probe_file_in_the_fs_root_is_not_an_entry_nor_counted(tmp_path):
    """A probe file that is not stale (another node's probe, under way) is neither an entry nor
    counted, and the scan leaves it alone."""
    tier = make(tmp_path, o_direct=True)
    leftover = _plant_probe_leftover(tmp_path, age_s=0)
    assert tier.put(key(1), b"x" * 1000)
    tier._scan()
    assert tier.used_bytes() == 1000
    assert list(tier.keys()) == [key(1)]
    assert os.path.getsize(leftover) == direct_mod.ALIGN
    tier.close()


def test_the_fs_start_up_probe_leaves_no_file_behind(tmp_path):
    for _ in range(3):
        make(tmp_path, o_direct=True).close()
    assert temps(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == []


def test_a_stale_probe_file_left_in_the_fs_root_by_a_crash_is_removed_by_the_scan(tmp_path):
    """A node killed while its start-up probe ran leaves ``.direct-<hex>.tmp`` in the shared
    root: the scan removes it once it is older than ``stale_tmp_s`` (it once looked for stale
    temps only inside fan-out directories); other names in the root are never touched."""
    leftover = _plant_probe_leftover(tmp_path)
    foreign = tmp_path / ".direct-not-ours.tmp"
    foreign.write_bytes(b"x")
    os.utime(foreign, (time.time() - 7200, time.time() - 7200))
    tier = make(tmp_path, o_direct=True, stale_tmp_s=60)
    assert tier.put(key(1), b"x" * 1000)
    tier._scan()
    tier.close()
    assert not os.path.exists(leftover), "a crashed probe's temp file in the root is never removed"
    assert foreign.exists()  # a name the probe never makes is not the tier's to remove


# --- the disk tier, now on the shared code -------------------------------------------------

def disk(path, **kw) -> DiskTier:
    kw.setdefault("capacity", 1 << 26)
    return DiskTier(DiskTier.Config(path=str(path), **kw), name="disk")


def test_disk_start_up_probe_leaves_nothing_and_a_crash_leftover_is_removed_not_indexed(tmp_path):
    root = tmp_path / "d"
    t = disk(root, o_direct=True)
    assert t.scan_report == {"entries": 0, "temp_removed": 0, "corrupt_removed": 0}
    assert [n for n in os.listdir(root) if n.endswith(".tmp")] == []
    t.close()
    leftover = _plant_probe_leftover(root, age_s=0)
    t = disk(root, o_direct=True)
    assert not os.path.exists(leftover)
    assert t.scan_report["entries"] == 0 and t.scan_report["temp_removed"] == 1
    assert t.used_bytes() == 0 and list(t.keys()) == []
    t.close()


@pytest.mark.parametrize("o_direct", [True, False])
@pytest.mark.parametrize("fsync", [True, False])
def test_disk_direct_and_buffered_paths_still_round_trip_and_drop_their_pages(tmp_path, o_direct, fsync):
    t = disk(tmp_path / "d", o_direct=o_direct, fsync=fsync)
    sizes = [0, 1, 4095, 4096, 65_537]
    for i, n in enumerate(sizes):
        assert t.put(key(i), payload(n, i))
    t.drop_cached()
    for i, n in enumerate(sizes):
        path = t._file(key(i))
        assert os.path.getsize(path) == n + header_bytes()
        if n:
            assert resident_pages(path) == 0, (o_direct, fsync, n)
        assert t.get(key(i)) == payload(n, i)
    assert t.stats.errors == 0 and t.stats.corrupt == 0
    assert [n for n in os.listdir(tmp_path / "d") if n.endswith(".tmp")] == []
    t.close()
    assert mapped_bytes(t._bounce) == 0


def test_disk_einval_at_a_direct_write_goes_buffered_and_lands(tmp_path, monkeypatch):
    t = disk(tmp_path / "d", o_direct=True)
    if not t.direct_io:
        t.close()
        pytest.skip("O_DIRECT unsupported here")
    monkeypatch.setattr(direct_mod, "write_all", einval)
    assert t.put(key(1), payload(12_345, 1))
    monkeypatch.undo()
    assert not t.direct_io and t.get(key(1)) == payload(12_345, 1)
    assert t.stats.errors == 0
    assert [n for n in os.listdir(tmp_path / "d" / key(1).hex()[:2]) if n.endswith(".tmp")] == []
    t.close()


# --- what counts as a refusal of O_DIRECT ----------------------------------------------------

def test_a_write_time_eopnotsupp_is_a_refusal_as_at_the_probe(tmp_path, monkeypatch):
    """The start-up probe takes EOPNOTSUPP as 'O_DIRECT refused', and so does the write path
    (it once went buffered only on EINVAL): a fan-out directory whose file system answers
    EOPNOTSUPP to an O_DIRECT create gets buffered writes, not a failed put each time."""
    tier = direct_tier(tmp_path)
    real = direct_mod.create_exclusive_at

    def unsupported(dir_fd, name, mode, gid=-1, flags=0):  # a fake only to inject the refusal
        if flags & direct_mod.O_DIRECT:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real(dir_fd, name, mode, gid, flags)

    monkeypatch.setattr(direct_mod, "create_exclusive_at", unsupported)
    landed = [tier.put(key(i), payload(6000 + i, i)) for i in range(3)]
    monkeypatch.undo()
    try:
        assert landed == [True, True, True], f"puts refused O_DIRECT with EOPNOTSUPP: {landed}, " \
                                             f"errors {tier.stats.errors}"
        assert not tier.direct_io
    finally:
        tier.close()


# --- operator settings on the direct path ----------------------------------------------------

def test_direct_with_fsync_and_a_group_mode_keeps_exact_modes_and_bytes(tmp_path):
    tier = direct_tier(tmp_path, fsync=True, mode="0640")
    data = payload(123_457, 3)
    assert tier.put(key(1), data)
    (path,) = entry_files(tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o750
    assert resident_pages(path) == 0 and tier.get(key(1)) == data
    assert temps(tmp_path) == [] and os.listdir(tmp_path) == [key(1).hex()[:2]]
    tier.close()


def test_used_bytes_is_exact_after_concurrent_direct_puts_and_a_scan(tmp_path):
    tier = direct_tier(tmp_path)
    sizes = [0, 1, 4095, 4096, 4097, 70_001, 1 << 20, 3]
    barrier = threading.Barrier(len(sizes))

    def writer(i: int) -> None:
        barrier.wait()
        assert tier.put(key(400 + i), payload(sizes[i], i))

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(len(sizes))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert tier.used_bytes() == sum(sizes)
    tier._scan()
    assert tier.used_bytes() == sum(sizes)
    assert sorted(tier.keys()) == sorted(key(400 + i) for i in range(len(sizes)))
    tier.close()

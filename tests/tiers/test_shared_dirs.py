"""fs and disk tiers on directories another user writes (issue 24 items 5-7, file modes).

The hostile tenant is uid 12345: the tests (run as root) make FIFOs, symlinks and directories
and hand them to that uid, as a tenant with write access to the directory would leave them.
Every call that could hang runs on a thread with a deadline, so a regression fails instead of
freezing the suite.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest

from kvtier.config import build
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.fs import FsConfig, FsTier

TENANT = 12345
DEADLINE_S = 1.0

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid (chown)")


def key(first: int, i: int = 0) -> bytes:
    return bytes([first]) + i.to_bytes(4, "little") * 7 + b"\0\0\0"


def fs(path, **kw) -> FsTier:
    return FsTier(FsConfig(path=str(path), **kw), name="fs")


def disk(path, **kw) -> DiskTier:
    kw.setdefault("capacity", 1 << 24)
    return DiskTier(DiskConfig(path=str(path), **kw), name="disk")


def within(call, *args, deadline_s: float = DEADLINE_S):
    """``call(*args)`` on a daemon thread; its result, or a failed test if it takes longer."""
    box: dict = {}

    def run():
        try:
            box["value"] = call(*args)
        except BaseException as exc:  # reported below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} still blocked after {deadline_s} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def unblock(fifo: str) -> None:
    """Release a reader stuck in open() on ``fifo`` (old code), so the thread can end."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def plant_fifo(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    os.chown(path, TENANT, TENANT)


# ------------------------------------------------------------------------------- item 5: FIFOs


@needs_root
def test_fs_fifo_at_an_entry_name_is_a_counted_miss_not_a_hang(tmp_path):
    tier = fs(tmp_path / "shared")
    k = key(0x3C)
    fifo = tier._path(k)
    plant_fifo(fifo)
    try:
        assert within(tier.contains, k) is False  # a lookup does not count it
        assert within(tier.size_of, k) is None
        assert within(tier.get_into, k, bytearray(4096)) is None
        assert within(tier.get, k) is None
        assert list(tier.keys()) == []
        assert tier.stats.corrupt >= 3 and tier.stats.misses >= 1 and tier.stats.hits == 0
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # another user's file: left alone
        assert within(tier.put, k, b"v" * 100) is True  # a publish replaces the name
        assert tier.get(k) == b"v" * 100
    finally:
        unblock(fifo)
        tier.close()


@needs_root
def test_fs_symlink_at_an_entry_name_is_never_followed(tmp_path):
    tier = fs(tmp_path / "shared")
    k = key(0x3D)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the tier")
    os.makedirs(os.path.dirname(tier._path(k)))
    os.symlink(secret, tier._path(k))
    assert not tier.contains(k) and tier.get(k) is None and tier.size_of(k) is None
    assert not tier.delete(k) and secret.exists()
    tier.close()


@needs_root
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "odirect"])
def test_disk_entry_swapped_for_a_fifo_is_a_miss_and_does_not_hold_other_keys(tmp_path, o_direct):
    """Opening a FIFO with O_DIRECT fails (EINVAL) before it can be told apart from a regular
    file: the tier opens without it and sets it once the file is known to be regular."""
    tier = disk(tmp_path / "d", o_direct=o_direct)
    k, other = key(0x10), key(0x11)
    assert tier.put(k, b"a" * 5000) and tier.put(other, b"b" * 10)
    path = tier._file(k)
    os.unlink(path)
    plant_fifo(path)
    started = threading.Event()
    result: dict = {}

    def read():
        started.set()
        result["got"] = tier.get_into(k, bytearray(5000))

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        started.wait()
        assert within(tier.contains, other) is True  # never waits behind the FIFO's reader
        reader.join(DEADLINE_S)
        assert not reader.is_alive(), "get_into blocked on a FIFO"
        assert result["got"] is None and tier.stats.corrupt == 1
        assert not tier.contains(k) and tier.used_bytes() == 10
        assert tier.get(other) == b"b" * 10
    finally:
        unblock(path)
        tier.close()


@needs_root
def test_disk_probe_does_not_count_a_fifo(tmp_path):
    config = DiskConfig(path=str(tmp_path / "d"))
    tier = DiskTier(config, name="disk")
    k = key(0x12)
    plant_fifo(tier._file(k))
    probe = DiskTier.scheduler_probe(config, "disk")
    assert probe.contains_many([k]) == [False]
    tier.close()


# ------------------------------------------------------------------- item 6: symlinked fan-out


def _foreign_store(tmp_path, first: int):
    """A directory of someone else's (a hub blob store): a 64-hex name that matches a key."""
    elsewhere = tmp_path / "blobs"
    elsewhere.mkdir()
    blob = elsewhere / key(first, 99).hex()
    blob.write_bytes(b"precious" * 1000)
    os.utime(blob, (1000, 1000))  # older than anything the tier writes
    os.chown(elsewhere, TENANT, TENANT)
    os.chown(blob, TENANT, TENANT)
    return elsewhere, blob


@needs_root
def test_fs_symlinked_fanout_is_skipped_never_written_or_swept(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    elsewhere, blob = _foreign_store(tmp_path, 0xAB)
    os.symlink(elsewhere, root / "ab")
    os.lchown(root / "ab", TENANT, TENANT)
    tier = fs(root, capacity=6000)
    assert tier.put(key(0xAB), b"x" * 100) is False
    assert tier.stats.errors >= 1
    assert tier.get(key(0xAB, 99)) is None and not tier.contains(key(0xAB, 99))
    for i in range(4):  # over budget: the scan evicts, but only inside real fan-out directories
        assert tier.put(key(0x20 + i), b"y" * 3000)
    assert tier.stats.evictions >= 1
    assert os.listdir(elsewhere) == [blob.name] and blob.read_bytes() == b"precious" * 1000
    assert key(0xAB, 99) not in set(tier.keys())
    tier.close()


@needs_root
def test_disk_symlinked_fanout_is_skipped_never_written(tmp_path):
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    elsewhere, blob = _foreign_store(tmp_path, 0xAB)
    os.symlink(elsewhere, root / "ab")
    tier = disk(root)
    assert tier.put(key(0xAB), b"x" * 100) is False
    assert tier.skipped_dirs == ["ab"] and tier.stats.errors >= 1
    assert tier.put(key(0xAC), b"x" * 100) is True
    assert tier.delete(key(0xAB, 99)) is False
    assert os.listdir(elsewhere) == [blob.name]
    tier.close()


# ----------------------------------------------------------- item 7: whose directory it is


@needs_root
@pytest.mark.parametrize("problem", ["owner", "world-writable", "group-writable", "fanout owner"])
def test_disk_refuses_a_directory_another_user_can_write(tmp_path, problem):
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    if problem == "owner":
        os.chown(root, TENANT, TENANT)
        match = f"belongs to uid {TENANT}"
    elif problem == "world-writable":
        os.chmod(root, 0o777)
        match = r"writable by other users \(mode 0777\)"
    elif problem == "group-writable":
        os.chmod(root, 0o770)
        match = r"writable by other users \(mode 0770\)"
    else:
        (root / "ab").mkdir()
        os.chown(root / "ab", TENANT, TENANT)
        match = f"{root / 'ab'} belongs to uid {TENANT}"
    with pytest.raises(TierUnavailable, match=match) as caught:
        disk(root)
    assert "\n" not in str(caught.value)
    assert sorted(os.listdir(root)) in ([], ["ab"])  # nothing written into it, no lock file either


@needs_root
def test_disk_lock_file_is_never_created_through_a_symlink(tmp_path):
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    target = tmp_path / "victim"
    os.symlink(target, root / ".kvtier.lock")
    with pytest.raises(TierUnavailable, match="lock file"):
        disk(root)
    assert not target.exists()


@needs_root
def test_fs_refuses_a_world_writable_directory_without_sticky_bit_unless_declared(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(TierUnavailable, match=r"writable by every user \(mode 0777\) without the sticky bit"):
        fs(root)
    fs(root, mode="0666").close()  # sharing with every user is deliberate
    os.chmod(root, 0o1777)
    fs(root).close()  # /tmp-like: others cannot replace or remove our files
    os.chmod(root, 0o755)
    os.chown(root, TENANT, TENANT)
    fs(root).close()  # a shared directory may belong to anyone


@needs_root
def test_fs_world_writable_fanout_is_refused_at_start_and_skipped_later(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    (root / "5e").mkdir()
    os.chmod(root / "5e", 0o777)
    with pytest.raises(TierUnavailable, match="5e is writable by every user"):
        fs(root)
    os.chmod(root / "5e", 0o700)
    tier = fs(root, usage_refresh_s=0)
    os.chmod(root / "5e", 0o777)  # another tenant opens it up after the start
    assert tier.put(key(0x5E), b"q" * 10) is False and tier.stats.errors >= 1
    assert os.listdir(root / "5e") == []
    tier.close()


# ---------------------------------------------------------------------------------- file modes


def _modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = stat.S_IMODE(os.lstat(full).st_mode)
    return out


@pytest.mark.parametrize("make", [fs, disk], ids=["fs", "disk"])
def test_entries_and_directories_are_owner_only_by_default(tmp_path, make, monkeypatch):
    import kvtier.tiers.direct as direct_mod
    import kvtier.tiers.disk as disk_mod
    import kvtier.tiers.fs as fs_mod

    seen_tmp = []
    for mod in (fs_mod, disk_mod, direct_mod):
        real = mod.write_all

        def spy(fd, bufs, real=real):  # only to look at the temp file while it is written
            seen_tmp.append(stat.S_IMODE(os.fstat(fd).st_mode))
            return real(fd, bufs)

        monkeypatch.setattr(mod, "write_all", spy)
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        tier = make(tmp_path / "t")
        assert tier.put(key(0x42), b"p" * 100)
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "t")
    entry_name = os.path.join("42", key(0x42).hex())
    assert modes[entry_name] == 0o600 and modes["42"] == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    assert seen_tmp and set(seen_tmp) == {0o600}  # the entry's temp file (and an O_DIRECT probe's)
    assert all(m & 0o077 == 0 for m in modes.values()), modes
    tier.close()


@needs_root
@pytest.mark.parametrize("make", [fs, disk], ids=["fs", "disk"])
def test_mode_and_group_share_deliberately(tmp_path, make):
    tier = make(tmp_path / "t", mode="0640", group=str(TENANT))
    assert tier.put(key(0x43), b"p" * 100)
    entry_path = tmp_path / "t" / "43" / key(0x43).hex()
    st, dst = os.stat(entry_path), os.stat(entry_path.parent)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == TENANT
    assert stat.S_IMODE(dst.st_mode) == 0o750 and dst.st_gid == TENANT
    tier.close()


@pytest.mark.parametrize("config, bad", [
    (FsConfig, {"mode": "rw-r-----"}), (FsConfig, {"mode": "0400"}), (FsConfig, {"mode": "01777"}),
    (FsConfig, {"mode": 640}), (FsConfig, {"group": "no-such-group-kvtier"}),
    (DiskConfig, {"mode": "0660"}), (DiskConfig, {"mode": "0602"}), (DiskConfig, {"mode": "9"}),
])
def test_bad_mode_or_group_is_one_line_naming_the_key(tmp_path, config, bad):
    with pytest.raises(ConfigError) as caught:
        tier = (FsTier if config is FsConfig else DiskTier)(build(config, {"path": str(tmp_path), **bad}, "t"))
        tier.close()
    message = str(caught.value)
    assert "\n" not in message and f"t.{next(iter(bad))}" in message

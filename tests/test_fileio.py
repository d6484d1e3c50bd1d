"""kvtier.fileio: whole-buffer reads and writes on a real file."""

from __future__ import annotations

import os

import pytest

from kvtier.fileio import ShortRead, advance, read_exact, read_upto, unlink_quietly, write_all


def test_write_all_then_read_exact_round_trip(tmp_path):
    path = tmp_path / "f"
    parts = [b"head", b"", bytes(range(256)) * 4096]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, parts)
    finally:
        os.close(fd)
    head, body = bytearray(4), bytearray(256 * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exact(fd, [memoryview(head), memoryview(body)])
        tail = bytearray(10)
        assert read_upto(fd, [memoryview(tail)], offset=4 + 256 * 4096 - 3) == 3
        with pytest.raises(ShortRead) as caught:
            read_exact(fd, [memoryview(bytearray(8))], offset=4 + 256 * 4096 - 5)
        assert (caught.value.wanted, caught.value.got) == (8, 5)
    finally:
        os.close(fd)
    assert bytes(head) == b"head" and bytes(body) == parts[2]


def test_advance_drops_the_moved_bytes():
    views = [memoryview(b"abc"), memoryview(b"de")]
    assert [bytes(v) for v in advance(views, 4)] == [b"e"]
    assert [bytes(v) for v in advance(views, 3)] == [b"de"]


def test_unlink_quietly(tmp_path):
    path = tmp_path / "x"
    path.write_bytes(b"1")
    assert unlink_quietly(str(path)) is True
    assert unlink_quietly(str(path)) is False


# ------------------------------------------------------- hostile names (issue 24 items 5-7)

import errno  # noqa: E402
import stat  # noqa: E402
import threading  # noqa: E402

from kvtier.fileio import (NotRegularFile, create_exclusive_at, dir_mode_for, make_dir_at, open_dir_at,  # noqa: E402
                           open_regular_at, parse_mode, resolve_group, unlink_at, untrusted_dir)


def _dir_fd(path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def test_open_regular_at_refuses_a_fifo_at_once_and_never_follows_a_link(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_bytes(b"data")
    os.symlink(tmp_path / "real", tmp_path / "link")
    os.mkdir(tmp_path / "dir")
    dfd = _dir_fd(tmp_path)
    outcome = {}

    def try_fifo():
        try:
            open_regular_at(dfd, "fifo")
        except NotRegularFile:
            outcome["refused"] = True

    thread = threading.Thread(target=try_fifo, daemon=True)
    thread.start()
    thread.join(1.0)
    try:
        assert not thread.is_alive() and outcome == {"refused": True}  # no writer needed, no hang
        for name in ("link", "dir"):
            with pytest.raises(NotRegularFile):
                open_regular_at(dfd, name)
        with pytest.raises(FileNotFoundError):
            open_regular_at(dfd, "absent")
        fd, st = open_regular_at(dfd, "real")
        assert os.read(fd, 10) == b"data" and stat.S_ISREG(st.st_mode)
        os.close(fd)
    finally:
        try:
            os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))  # frees a reader stuck in open
        except OSError:
            pass
        os.close(dfd)


def test_directories_and_new_files_are_never_reached_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "ab")
    os.symlink(tmp_path / "target", tmp_path / "new")
    dfd = _dir_fd(tmp_path)
    try:
        with pytest.raises(OSError) as caught:
            open_dir_at(dfd, "ab")
        assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
        with pytest.raises(OSError):
            make_dir_at(dfd, "ab", 0o700)
        with pytest.raises(OSError):
            create_exclusive_at(dfd, "new", 0o600)
        assert not (tmp_path / "target").exists() and os.listdir(elsewhere) == []
        old = os.umask(0o077)
        try:
            fd = make_dir_at(dfd, "cd", 0o750)
            os.close(fd)
            os.close(create_exclusive_at(dfd, "f", 0o640))
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(tmp_path / "cd").st_mode) == 0o750  # exactly, whatever the umask
        assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640
    finally:
        os.close(dfd)


def test_unlink_at_keeps_a_file_published_meanwhile(tmp_path):
    (tmp_path / "e").write_bytes(b"old")
    seen = os.stat(tmp_path / "e")
    (tmp_path / "e2").write_bytes(b"new")
    os.replace(tmp_path / "e2", tmp_path / "e")
    dfd = _dir_fd(tmp_path)
    try:
        assert unlink_at(dfd, "e", same_as=seen) is False and (tmp_path / "e").read_bytes() == b"new"
        assert unlink_at(dfd, "e", same_as=os.stat(tmp_path / "e")) is True
        assert unlink_at(dfd, "e") is False
    finally:
        os.close(dfd)


def test_mode_strings_and_groups():
    assert parse_mode("0600") == 0o600 and parse_mode("640") == 0o640 and parse_mode("0660") == 0o660
    for bad in ("", "60", "0x640", "rw-------", "0400", "1777", "04600", 640, None):
        with pytest.raises(ValueError):
            parse_mode(bad)
    with pytest.raises(ValueError, match="group or others"):
        parse_mode("0620", no_shared_write=True)
    assert dir_mode_for(0o600) == 0o700 and dir_mode_for(0o640) == 0o750 and dir_mode_for(0o666) == 0o777
    assert resolve_group(None) == -1 and resolve_group("12345") == 12345 and resolve_group("root") == 0
    with pytest.raises(ValueError, match="no group named"):
        resolve_group("no-such-group-kvtier")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another uid")
def test_untrusted_dir_is_serves_rule(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert untrusted_dir(os.stat(d)) is None
    os.chmod(d, 0o1777)
    assert "writable by other users (mode 1777)" in untrusted_dir(os.stat(d))
    os.chmod(d, 0o700)
    os.chown(d, 12345, 12345)
    assert "belongs to uid 12345" in untrusted_dir(os.stat(d), "server")
    (tmp_path / "f").write_text("x")
    assert untrusted_dir(os.stat(tmp_path / "f")) == "is not a directory"

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

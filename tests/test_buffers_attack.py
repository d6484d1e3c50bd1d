"""Hostile review of ``scatter`` and ``copy_segments`` copying through ``copy_pairs`` (commit
4937bb6): the rules the review checked and keeps, on the extension's path and numpy's. No
defect was found here (the one scatter caller that could pass segments of another total, the
client's staging path, is fixed and tested in tests/server/test_request_poll_attack.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier import fastcopy
from kvtier.buffers import copy_segments, scatter


@pytest.fixture(params=["extension", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(fastcopy, "_ntcopy", None)
    elif fastcopy._ntcopy is None:
        pytest.skip("the extension is not built here")
    return request.param


def _src(n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(1, 256, n, dtype=np.uint8)  # no zero byte


@pytest.mark.parametrize("bad", ["bytes", "read-only array", "non-contiguous memoryview"])
def test_scatter_refuses_a_segment_it_cannot_write_before_a_byte_moves(path, bad):
    first = np.zeros(8192, dtype=np.uint8)  # large enough to stream
    if bad == "bytes":
        other = bytes(8192)
    elif bad == "read-only array":
        other = np.zeros(8192, dtype=np.uint8)
        other.flags.writeable = False
    else:
        other = memoryview(bytearray(16384))[::2]
    with pytest.raises((ValueError, BufferError)):
        scatter(_src(16384), [first, other])
    assert not first.any()


def test_scatter_takes_strided_arrays_and_any_flat_layout_on_both_paths(path):
    src = _src(12)
    backing = np.zeros(24, dtype=np.uint8)
    assert scatter(src, [backing[::2][:6], backing[1::2][:6]]) == 12  # strided uint8 segments
    assert np.array_equal(backing[:12], np.ravel(np.column_stack([src[:6], src[6:]])))
    out = np.zeros((3, 4), dtype=np.uint8)  # a 2-D segment is its bytes
    assert scatter(np.arange(24, dtype=np.uint8)[::2], [out]) == 12  # a strided source
    assert np.array_equal(out.ravel(), np.arange(0, 24, 2))
    words = np.zeros(2, dtype=np.float32)  # another item type: its bytes, never a cast
    assert scatter(np.arange(8, dtype=np.uint8), [words]) == 8
    assert words.tobytes() == bytes(range(8))


def test_scatter_of_nothing_and_of_zero_length_segments(path):
    assert scatter(b"", []) == 0
    segments = [bytearray(0), np.zeros(3, dtype=np.uint8), np.zeros(0, dtype=np.uint8)]
    assert scatter(b"abc", segments) == 3 and bytes(segments[1]) == b"abc"


def test_copy_segments_with_zero_length_pieces_on_both_sides(path):
    data = _src(10000)
    src = [np.zeros(0, np.uint8), data[:4096], np.zeros(0, np.uint8), data[4096:], np.zeros(0, np.uint8)]
    dst = [np.zeros(0, np.uint8), np.zeros(7, np.uint8), np.zeros(0, np.uint8), np.zeros(9993, np.uint8)]
    copy_segments(src, dst)
    assert np.array_equal(np.concatenate(dst), data)
    copy_segments([], [])
    copy_segments([np.zeros(0, np.uint8)], [])


def test_copy_segments_with_too_few_source_bytes_copies_nothing(path):
    dst = [np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)]
    with pytest.raises(IndexError):
        copy_segments([_src(10000)], dst)
    assert not any(d.any() for d in dst)  # the pairs are all planned before a byte moves


def test_copy_segments_refuses_a_read_only_destination_before_a_byte_moves(path):
    first, ro = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        copy_segments([_src(16384)], [first, ro])
    assert not first.any()

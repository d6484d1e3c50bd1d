"""kvtier.buffers: the one place that walks segment lists (an entry's bytes in several pieces)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.buffers import split_segments, total_bytes


def test_split_segments_cuts_across_segment_boundaries_without_copying():
    data = np.arange(12, dtype=np.uint8)
    segments = [data[:5], data[5:7], data[7:]]
    parts = split_segments(segments, [3, 0, 6, 3])
    assert [total_bytes(p) for p in parts] == [3, 0, 6, 3]
    assert [np.concatenate(p).tolist() if p else [] for p in parts] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8],
                                                                      [9, 10, 11]]
    parts[2][0][0] = 99  # views of the segments: a fill through a part lands in the entry
    assert data[3] == 99


def test_split_segments_takes_bytes_like_segments():
    parts = split_segments([b"abc", bytearray(b"defg")], [4, 3])
    assert [b"".join(bytes(x) for x in p) for p in parts] == [b"abcd", b"efg"]


@pytest.mark.parametrize("sizes", [[5], [7, 1], [2, 2, 2]])
def test_split_segments_refuses_parts_that_do_not_add_up(sizes):
    with pytest.raises(ValueError, match="do not cut a payload of 7"):
        split_segments([np.zeros(3, np.uint8), np.zeros(4, np.uint8)], sizes)


def test_scatter_fills_every_segment_in_order_with_the_exact_bytes():
    from kvtier.buffers import scatter

    src = np.random.default_rng(0).integers(0, 256, 3 * 65536 + 17, dtype=np.uint8)  # streamed and not
    segments = [np.zeros(n, dtype=np.uint8) for n in (65536, 17, 2 * 65536)]
    assert scatter(src, segments) == src.size
    assert np.array_equal(np.concatenate(segments), src)
    assert scatter(bytes(5), [bytearray(2), bytearray(3)]) == 5  # bytes-like on both sides


@pytest.mark.parametrize("sizes", [(10, 10), (10,), (4, 4)])
def test_scatter_refuses_segments_that_do_not_hold_the_source_exactly_and_copies_nothing(sizes):
    from kvtier.buffers import scatter

    segments = [np.zeros(n, dtype=np.uint8) for n in sizes]
    with pytest.raises(ValueError, match="segments of"):
        scatter(np.ones(12, dtype=np.uint8), segments)
    assert not any(seg.any() for seg in segments)


def test_copy_segments_copies_across_unequal_boundaries():
    from kvtier.buffers import copy_segments

    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    src = [data[:7], data[7:60_000], data[60_000:]]
    dst = [np.zeros(n, dtype=np.uint8) for n in (50_000, 3, 49_997)]
    copy_segments(src, dst)
    assert np.array_equal(np.concatenate(dst), data)

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

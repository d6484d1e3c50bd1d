"""Buffer helpers: copies between contiguous buffers and lists of segments.

An entry's bytes often sit in several segments (the extents of arena pages, staging pages,
a reservation): a *segment list* is a list of flat uint8 arrays (or buffers numpy can view)
whose concatenation is the payload. These helpers are the only place that walks such lists,
so every copy in the store, the server and its client is one of them.

Writes into a tier's storage (``scatter``, ``copy_segments``) go through
``kvtier.fastcopy.copy_pairs``: streaming stores where its extension is built (the bytes are read
by another process or much later, never by the copying core next), the GIL released. Reads out
of a tier (``gather_into``, ``gather``) use ordinary copies: their caller reads the bytes next.

Imports: numpy and ``fastcopy`` (both the ground floor). No global state.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from kvtier.fastcopy import copy_pairs

Segments = Sequence[Any]  # flat uint8 arrays or bytes-like objects, in payload order


class BufferTooSmall(ValueError):
    """A destination cannot hold the bytes to copy (raised before anything is copied)."""


def byte_view(buf: Any) -> np.ndarray:
    """A flat uint8 view of a contiguous bytes-like object or array (no copy)."""
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1:
        return buf
    return np.frombuffer(buf, dtype=np.uint8)  # refuses a non-contiguous buffer (never a silent copy)


def total_bytes(segments: Segments) -> int:
    """The payload size of a segment list."""
    return sum(memoryview(seg).nbytes for seg in segments)


def gather_into(segments: Segments, out: Any) -> int:
    """Copy the concatenation of ``segments`` into the start of the writable buffer ``out``.

    Returns the byte count. BufferTooSmall, with ``out`` untouched, when it cannot hold them all.
    """
    dst = byte_view(out)
    if total_bytes(segments) > dst.size:
        raise BufferTooSmall(f"buffer of {dst.size} bytes too small for {total_bytes(segments)} bytes")
    pos = 0
    for seg in segments:
        seg = byte_view(seg)
        dst[pos : pos + seg.size] = seg
        pos += seg.size
    return pos


def gather(segments: Segments) -> bytes:
    """The concatenation of ``segments`` as new bytes."""
    if len(segments) == 1:
        return bytes(memoryview(segments[0]))
    return b"".join(bytes(memoryview(seg)) for seg in segments)


def scatter(src: Any, segments: Segments) -> int:
    """Copy the contiguous ``src`` into the writable ``segments`` in order; returns the bytes
    copied. ValueError, before a byte moves, unless the segments' total is ``src``'s size.
    ``src`` must not overlap the segments (``copy_pairs``: a memcpy)."""
    data = byte_view(src)
    views = [byte_view(seg) for seg in segments]
    if sum(v.size for v in views) != data.size:
        raise ValueError(f"segments of {sum(v.size for v in views)} bytes for a source of {data.size} bytes")
    pairs, pos = [], 0
    for view in views:
        pairs.append((view, data[pos : pos + view.size]))
        pos += view.size
    copy_pairs(pairs)
    return pos


def split_segments(segments: Segments, sizes: Sequence[int]) -> list[list[np.ndarray]]:
    """The payload of ``segments`` cut into consecutive parts of ``sizes`` bytes, each a segment
    list of views (no copy). ValueError unless the sizes add up to the payload exactly."""
    views = [byte_view(seg) for seg in segments]
    if sum(sizes) != sum(v.size for v in views):
        raise ValueError(f"parts of {sum(sizes)} bytes do not cut a payload of {sum(v.size for v in views)}")
    parts: list[list[np.ndarray]] = []
    si = so = 0
    for size in sizes:
        part: list[np.ndarray] = []
        while size > 0:
            v = views[si]
            n = min(size, v.size - so)
            part.append(v[so : so + n])
            size -= n
            so += n
            if so == v.size:
                si += 1
                so = 0
        parts.append(part)
    return parts


def copy_segments(src: Segments, dst: Segments) -> None:
    """Copy the concatenation of uint8 segments ``src`` into segments ``dst`` (same total size;
    not overlapping), whatever the two lists' boundaries are."""
    pairs = []
    si = so = 0
    for seg in dst:
        pos = 0
        while pos < seg.size:
            s = src[si]
            n = min(seg.size - pos, s.size - so)
            pairs.append((seg[pos : pos + n], s[so : so + n]))
            pos += n
            so += n
            if so == s.size:
                si += 1
                so = 0
    copy_pairs(pairs)


class Scratch:
    """Reusable per-thread buffers, so a hot path allocates once per thread (memory stays flat).

    ``slot`` names uses that can be live at once in one thread. A buffer is valid until the same
    thread asks for the same slot again. Thread-safe by construction (thread-local storage).
    """

    def __init__(self, minimum: int = 1 << 20):
        self._minimum = minimum
        self._local = threading.local()

    def get(self, size: int, slot: str = "io") -> np.ndarray:
        """A uint8 array of exactly ``size`` bytes from this thread's ``slot`` buffer."""
        buf = getattr(self._local, slot, None)
        if buf is None or buf.size < size:
            buf = np.empty(max(size, self._minimum), dtype=np.uint8)
            setattr(self._local, slot, buf)
        return buf[:size]

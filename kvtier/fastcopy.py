"""Copies of KV pages between an engine's cache and a tier: ``copy_pairs``.

Large pages are copied with non-temporal (streaming) stores by the optional C extension
``kvtier._ntcopy`` (built by ``pip install`` where a C compiler is found; see its source for
why), with the GIL released; without it, each pair is copied with ``np.copyto``. Either way the
result is the same bytes. ``STREAMING`` says which one this process uses.

Imports: numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

try:
    from kvtier import _ntcopy
except ImportError:  # no compiler at install time, or a platform it was not built for
    _ntcopy = None

STREAMING = bool(_ntcopy is not None and _ntcopy.STREAMING)


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], release_gil: bool = True) -> None:
    """``dst[:] = src[:]`` for each ``(dst, src)`` tuple of buffers (uint8 arrays) of equal byte
    length, copied byte for byte (never cast or broadcast).

    Contract, on both paths: nothing is copied unless every pair is valid (a read-only or
    shorter ``dst``, a non-buffer or a non-tuple item raises before a byte moves). The pairs go
    to the extension in one call; where it cannot take a pair (its ``BufferError``: a view that
    is not C-contiguous, or an exporter's refusal), or without the extension, every pair is
    checked, then copied with ``np.copyto`` (a non-contiguous pair must then have one shape and
    one item size on both sides). ``pairs`` may be any iterable (it is read once).
    Pairs must not overlap. ``release_gil``: let other Python threads run during the copy (a
    background copy); False keeps the GIL (the engine's own thread, which would otherwise wait
    for another thread to hand it back after the copy)."""
    if not isinstance(pairs, (list, tuple)):
        pairs = list(pairs)  # a generator: the extension would use it up before the fallback
    if _ntcopy is None:
        _numpy_copy(pairs)
        return
    try:
        _ntcopy.copy_pairs(pairs, release_gil)
    except BufferError:  # a non-contiguous view (numpy copies any layout), or a refused export
        _numpy_copy(pairs)


def _as_array(obj, i: int, role: str) -> np.ndarray:
    """``obj`` as an array over its own memory (any buffer); TypeError naming the pair otherwise."""
    if isinstance(obj, np.ndarray):
        return obj
    try:
        return np.asarray(memoryview(obj))
    except TypeError:
        raise TypeError(f"copy_pairs: pair {i}: {role} is not a buffer "
                        f"({type(obj).__name__})") from None


def _numpy_copy(pairs: Sequence) -> None:
    """The extension's checks, then ``np.copyto`` per pair, byte for byte (views that neither
    cast nor broadcast)."""
    views = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"copy_pairs: item {i} is not a (dst, src) tuple")
        dst, src = _as_array(pair[0], i, "dst"), _as_array(pair[1], i, "src")
        if not dst.flags.writeable:
            raise ValueError(f"copy_pairs: pair {i}: dst is read-only")
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy_pairs: pair {i}: dst has {dst.nbytes} bytes, src {src.nbytes}")
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            views.append((dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)))
        elif dst.shape == src.shape and dst.itemsize == src.itemsize:
            item = np.dtype((np.void, dst.itemsize))
            views.append((dst.view(item), src.view(item)))
        else:
            raise ValueError(f"copy_pairs: pair {i} is not C-contiguous: dst {dst.shape} and src {src.shape} "
                             f"need one shape and one item size")
    for dst, src in views:
        np.copyto(dst, src, casting="no")

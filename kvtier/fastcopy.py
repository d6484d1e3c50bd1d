"""Copies of KV pages between an engine's cache and a tier: ``copy_pairs``.

Large pages are copied with non-temporal (streaming) stores by the optional C extension
``kvtier._ntcopy`` (built by ``pip install`` where a C compiler is found; see its source for
why), with the GIL released; without it, each pair is copied with ``np.copyto``. Either way the
result is the same bytes. ``STREAMING`` says which one this process uses.

Imports: numpy only.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

try:
    from kvtier import _ntcopy
except ImportError:  # no compiler at install time, or a platform it was not built for
    _ntcopy = None

STREAMING = bool(_ntcopy is not None and _ntcopy.STREAMING)


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], release_gil: bool = True,
               stream: bool = True) -> None:
    """``dst[:] = src[:]`` for each ``(dst, src)`` tuple of buffers (uint8 arrays) of equal byte
    length, copied byte for byte (never cast or broadcast). ``stream=False``: ordinary stores
    even for large pages, so the destination is left in the cache (a load the engine's forward
    pass reads next; see ``stays_cached``); numpy's copy always uses them.

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
        _ntcopy.copy_pairs(pairs, release_gil, stream)
    except BufferError:  # a non-contiguous view (numpy copies any layout), or a refused export
        _numpy_copy(pairs)


def stays_cached(nbytes: int, cache_bytes: int | None) -> bool:
    """Whether a copy of ``nbytes`` that is read again at once (a load into the engine's pages,
    which the forward pass reads next) should use ordinary stores: when it fits in three quarters
    of the last-level cache (``cache_bytes``; glibc's ``memcpy`` draws its own line between
    ordinary and streaming stores there too). Larger copies would only push the engine's working
    set out, and stream. Unknown cache size: stream (False)."""
    return cache_bytes is not None and 0 < nbytes <= cache_bytes * 3 // 4


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the highest cache level that CPU 0 reports (Linux sysfs), None where it is
    not reported or not readable."""
    best = (0, None)
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(root, name, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, name, "size")) as f:
                size = _size(f.read().strip())
        except (OSError, ValueError):
            continue
        if size and level > best[0]:
            best = (level, size)
    return best[1]


def _size(text: str) -> int | None:
    """sysfs's cache size (``32768K``, ``1M``, ``512``) in bytes; None if it is not one."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()] if text[:-1].isdigit() else None
    return int(text) if text.isdigit() else None


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

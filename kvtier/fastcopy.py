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
    """``dst[:] = src[:]`` for each ``(dst, src)`` tuple of uint8 arrays of equal length.

    Contract: the pairs go to the extension in one call (nothing is copied unless every pair is
    valid: a read-only or shorter ``dst`` raises before a byte moves); where a pair is not
    C-contiguous (the extension's ``BufferError``), or without the extension, every pair is
    copied with ``np.copyto`` (its errors).
    Pairs must not overlap. ``release_gil``: let other Python threads run during the copy (a
    background copy); False keeps the GIL (the engine's own thread, which would otherwise wait
    for another thread to hand it back after the copy)."""
    if _ntcopy is None:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    try:
        _ntcopy.copy_pairs(pairs, release_gil)
    except BufferError:  # a non-contiguous view: numpy copies any layout
        for dst, src in pairs:
            np.copyto(dst, src)

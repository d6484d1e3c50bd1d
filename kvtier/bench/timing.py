"""Timing helpers the micro-benchmarks share."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds (inf for none): the least
    disturbed pass on a shared, noisy machine."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best

"""Adaptive W-TinyLFU: the window's share of the capacity follows the trace (hill climbing).

The same structure as ``wtinylfu`` (window LRU, frequency-guarded segmented main area; sizes are
bytes, shares are shares of the capacity's bytes), but the window starts at 1% and a
:class:`~kvtier.policies._climber.HillClimber` moves it once per sample period by the request hit
rate it measured (``access`` is a hit, ``miss`` a miss). Sampling starts when the cache is first
full (the owner's first ``victim`` call): the hit rate of a cache still filling says nothing about
its window. A period lasts ``period_factor`` x the resident entries at its start (at least
``min_period`` requests), so a period sees each resident entry several times.

Resizing is immediate where it shrinks a segment (a smaller window spills its oldest entries to
probation; a smaller main area demotes protected entries to probation) and gradual where it
grows one: a larger window fills from the next inserts, as the main area's victims make room.
``window_history`` keeps the last ``HISTORY`` (requests seen, share) pairs, one per period.
"""

from __future__ import annotations

from collections import deque

from kvtier.policies._climber import HillClimber
from kvtier.policies.base import Key
from kvtier.policies.wtinylfu import WTinyLFUPolicy


class AdaptiveWTinyLFUPolicy(WTinyLFUPolicy):
    """W-TinyLFU whose window share is tuned by hill climbing on the hit rate."""

    HISTORY = 1024

    def __init__(self, capacity_hint: int | None = None, window: float = 0.01, protected: float = 0.8,
                 step: float = -0.0625, max_window: float = 0.8, period_factor: int = 10,
                 min_period: int = 4096):
        super().__init__(capacity_hint=capacity_hint, window=window, protected=protected)
        self._climber = HillClimber(share=window, step=step, max_share=max(window, max_window))
        self._period_factor = max(1, int(period_factor))
        self._min_period = max(1, int(min_period))
        self._sampling = False
        self._period = 0
        self._hits = 0
        self._requests = 0
        self._seen = 0
        self.window_history: deque[tuple[int, float]] = deque(maxlen=self.HISTORY)

    # -- sampling -------------------------------------------------------------------------
    def _record(self, hit: bool) -> None:
        """Count one request of the current period; at its end, climb and resize."""
        self._seen += 1
        if not self._sampling:
            return
        self._requests += 1
        self._hits += hit
        if self._requests < self._period:
            return
        share = self._climber.climb(self._hits / self._requests, self._requests)
        self._hits = self._requests = 0
        self._period = self._period_length()
        if share != self._window_share:
            self._window_share = share
            self._resize()
        self.window_history.append((self._seen, share))

    def _period_length(self) -> int:
        return max(self._min_period, self._period_factor * len(self))

    def _resize(self) -> None:
        """Apply a new window share: shrink whichever segment is now over its limit."""
        self._spill_window()
        self._demote_protected()

    @property
    def window_share(self) -> float:
        """The window's current share of the capacity."""
        return self._window_share

    # -- protocol -------------------------------------------------------------------------
    def miss(self, key: Key) -> None:
        super().miss(key)
        self._record(False)

    def access(self, key: Key) -> None:
        super().access(key)
        self._record(True)

    def victim(self) -> Key | None:
        if not self._sampling:  # the owner asks for a victim only when full: warm-up is over
            self._sampling = True
            self._period = self._period_length()
            self.window_history.append((self._seen, self._window_share))
        return super().victim()

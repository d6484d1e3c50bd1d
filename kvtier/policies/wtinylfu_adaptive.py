"""Adaptive W-TinyLFU: the window's share of the capacity follows the trace.

The same structure as ``wtinylfu`` (window LRU, frequency-guarded segmented main area; sizes are
bytes, shares are shares of the capacity's bytes), but the window starts at 1% and, once per
sample period, takes the share that did best in miniature simulations of the same requests
(:class:`~kvtier.policies._minisim.MiniSims`: sampled W-TinyLFU caches, one per candidate
share). With a ``capacity_hint`` they are built at the first insert (the entries the cache will
hold estimated as the capacity over that entry's size) and warm up while the cache fills; they
are rebuilt when the cache is first full (the owner's first ``victim`` call) if it then holds
over twice as many or under half as many, and built then without a hint. A period lasts
``period_factor`` x the resident entries at its start (at least ``min_period`` requests), so a
period sees each resident entry several times.

A request reaches the miniatures with its entry's size when the policy holds it (a hit) and the
mean resident size otherwise (a miss: the size comes with the ``insert`` that may follow); the
sizes are looked up only while there are miniatures.
Removals are not replayed: the policy cannot tell an eviction from a delete, and the miniatures
evict by themselves.

Resizing is immediate where it shrinks a segment (a smaller window spills its oldest entries to
probation; a smaller main area demotes protected entries to probation) and gradual where it
grows one: a larger window fills from the next inserts, as the main area's victims make room.
``window_history`` keeps the last ``HISTORY`` (requests seen, share) pairs, one per period.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from kvtier.policies._minisim import SHARES, WARMUP_PERIODS, MiniSims, check_shares, min_entries
from kvtier.policies.base import Key
from kvtier.policies.wtinylfu import WTinyLFUPolicy


class AdaptiveWTinyLFUPolicy(WTinyLFUPolicy):
    """W-TinyLFU whose window share is chosen by miniature simulations of its own requests."""

    HISTORY = 1024

    def __init__(self, capacity_hint: int | None = None, window: float = 0.01, protected: float = 0.8,
                 shares: Sequence[float] = SHARES, period_factor: int = 10, min_period: int = 4096):
        super().__init__(capacity_hint=capacity_hint, window=window, protected=protected)
        self._candidates = check_shares(shares)
        self._sims: MiniSims | None = None  # at the first insert with a hint, else when first full
        self._period_factor = max(1, int(period_factor))
        self._min_period = max(1, int(min_period))
        self._full = False  # periods count from the first victim
        self._period = 0
        self._requests = 0
        self._seen = 0
        self.window_history: deque[tuple[int, float]] = deque(maxlen=self.HISTORY)

    # -- sampling -------------------------------------------------------------------------
    def _record(self, key: Key) -> None:
        """Count one request (and replay it in the miniatures, after the policy has seen it); at
        a period's end, take their choice of share and resize."""
        self._seen += 1
        sims = self._sims
        if sims is None:
            return
        sims.request(key, self._size_of(key))
        if not self._full:
            return
        self._requests += 1
        if self._requests < self._period:
            return
        share = sims.choose(self._window_share)
        self._requests = 0
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

    def _miniatures(self, capacity: int, entries: int, warmup: int = WARMUP_PERIODS) -> MiniSims | None:
        """Miniatures for a cache of ``capacity`` bytes holding ``entries``; None (the window
        stays) for a cache too small to be worth them (``min_entries``)."""
        if capacity < 1 or entries < min_entries(len(self._candidates)):
            return None
        return MiniSims(capacity, entries, self._candidates, warmup=warmup)

    def _size_of(self, key: Key) -> int:
        """A resident key's size, else the mean resident size (at least 1)."""
        for segment in (self._window, self._probation, self._protected):
            size = segment.get(key)
            if size is not None:
                return size
        return max(1, self._used() // max(1, len(self)))

    @property
    def window_share(self) -> float:
        """The window's current share of the capacity."""
        return self._window_share

    @property
    def sample_rate(self) -> int | None:
        """1 in how many keys the miniatures see (None without them: before the first insert,
        or a cache too small for them)."""
        return None if self._sims is None else self._sims.rate

    # -- protocol -------------------------------------------------------------------------
    def miss(self, key: Key) -> None:
        super().miss(key)
        self._record(key)

    def access(self, key: Key) -> None:
        super().access(key)
        self._record(key)

    def insert(self, key: Key, size: int) -> None:
        super().insert(key, size)
        if self._sims is None and not self._full and self._hint:
            # a known capacity: the miniatures warm up while the cache fills
            self._sims = self._miniatures(self._hint, self._hint // max(1, size), warmup=0)

    def victim(self) -> Key | None:
        if not self._full:
            # built now without a capacity hint, or rebuilt when the first entry's size or the hint
            # misjudged the full cache by over 2 x (in entries: a sample too sparse or too costly;
            # in bytes: a hint that is not the real budget): from what the full cache holds
            used, sims = max(1, self._used()), self._sims
            if len(self) and (sims is None or not (len(self) / 2 <= sims.entries <= 2 * len(self)
                                                   and used / 2 <= sims.capacity <= 2 * used)):
                self._sims = self._miniatures(used, len(self))
            self._full = True  # periods start now: the hit rate of a cache still filling says nothing
            self._period = self._period_length()
            self.window_history.append((self._seen, self._window_share))
        return super().victim()

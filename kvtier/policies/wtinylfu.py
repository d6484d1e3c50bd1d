"""W-TinyLFU: a small LRU window in front of a segmented-LRU main area guarded by frequency.

A new key enters the window (1% of capacity). When the cache is full, the key leaving the
window (the *candidate*) competes with the main area's victim: the one with the higher
estimated frequency (count-min sketch, halved periodically) stays. Ties keep the incumbent,
which is what makes it scan- and loop-resistant: on a cycle larger than the cache the main
area holds a fixed subset and hits on it every pass instead of thrashing (LRU's cliff).
Sizes are bytes; the capacity comes from ``capacity_hint`` or, without one, the peak resident
bytes seen (the owner only asks for victims when full).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies._sketch import FrequencySketch
from kvtier.policies.base import EvictionPolicy, Key


class WTinyLFUPolicy(EvictionPolicy):
    """Window LRU + frequency-admitted segmented LRU (probation, protected)."""

    def __init__(self, capacity_hint: int | None = None, window: float = 0.01,
                 protected: float = 0.8):
        self._hint = capacity_hint
        self._window_share = window
        self._protected_share = protected
        self._window: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self._probation: OrderedDict[Key, int] = OrderedDict()
        self._protected: OrderedDict[Key, int] = OrderedDict()
        self._bytes = {"window": 0, "probation": 0, "protected": 0}
        self._peak = 0
        self._sketch = FrequencySketch()

    # -- sizing ---------------------------------------------------------------------------
    def _capacity(self) -> int:
        return self._hint or self._peak

    def _used(self) -> int:
        b = self._bytes
        return b["window"] + b["probation"] + b["protected"]

    # -- protocol -------------------------------------------------------------------------
    def miss(self, key: Key) -> None:
        self._sketch.increment(key)

    def insert(self, key: Key, size: int) -> None:
        self.remove(key)
        self._window[key] = size
        self._bytes["window"] += size
        self._peak = max(self._peak, self._used())
        self._sketch.ensure_width(len(self))
        self._spill_window()

    def _spill_window(self) -> None:
        """Move the window's overflow (oldest first) to probation: it already won (or needed
        no) contest. The window keeps at least one entry."""
        limit = max(1, int(self._capacity() * self._window_share))
        while self._bytes["window"] > limit and len(self._window) > 1:
            old, old_size = self._window.popitem(last=False)
            self._bytes["window"] -= old_size
            self._probation[old] = old_size
            self._bytes["probation"] += old_size

    def access(self, key: Key) -> None:
        self._sketch.increment(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            size = self._probation.pop(key)
            self._bytes["probation"] -= size
            self._protected[key] = size
            self._bytes["protected"] += size
            self._demote_protected()
        elif key in self._protected:
            self._protected.move_to_end(key)

    def _demote_protected(self) -> None:
        main = self._capacity() - int(self._capacity() * self._window_share)
        limit = max(1, int(main * self._protected_share))
        while self._bytes["protected"] > limit and len(self._protected) > 1:
            old, size = self._protected.popitem(last=False)
            self._bytes["protected"] -= size
            self._probation[old] = size
            self._bytes["probation"] += size

    def remove(self, key: Key) -> None:
        for name in ("window", "probation", "protected"):
            size = getattr(self, "_" + name).pop(key, None)
            if size is not None:
                self._bytes[name] -= size
                return

    def victim(self) -> Key | None:
        """The main victim if the window's candidate is more popular, else the candidate."""
        main = self._probation or self._protected
        candidate = next(iter(self._window), None)
        if not main:
            return candidate
        incumbent = next(iter(main))
        limit = max(1, int(self._capacity() * self._window_share))
        if candidate is None or self._bytes["window"] + self._window[candidate] <= limit:
            return incumbent  # the window has room for one more entry of this size
        # Otherwise the next insert overflows the window: the candidate must win its place.
        freq = self._sketch.frequency
        return incumbent if freq(candidate) > freq(incumbent) else candidate

    def __contains__(self, key: Key) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

"""S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, and a ghost FIFO.

New keys enter the small queue (10% of capacity). A key leaving it that was not read since it
arrived is evicted and remembered in the ghost queue; one that was read moves to main. A key
found in the ghost queue on insert goes straight to main. Main evicts FIFO but gives keys read
since their last pass another round (2-bit counter), a CLOCK-like second chance. One-hit
wonders and scans are flushed from the small queue without touching main.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import EvictionPolicy, Key


class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO + main FIFO with reinsertion + ghost history (all in bytes)."""

    def __init__(self, capacity_hint: int | None = None, small: float = 0.1):
        self._hint = capacity_hint
        self._small_share = small
        self._small: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, int] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0
        self._peak = 0

    def _capacity(self) -> int:
        return self._hint or self._peak

    def insert(self, key: Key, size: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size
        self._peak = max(self._peak, self._small_bytes + self._main_bytes)

    def access(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(3, self._freq[key] + 1)

    def remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
            self._remember(key, size)  # left the small queue: history for a quick return
        else:
            self._main_bytes -= self._main.pop(key)

    def _remember(self, key: Key, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        limit = max(1, self._capacity() - int(self._capacity() * self._small_share))
        while self._ghost_bytes > limit and len(self._ghost) > 1:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def victim(self) -> Key | None:
        """Promote read keys out of the way (no residency change) until a cold head remains."""
        small_limit = max(1, int(self._capacity() * self._small_share))
        while self._small and (self._small_bytes >= small_limit or not self._main):
            key = next(iter(self._small))
            if self._freq[key] == 0:
                return key
            size = self._small.pop(key)
            self._small_bytes -= size
            self._freq[key] = 0
            self._main[key] = size
            self._main_bytes += size
        while self._main:  # ends: every pass lowers a counter, at most 3 rounds
            key = next(iter(self._main))
            if self._freq[key] == 0:
                return key
            self._freq[key] -= 1
            self._main.move_to_end(key)
        return next(iter(self._small), None)

    def __contains__(self, key: Key) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

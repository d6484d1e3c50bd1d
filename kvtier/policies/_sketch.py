"""A count-min sketch of 4-bit counters with periodic halving (TinyLFU's frequency estimate)."""

from __future__ import annotations

from typing import Hashable

_M64 = (1 << 64) - 1
_HALVE = bytes(i >> 1 for i in range(256))  # translate table: every counter halved at once


def _mix(h: int) -> int:
    """A 64-bit finaliser (splitmix64) so that small integer keys spread over the table."""
    h = (h + 0x9E3779B97F4A7C15) & _M64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


class FrequencySketch:
    """Approximate access counts of recently seen keys, saturating at 15.

    After ``10 x width`` increments every counter is halved, so old popularity fades and the
    sketch follows a shifting workload. Estimates never under-count (between halvings).
    """

    DEPTH = 4
    MAX = 15

    def __init__(self, width: int = 64):
        self.width = 1 << max(4, (width - 1).bit_length())
        self._mask = self.width - 1
        self._table = bytearray(self.DEPTH * self.width)
        self._additions = 0
        self._sample = 10 * self.width

    def ensure_width(self, entries: int) -> None:
        """Grow (and clear) the table when the cache holds more keys than it has columns."""
        if entries > self.width:
            self.__init__(entries * 2)

    def _slots(self, key: Hashable) -> list[int]:
        h = _mix(hash(key) & _M64)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1  # double hashing: row i uses h1 + i*h2
        mask, width = self._mask, self.width
        return [i * width + ((h1 + i * h2) & mask) for i in range(self.DEPTH)]

    def frequency(self, key: Hashable) -> int:
        """Estimated count of ``key`` (0..15)."""
        table = self._table
        return min(table[s] for s in self._slots(key))

    def increment(self, key: Hashable) -> None:
        """Count one access of ``key``; halve every counter once per sample period."""
        table = self._table
        for s in self._slots(key):
            if table[s] < self.MAX:
                table[s] += 1
        self._additions += 1
        if self._additions >= self._sample:
            self._table = self._table.translate(_HALVE)
            self._additions //= 2

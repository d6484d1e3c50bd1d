"""LRU: evict the least recently used key."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Least recently used first. Collapses to 0 hits on a cycle larger than the cache."""

    def __init__(self, capacity_hint: int | None = None):
        self._order: OrderedDict[Key, int] = OrderedDict()  # oldest first

    def insert(self, key: Key, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self) -> Key | None:
        return next(iter(self._order), None)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

"""LRU: evict the least recently used key."""

from __future__ import annotations

from kvtier.policies.base import Key
from kvtier.policies.fifo import FIFOPolicy


class LRUPolicy(FIFOPolicy):
    """Least recently used first: FIFO's order, with a hit moving the key to the young end.

    Collapses to 0 hits on a cycle larger than the cache.
    """

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

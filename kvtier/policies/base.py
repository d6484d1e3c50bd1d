"""The eviction policy protocol: bookkeeping of which resident keys to evict first.

A policy does no I/O and holds no data. Its owner (the store, or the simulator) keeps the byte
count, calls ``victim`` until the new entry fits, and tells the policy what actually happened
through ``insert``/``access``/``remove``. Not thread-safe: the owner serialises calls.

Call sequence for one request of ``key`` (``size`` bytes)::

    if key in policy:            policy.access(key)                   # hit
    else:                        policy.miss(key)                     # miss (history, frequency)
                                 if policy.admit(key, size):
                                     while used + size > capacity:
                                         v = policy.victim(); ...; policy.remove(v)
                                     policy.insert(key, size)

``victim`` names the key it would evict next but does not forget it: the owner may evict
another key instead (the store evicts a chain's tail before its head) and calls ``remove``
for whichever key left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable

Key = Hashable


class EvictionPolicy(ABC):
    """Base class of every eviction policy."""

    @abstractmethod
    def insert(self, key: Key, size: int) -> None:
        """``key`` became resident (it was not)."""

    @abstractmethod
    def access(self, key: Key) -> None:
        """A resident ``key`` was read (a hit)."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """A resident ``key`` left (evicted or deleted); unknown keys are ignored."""

    @abstractmethod
    def victim(self) -> Key | None:
        """The resident key to evict next, or None when nothing is resident. Stays resident."""

    @abstractmethod
    def __contains__(self, key: Key) -> bool:
        """Whether ``key`` is resident."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    def miss(self, key: Key) -> None:
        """A non-resident ``key`` was requested (policies with history or frequency use it)."""

    def admit(self, key: Key, size: int) -> bool:
        """Whether a missed ``key`` is worth storing at all (default: always)."""
        return True


class Owner:
    """The owner loop above over a ``capacity``-sized cache (bytes, or entries of size 1): what the
    simulator replays a trace through, and each of the adaptive W-TinyLFU's miniatures."""

    __slots__ = ("policy", "capacity", "used", "sizes")

    def __init__(self, policy: EvictionPolicy, capacity: int):
        self.policy = policy
        self.capacity = capacity
        self.used = 0
        self.sizes: dict[Key, int] = {}

    def request(self, key: Key, size: int) -> bool:
        """One request of ``key`` (``size`` bytes); whether it hit. A miss stores the key when
        the policy admits it and it fits at all, evicting the policy's victims first."""
        policy = self.policy
        if key in policy:
            policy.access(key)
            return True
        policy.miss(key)
        if size > self.capacity or not policy.admit(key, size):
            return False
        while self.used + size > self.capacity:
            out = policy.victim()
            if out is None:
                break
            policy.remove(out)
            self.used -= self.sizes.pop(out)
        policy.insert(key, size)
        self.sizes[key] = size
        self.used += size
        return False

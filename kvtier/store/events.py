"""Store events: a typed record of chunks entering and leaving a store's tiers.

Imports: ``kvtier.keys`` only.
"""

from __future__ import annotations

from collections import deque
from typing import Literal, NamedTuple

from kvtier.keys import Key

EventKind = Literal["stored", "removed"]


class StoreEvent(NamedTuple):
    """A chunk ``key`` was stored in or removed from a tier of ``medium`` (CPU, DISK, REDIS,
    S3, FS: what vLLM's KV events call the medium). A tuple, so it unpacks as
    ``kind, key, medium`` and crosses process boundaries as plain data."""

    kind: EventKind
    key: Key
    medium: str


class EventLog:
    """A bounded record of events, off until ``enable`` (then the oldest unread are dropped
    past ``maxlen``). Not thread-safe: its owner serialises calls (the store's lock)."""

    def __init__(self) -> None:
        self._events: deque[StoreEvent] | None = None

    @property
    def enabled(self) -> bool:
        return self._events is not None

    def enable(self, maxlen: int = 100_000) -> None:
        """Start recording (no effect when already recording)."""
        if self._events is None:
            self._events = deque(maxlen=maxlen)

    def record(self, kind: EventKind, key: Key, medium: str) -> None:
        """Append one event (nothing while disabled)."""
        if self._events is not None:
            self._events.append(StoreEvent(kind, key, medium))

    def take(self) -> list[StoreEvent]:
        """The events recorded since the last call, oldest first."""
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

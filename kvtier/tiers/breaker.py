"""A small circuit breaker shared by the network tiers (redis, s3).

After a connection-level fault the breaker opens for a window (``base_s``, doubling while faults
persist, up to ``max_s``); calls made while it is open are skipped, so a dead server costs one
failed call per window instead of a timeout per call. The first call after the window tries
the server again (and so reconnects once it is back).
"""

from __future__ import annotations

import threading
import time


class CircuitBreaker:
    """Skips calls for a growing window after faults. Thread-safe."""

    def __init__(self, base_s: float, max_s: float):
        self._base, self._max = base_s, max(base_s, max_s)
        self._window = 0.0
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may try the server now."""
        return time.monotonic() >= self._open_until

    def failure(self) -> None:
        """Record a fault: open (or widen) the window."""
        with self._lock:
            self._window = min(self._max, self._window * 2 if self._window else self._base)
            self._open_until = time.monotonic() + self._window

    def success(self) -> None:
        """Record a success: close the breaker."""
        if self._window:
            with self._lock:
                self._window = 0.0
                self._open_until = 0.0

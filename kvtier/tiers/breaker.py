"""A small circuit breaker shared by the network tiers (redis, s3).

States: *closed* (every call goes to the server), *open* (calls are skipped, counted by the
caller as errors) and *half-open* (the window has passed; exactly one call, the probe, goes to
the server while every other caller still fails fast).

After a connection-level fault the breaker opens for a window (``base_s``, doubling while faults
persist, up to ``max_s``). When the window ends, ``allow`` admits one probe; its ``success``
closes the breaker, its ``failure`` opens the next (wider) window. So a dead or hung server costs
one failed call per window, not one per caller: concurrent callers never all retry at once. A
probe that never reports (its caller died) is given up after ``probe_timeout_s`` and another one
is admitted.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class CircuitBreaker:
    """Skips calls for a growing window after faults; one probe at a time when half-open.

    Contract: a caller that got True from ``allow`` must report the outcome with ``success``,
    ``failure`` or ``abandon`` (a call that reached the server and got any answer, even an error
    reply, is a success). Thread-safe. ``clock``: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, base_s: float, max_s: float, probe_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._base, self._max = base_s, max(base_s, max_s)
        self._probe_timeout = probe_timeout_s
        self._window = 0.0  # 0: closed
        self._open_until = 0.0
        self._probe_since: float | None = None  # monotonic start of the probe in flight
        self._lock = threading.Lock()
        self.probes = 0  # probes admitted so far (for tests and metrics)

    @property
    def state(self) -> str:
        """``closed``, ``open`` (within the window) or ``half-open`` (past it)."""
        with self._lock:
            if not self._window:
                return "closed"
            return "open" if self._clock() < self._open_until else "half-open"

    def allow(self) -> bool:
        """Whether a call may try the server now: always when closed, never within the window,
        and only for the one admitted probe after it."""
        if not self._window:  # closed: the common case, no lock
            return True
        now = self._clock()
        with self._lock:
            if not self._window:
                return True
            if now < self._open_until:
                return False
            if self._probe_since is not None and now - self._probe_since < self._probe_timeout:
                return False  # a probe is in flight: everyone else fails fast
            self._probe_since = now
            self.probes += 1
            return True

    def failure(self) -> None:
        """Record a fault: open (or widen) the window; a probe in flight is over."""
        with self._lock:
            self._window = min(self._max, self._window * 2 if self._window else self._base)
            self._open_until = self._clock() + self._window
            self._probe_since = None

    def abandon(self) -> None:
        """The admitted call ended with neither an answer nor a fault (the caller's own error
        before it reached the server): the next caller may probe."""
        if self._window:
            with self._lock:
                self._probe_since = None

    def success(self) -> None:
        """Record a success: close the breaker."""
        if self._window:
            with self._lock:
                self._window = 0.0
                self._open_until = 0.0
                self._probe_since = None

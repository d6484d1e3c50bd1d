"""The circuit breaker: closed, open for a growing window, and ONE probe at a time when half-open.

Time is a clock the tests move by hand: with real sleeps of tens of milliseconds a loaded machine
(the race check runs the suite beside a CPU hog) overshot a window while 16 threads started.
"""

from __future__ import annotations

import threading

from kvtier.tiers.breaker import CircuitBreaker


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _allow_concurrently(breaker: CircuitBreaker, callers: int) -> int:
    """How many of ``callers`` threads, released at once, are let through."""
    barrier = threading.Barrier(callers)
    admitted: list[bool] = []
    lock = threading.Lock()

    def call():
        barrier.wait()
        ok = breaker.allow()
        with lock:
            admitted.append(ok)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(admitted)


def test_closed_breaker_lets_everyone_through():
    clock = Clock()
    breaker = CircuitBreaker(0.05, 0.2, clock=clock)
    assert breaker.state == "closed" and _allow_concurrently(breaker, 16) == 16


def test_open_window_skips_then_half_open_admits_one_probe_at_a_time():
    clock = Clock()
    breaker = CircuitBreaker(0.05, 0.2, clock=clock)
    breaker.failure()
    assert breaker.state == "open" and _allow_concurrently(breaker, 16) == 0
    clock.sleep(0.06)
    assert breaker.state == "half-open"
    assert _allow_concurrently(breaker, 16) == 1  # the probe; the other 15 fail fast
    assert _allow_concurrently(breaker, 16) == 0  # still in flight: nobody else
    assert breaker.probes == 1
    breaker.success()  # the probe got an answer: closed again
    assert breaker.state == "closed" and _allow_concurrently(breaker, 16) == 16


def test_failed_probe_doubles_the_window_up_to_the_max():
    clock = Clock()
    breaker = CircuitBreaker(0.05, 0.12, clock=clock)
    breaker.failure()
    clock.sleep(0.06)
    assert breaker.allow()
    breaker.failure()  # the probe failed: window 0.1 s
    clock.sleep(0.06)
    assert not breaker.allow()  # still inside the wider window
    clock.sleep(0.05)
    assert _allow_concurrently(breaker, 8) == 1
    breaker.failure()  # window capped at 0.12 s
    clock.sleep(0.13)
    assert _allow_concurrently(breaker, 8) == 1 and breaker.probes == 3


def test_a_probe_that_never_reports_is_replaced_after_its_timeout():
    clock = Clock()
    breaker = CircuitBreaker(0.02, 0.02, probe_timeout_s=0.1, clock=clock)
    breaker.failure()
    clock.sleep(0.03)
    assert breaker.allow()  # this probe's caller vanishes without reporting
    assert not breaker.allow()
    clock.sleep(0.11)
    assert breaker.allow() and breaker.probes == 2

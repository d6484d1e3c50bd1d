"""Where kvtier's background threads run: every core the process's threads run on together.

An engine may bind each of its compute threads to one core: vLLM's CPU worker binds its OpenMP
team one thread per core (``VLLM_CPU_OMP_THREADS_BIND``), its main thread included, before the
KV connector is built. A thread started from that main thread inherits its single core, so
kvtier's writers, encoders, load and copy threads would all share the engine thread's core
while the others are never offered to them. ``spread_thread`` widens the calling thread's
affinity to the union of every thread's in the process (the cores the engine was given), and
the OS places it where there is room. Linux only; elsewhere nothing changes.

Imports: stdlib only.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def process_cores() -> set[int] | None:
    """The union of the CPU affinity of every thread of this process; None where the platform
    has no per-thread affinity (or /proc cannot be read). Threads that end while they are
    listed are skipped."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return None
    cores: set[int] = set()
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return cores or None


def spread_thread() -> bool:
    """Let the calling thread run on every core of ``process_cores`` (best effort, never
    raises). True when its affinity is now that set. Call it first thing in a background
    thread; never on an engine's own thread."""
    cores = process_cores()
    if not cores:
        return False
    try:
        if os.sched_getaffinity(0) != cores:
            os.sched_setaffinity(0, cores)  # pid 0: the calling thread only
        return True
    except OSError as exc:
        log.debug("kvtier: thread %s keeps its CPU affinity (%s)", threading.current_thread().name, exc)
        return False

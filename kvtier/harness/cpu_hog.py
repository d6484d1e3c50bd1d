"""Run a command while every core is kept busy: the race check for the test suite.

    python -m kvtier.harness.cpu_hog [--procs N] -- COMMAND [ARGS...]

starts N busy-loop processes (default: one per core this process may run on), runs COMMAND,
stops the loops and exits with COMMAND's exit code. COMMAND's engines get one OpenMP thread per
rank (``KVTIER_ENGINE_THREADS=1`` unless set; ``kvtier.harness.cpus`` says why). The loops are
started through ``kvtier.harness.procs``, so they end with this process even when it is
SIGKILLed. Readiness waits, deadlines and ports that only work on an idle machine fail under this
load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from kvtier.harness.cpus import THREADS_ENV
from kvtier.harness.procs import Child, spawn

__all__ = ["start_hogs", "main"]

_LOOP = "while True: pass"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def start_hogs(n: int) -> list[Child]:
    """``n`` busy-loop child processes (stop each with ``Child.stop``)."""
    return [spawn([sys.executable, "-c", _LOOP], name=f"cpu hog {i}") for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    """The command line above: COMMAND's exit code; the loops are stopped however it ends."""
    parser = argparse.ArgumentParser(prog="python -m kvtier.harness.cpu_hog", description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=_cores(), help="busy loops to run (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.procs < 0:
        parser.error("give a command after --, and --procs >= 0")
    hogs = start_hogs(args.procs)
    try:
        return subprocess.call(command, env={**os.environ, THREADS_ENV: os.environ.get(THREADS_ENV) or "1"})
    finally:
        for hog in hogs:
            hog.stop(grace=1.0)


if __name__ == "__main__":
    sys.exit(main())

"""The CPU threads of the vLLM CPU engines that the benchmarks and tests start.

``engine_cpu_env(tp)`` is the environment (``VLLM_CPU_OMP_THREADS_BIND``, ``OMP_NUM_THREADS``)
of an engine of ``tp`` ranks: each rank bound to its own contiguous share of the cores this
process may run on, all of them by default. ``KVTIER_ENGINE_THREADS=N`` caps each rank at N
threads (on the first cores). ``python -m kvtier.harness.cpu_hog`` sets it to 1 for the command
it runs (``make test-loaded``): beside a busy loop on every core an engine's OpenMP threads wait
at every barrier for the thread a busy loop keeps off its core, and small matmuls ran about 2 x
slower on two threads than on one on this project's 2-core VM under that load (quiet, two
threads are the faster).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["THREADS_ENV", "engine_cpu_env"]

THREADS_ENV = "KVTIER_ENGINE_THREADS"


def _cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _span(cores: list[int]) -> str:
    """``0-3`` for consecutive cores, else ``0,2,5``."""
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def engine_cpu_env(tp: int = 1, environ: Mapping[str, str] | None = None,
                   cores: list[int] | None = None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` (ranks separated by ``|``) and ``OMP_NUM_THREADS`` (threads
    per rank) for an engine of ``tp`` ranks on ``cores`` (default: the cores this process may run
    on), each rank a contiguous share, capped by ``KVTIER_ENGINE_THREADS`` in ``environ``
    (default ``os.environ``). ValueError when there are fewer cores than ranks, or the cap is not
    a positive integer."""
    environ = os.environ if environ is None else environ
    cores = _cores() if cores is None else sorted(set(cores))
    if tp < 1 or len(cores) < tp:
        raise ValueError(f"an engine of {tp} ranks needs at least {tp} cores; {len(cores)} are available")
    per_rank = len(cores) // tp
    cap = environ.get(THREADS_ENV)
    if cap:
        if not re.fullmatch(r"[1-9][0-9]*", cap):
            raise ValueError(f"{THREADS_ENV}={cap!r}: give a positive number of threads per engine rank")
        per_rank = min(per_rank, int(cap))
    ranks = [cores[r * per_rank:(r + 1) * per_rank] for r in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(_span(r) for r in ranks), "OMP_NUM_THREADS": str(per_rank)}

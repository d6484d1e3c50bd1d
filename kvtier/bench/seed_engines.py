"""Engines for ``kvtier bench seed``: start a group of settings' engines, ask them in turn.

Reuses the demo's machinery (``kvtier.bench.offload``): each setting's engine runs in its own
process (``kvtier.bench.seed_engine``) started through ``kvtier.harness.procs.spawn`` with the same
``VLLM_CPU_OMP_THREADS_BIND``/``OMP_NUM_THREADS`` for every setting (``offload._engine_env``),
several alive at once so their passes can be interleaved, and each engine's turn starts after a
quiet period (vLLM's worker busy-polls for ~1 s after its last step).
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvtier.bench import offload

CONNECTOR = offload.CONNECTOR
BLOCK_TOKENS = 128  # vLLM's block size on CPU


@dataclass(frozen=True)
class EngineSpec:
    """One setting's engine: a name, its connector config (None: vLLM alone), its pool."""

    name: str
    kv_transfer_config: dict | None
    pool_tokens: int
    max_model_len: int


def kvtier_config(tiers: list[dict], chunk_tokens: int | None = None) -> dict:
    """vLLM's ``kv_transfer_config`` for kvtier's connector with ``tiers`` (fastest first)."""
    extra: dict = {"tiers": tiers}
    if chunk_tokens:
        extra["chunk_tokens"] = chunk_tokens
    return {**CONNECTOR, "kv_connector_extra_config": extra}


class SeedEngine(offload._Engine):
    """``offload._Engine`` running ``kvtier.bench.seed_engine`` instead of ``engine_run``.

    (A wrapper in this module rather than a change to offload.py: the spawn is the same call,
    only the module differs.) ``ask`` sends one command after ``settle_s`` of quiet and returns
    the answer; errors name the setting and the tail of its log.
    """

    def __init__(self, name: str, env: dict, spec_path: Path, work: Path):
        from kvtier.harness.procs import spawn

        self.name = name
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "w")
        self._child = spawn([sys.executable, "-m", "kvtier.bench.seed_engine", str(spec_path)],
                            name=f"engine {name}", env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._lines = queue.SimpleQueue()
        threading.Thread(target=self._pump, name=f"engine-{name}-stdout", daemon=True).start()

    def prompt(self, tokens: list[int], settle_s: float = 0.0) -> dict:
        """One request; its answer (``ttft_ms``, ``hit_tokens``, ``local_hit_tokens``, ...)."""
        return self.ask({"prompt": tokens}, settle_s)

    def reset(self) -> None:
        """Drop vLLM's own prefix cache (the connector's store keeps its entries)."""
        self.ask({"reset": True})

    def batch(self, prompts: list[list[int]], concurrency: int, max_tokens: int, settle_s: float = 0.0) -> dict:
        """A closed loop of ``concurrency`` requests in flight (see ``seed_engine._batch``)."""
        return self.ask({"batch": prompts, "concurrency": concurrency, "max_tokens": max_tokens}, settle_s)


def warmup_prompt() -> list[int]:
    """The first request of every engine (it pays one-off costs); never measured."""
    import numpy as np

    return np.random.default_rng(7).integers(100, 31000, 600).tolist()


@contextlib.contextmanager
def engines(specs: list[EngineSpec], model: str, work: Path,
            gpu_memory_utilization: float = 0.3, enforce_eager: bool = False) -> Iterator[dict[str, SeedEngine]]:
    """Start one engine per spec (all alive at once), wait until each is ready, yield them by
    name, and stop them all on exit (also on errors: their processes die with this one)."""
    env = offload._engine_env()
    with contextlib.ExitStack() as stack:
        started: dict[str, SeedEngine] = {}
        for spec in specs:
            spec_path = work / f"{spec.name}.spec.json"
            spec_path.write_text(json.dumps({
                "model": model, "warmup": warmup_prompt(), "pool_blocks": spec.pool_tokens // BLOCK_TOKENS,
                "max_model_len": spec.max_model_len, "kv_transfer_config": spec.kv_transfer_config,
                "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager}))
            started[spec.name] = stack.enter_context(SeedEngine(spec.name, env, spec_path, work))
        for engine in started.values():
            engine.wait_ready()
        yield started

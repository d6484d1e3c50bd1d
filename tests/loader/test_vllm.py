"""vLLM loads the small random model through ``--load-format kvtier`` with the default loader's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = os.path.join(os.path.dirname(__file__), "_vllm_greedy.py")


def _tokens(model: str, load_format: str, extra: dict | None = None) -> list:
    cmd = [sys.executable, SCRIPT, model, load_format] + ([json.dumps(extra)] if extra else [])
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][7:])


def test_plugin_registers_load_format():
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    from kvtier.integrations.vllm.plugin import register

    register()
    register()  # idempotent
    assert _LOAD_FORMAT_TO_MODEL_LOADER["kvtier"].__name__ == "KVTierModelLoader"


def test_unknown_extra_config_key_is_rejected():
    from vllm.config.load import LoadConfig

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.loader import KVTierModelLoader

    with pytest.raises(ConfigError, match="valid keys"):
        KVTierModelLoader(LoadConfig(load_format="kvtier", model_loader_extra_config={"concurency": 4}))


def test_same_greedy_tokens_as_default_loader(qwen2_dir):
    default = _tokens(qwen2_dir, "auto")
    kvtier = _tokens(qwen2_dir, "kvtier", {"concurrency": 4, "block_size": "4MiB", "memory_limit": "64MiB"})
    assert kvtier == default and len(default) == 3 and all(len(t) == 12 for t in default)

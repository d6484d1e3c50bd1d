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


@pytest.mark.s3
def test_weights_from_s3_through_node_cache(qwen2_dir, s3_server, s3_bucket, tmp_path, monkeypatch):
    """Config files local, weights in S3 (vLLM refuses s3:// MODEL paths for plugin formats)."""
    import shutil

    client = s3_server.client()
    for name in os.listdir(qwen2_dir):
        client.upload_file(os.path.join(qwen2_dir, name), s3_bucket, f"qwen2/{name}")
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    shutil.copy(os.path.join(qwen2_dir, "config.json"), cfg_dir)
    for k, v in {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.access_key,
                 "AWS_SECRET_ACCESS_KEY": s3_server.secret_key, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    cache = str(tmp_path / "cache")
    got = _tokens(str(cfg_dir), "kvtier", {"weights_uri": f"s3://{s3_bucket}/qwen2/", "cache_dir": cache})
    assert got == _tokens(qwen2_dir, "auto")
    from kvtier.loader.cache import cache_path, is_complete

    assert is_complete(cache_path(cache, f"s3://{s3_bucket}/qwen2/"))

"""vLLM loads the small random model through ``--load-format kvtier`` with the default loader's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.harness.cpus import engine_cpu_env

pytestmark = pytest.mark.vllm

SCRIPT = os.path.join(os.path.dirname(__file__), "_vllm_greedy.py")


def _run(model: str, load_format: str, extra: dict | None = None, tp: int = 1) -> dict:
    """The engine's greedy tokens, and (one rank) the digest of its weights as loaded."""
    cmd = [sys.executable, SCRIPT, model, load_format, json.dumps(extra) if extra else "", str(tp)]
    env = {**os.environ, **engine_cpu_env(tp)}  # a share of the CPUs per rank
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = {}
    for tag in ("TOKENS", "DIGEST"):
        lines = [l for l in proc.stdout.splitlines() if l.startswith(tag + " ")]
        if lines:
            out[tag.lower()] = json.loads(lines[-1][len(tag) + 1:])
    assert proc.returncode == 0 and "tokens" in out, proc.stderr[-3000:]
    return out


def _tokens(model: str, load_format: str, extra: dict | None = None, tp: int = 1) -> list:
    return _run(model, load_format, extra, tp)["tokens"]


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


def test_same_weights_and_greedy_tokens_as_default_loader(qwen2_dir):
    """The weights vLLM holds are bit for bit the default loader's (the loader's contract), and so
    are the greedy tokens, unless a loaded machine made the engine itself differ between two runs
    of equal weights (its CPU kernels on random weights' near-ties): then the digest decides."""
    default = _run(qwen2_dir, "auto")
    kvtier = _run(qwen2_dir, "kvtier", {"concurrency": 4, "block_size": "4MiB", "memory_limit": "64MiB"})
    assert kvtier["digest"] == default["digest"] and len(default["digest"]) == 1
    assert len(default["tokens"]) == 3 and all(len(t) == 12 for t in default["tokens"])
    if kvtier["tokens"] != default["tokens"]:  # the same weights: the engine's run-to-run noise
        again = _run(qwen2_dir, "auto")
        assert again["digest"] == default["digest"]
        assert kvtier["tokens"] in (default["tokens"], again["tokens"]) or again["tokens"] != default["tokens"]


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


@pytest.fixture(scope="module")
def tp2(qwen2_dir, tmp_path_factory) -> dict:
    """The test model cut by `kvtier shard --tp 2`, its manifest, and a TP=2 engine's reference tokens."""
    out = tmp_path_factory.mktemp("shard") / "tp2"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "shard", qwen2_dir, "--tp", "2", "--out", str(out),
                           "--json", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dir": out, "manifest": json.loads(proc.stdout), "reference": _tokens(qwen2_dir, "auto", tp=2)}


def test_shard_tp2_each_rank_reads_its_own_files(tp2):
    """`kvtier shard --tp 2` output loads in a TP=2 engine through kvtier and vLLM's sharded_state."""
    out, manifest = tp2["dir"], tp2["manifest"]
    assert manifest["files"] == ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert manifest["tensor_parallel_size"] == 2 and "config.json" in manifest["config_files"]
    assert (out / "kvtier-shard.json").exists() and not (out / "kvtier-shard.log").exists()
    mask = os.umask(0o022)
    os.umask(mask)
    for name in manifest["files"]:  # readable by whoever serves it, as the umask allows (not 0600)
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    from safetensors import safe_open

    with safe_open(str(out / manifest["files"][1]), "pt") as f:  # the engine's fused parameter names
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()
    assert _tokens(str(out), "kvtier", {"concurrency": 4}, tp=2) == tp2["reference"]
    assert _tokens(str(out), "sharded_state", tp=2) == tp2["reference"]


@pytest.mark.s3
def test_sharded_weights_streamed_from_s3(tp2, s3_server, s3_bucket, tmp_path, monkeypatch):
    """The pre-sharded layout found by listing an s3:// prefix; each rank streams its own objects."""
    import shutil

    client = s3_server.client()
    for name in tp2["manifest"]["files"]:
        client.upload_file(str(tp2["dir"] / name), s3_bucket, f"tp2/{name}")
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    shutil.copy(tp2["dir"] / "config.json", cfg_dir)
    for k, v in {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.access_key,
                 "AWS_SECRET_ACCESS_KEY": s3_server.secret_key, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    got = _tokens(str(cfg_dir), "kvtier", {"weights_uri": f"s3://{s3_bucket}/tp2/", "concurrency": 4}, tp=2)
    assert got == tp2["reference"]

"""A tiny random Qwen2 model directory and real vLLM configs over it, for scheduler-side connector
tests that need no engine (building a VllmConfig takes seconds, an engine a minute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHUNK = 32  # tokens per chunk in these tests (the block size is 16)


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """A 2-layer, 64-wide random Qwen2 saved as safetensors in ``out`` (about 300 KB)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, torch_dtype="bfloat16")
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def vllm_config(model: Path | str, extra: dict[str, Any] | None = None, pp: int = 1, **model_kw: Any):
    """A real VllmConfig for ``model`` with the kvtier connector (block size 16, chunk ``CHUNK``)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    extra = {"tiers": [{"type": "ram", "capacity": "16MiB"}], "chunk_tokens": CHUNK, **(extra or {})}
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=model_kw.pop("dtype", "bfloat16"),
                               max_model_len=1024, **model_kw)
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16),
                      parallel_config=ParallelConfig(pipeline_parallel_size=pp), kv_transfer_config=transfer)


def scheduler_connector(config):
    """The connector's scheduler side, as vLLM's scheduler builds it."""
    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

    return KVTierConnector(config, KVConnectorRole.SCHEDULER, None)

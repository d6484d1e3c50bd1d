"""Loader test helpers: safetensors files of every dtype and a small random Qwen2 model."""

from __future__ import annotations

import pytest


def make_qwen2(path, layers: int = 4) -> str:
    """Save a small random Qwen2 model (bf16 safetensors + config.json) under ``path``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="40MB")
    return str(path)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    """A sharded (index + several files) small random Qwen2 model directory."""
    return make_qwen2(tmp_path_factory.mktemp("qwen2"))

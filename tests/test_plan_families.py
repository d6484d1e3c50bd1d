"""`kvtier kv-size` for the families people serve (issue 26 item 6): sliding window, chunked local
attention, MLA, recurrent state (Mamba, Mamba2, gated delta net), multimodal `text_config`.

Each config uses the family's real config.json key names (transformers' configuration_*.py)
with other windows, ratios and ranks than the public checkpoints; every expected figure is
worked out by hand in a comment. Figures are per tensor-parallel rank.
"""

from __future__ import annotations

import json

import pytest

from kvtier import plan
from kvtier.cli import main
from kvtier.errors import ConfigError


def _kv_size(tmp_path, capsys, config: dict, tokens: int, *args: str) -> dict:
    """``kvtier kv-size DIR --tokens N ARGS --json`` on ``config`` written as DIR/config.json;
    checks that the API gives the same document and returns it."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["kv-size", str(folder), "--tokens", str(tokens), *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    opts = dict(zip(args[::2], args[1::2]))
    shape = plan.kv_shape(config, opts.get("--dtype"), where=str(folder), tp=int(opts.get("--tp", 1)),
                          ssm_dtype=opts.get("--mamba-ssm-cache-dtype"))
    assert plan.kv_size(shape, tokens) == out
    assert out["total_bytes"] == out["full_bytes_per_token"] * tokens + out["fixed_bytes_per_sequence"]
    assert out["total_bytes"] == sum(k["bytes"] for k in out["layer_kinds"])
    return out


def _kinds(out: dict) -> dict:
    return {k["kind"]: k for k in out["layer_kinds"]}


def _one_line(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


# -- dense GQA and TP -------------------------------------------------------------------------
QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
         "hidden_size": 768, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 6,
         "torch_dtype": "bfloat16"}


def test_dense_gqa_splits_kv_heads_across_tp_ranks(tmp_path, capsys):
    # head_dim 768 / 12 = 64; per token 2 (K, V) x 6 layers x 4 KV heads x 64 x 2 B = 6,144
    out = _kv_size(tmp_path, capsys, QWEN2, 1000)
    assert (out["bytes_per_token"], out["full_bytes_per_token"], out["total_bytes"]) == (6144, 6144, 6_144_000)
    assert out["fixed_bytes_per_sequence"] == 0 and out["note"] is None
    # tp 2: 2 KV heads per rank -> 3,072 B/token, 3,072,000 per rank, 6,144,000 on both ranks
    out = _kv_size(tmp_path, capsys, QWEN2, 1000, "--tp", "2")
    assert (out["total_bytes"], out["all_ranks_total_bytes"]) == (3_072_000, 6_144_000)
    # tp 8 > 4 KV heads: vLLM replicates, one head per rank: 2 x 6 x 1 x 64 x 2 = 1,536 B/token
    out = _kv_size(tmp_path, capsys, QWEN2, 1000, "--tp", "8")
    assert (out["bytes_per_token"], out["all_ranks_total_bytes"]) == (1536, 8 * 1_536_000)
    _one_line(capsys, ["kv-size", str(tmp_path / "model"), "--tp", "3"], "tp 3 does not fit 4 KV heads")


def test_qwen2_sliding_window_from_max_window_layers(tmp_path, capsys):
    # use_sliding_window on: layers >= max_window_layers 4 slide (2 of 6), window 256;
    # per layer 2 x 4 x 64 x 2 = 1,024 B/token; 1,000 tokens:
    # 4 full x 1,000 x 1,024 = 4,096,000 + 2 sliding x 256 x 1,024 = 524,288 -> 4,620,288
    config = dict(QWEN2, use_sliding_window=True, max_window_layers=4, sliding_window=256)
    out = _kv_size(tmp_path, capsys, config, 1000)
    assert (out["sliding_layers"], out["sliding_window"], out["total_bytes"]) == (2, 256, 4_620_288)
    # use_sliding_window absent: off by default for Qwen2 (as transformers): 6 x 1,000 x 1,024
    del config["use_sliding_window"]
    assert _kv_size(tmp_path, capsys, config, 1000)["total_bytes"] == 6_144_000


# -- sliding window -----------------------------------------------------------------------------
def test_gemma2_every_other_layer_slides(tmp_path, capsys):
    # no layer_types: Gemma 2 slides on layers 0, 2, 4 (3 of 6); per layer 2 x 4 x 128 x 2 = 2,048 B/token
    config = {"model_type": "gemma2", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 128, "hidden_size": 1024, "sliding_window": 2048, "torch_dtype": "bfloat16"}
    # 5,000 tokens: 3 full x 5,000 x 2,048 = 30,720,000 + 3 sliding x 2,048 x 2,048 = 12,582,912
    out = _kv_size(tmp_path, capsys, config, 5000)
    assert (out["full_bytes_per_token"], out["fixed_bytes_per_sequence"]) == (6144, 12_582_912)
    assert out["total_bytes"] == 43_302_912 and out["max_fixed_bytes_per_sequence"] == 12_582_912
    assert _kinds(out)["sliding_attention"]["tokens_held"] == 2048
    assert "min(tokens, 2,048)" in out["formula"] and "sliding window" in out["note"]
    # 1,000 tokens, inside the window: every layer holds them all: 6 x 1,000 x 2,048 = 12,288,000
    assert _kv_size(tmp_path, capsys, config, 1000)["total_bytes"] == 12_288_000


GEMMA3_TEXT = {"model_type": "gemma3_text", "num_hidden_layers": 8, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256, "sliding_window": 300}


def test_gemma3_multimodal_text_config_and_window_pattern(tmp_path, capsys):
    # sliding_window_pattern 4: layer i is global when (i + 1) % 4 == 0 -> layers 3, 7 full, 6 sliding;
    # per layer 2 x 2 x 64 x 2 = 512 B/token; 1,000 tokens:
    # 2 x 1,000 x 512 = 1,024,000 + 6 x 300 x 512 = 921,600 -> 1,945,600
    config = {"model_type": "gemma3", "torch_dtype": "bfloat16", "vision_config": {"num_hidden_layers": 27},
              "text_config": dict(GEMMA3_TEXT, sliding_window_pattern=4)}
    out = _kv_size(tmp_path, capsys, config, 1000)
    assert (out["layers"], out["sliding_layers"], out["total_bytes"]) == (8, 6, 1_945_600)
    # no pattern: Gemma 3's default 6 -> only layer 5 is global: 512,000 + 7 x 300 x 512 = 1,075,200
    config["text_config"] = dict(GEMMA3_TEXT)
    assert _kv_size(tmp_path, capsys, config, 1000)["total_bytes"] == 1_587_200
    # layer_types listed: 5 sliding, 3 full: 3 x 1,000 x 512 = 1,536,000 + 5 x 300 x 512 = 768,000
    types_ = ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"] * 2
    config["text_config"] = dict(GEMMA3_TEXT, layer_types=types_)
    assert _kv_size(tmp_path, capsys, config, 1000)["total_bytes"] == 2_304_000


def test_gpt_oss_alternating_layer_types(tmp_path, capsys):
    # 3 sliding (window 256) + 3 full; per layer 2 x 4 x 32 x 2 = 512 B/token; 2,000 tokens:
    # 3 x 2,000 x 512 = 3,072,000 + 3 x 256 x 512 = 393,216 -> 3,465,216
    config = {"model_type": "gpt_oss", "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 32, "hidden_size": 512, "sliding_window": 256, "torch_dtype": "bfloat16",
              "layer_types": ["sliding_attention", "full_attention"] * 3}
    assert _kv_size(tmp_path, capsys, config, 2000)["total_bytes"] == 3_465_216
    # fp8 KV: 1 B a value, half of it
    assert _kv_size(tmp_path, capsys, config, 2000, "--dtype", "fp8")["total_bytes"] == 1_732_608
    # without layer_types gpt-oss alternates the same way (layer 0 slides)
    del config["layer_types"]
    assert _kv_size(tmp_path, capsys, config, 2000)["total_bytes"] == 3_465_216


def test_mistral_window_on_every_layer(tmp_path, capsys):
    # head_dim null -> 512 / 8 = 64; per layer 2 x 2 x 64 x 2 = 512 B/token; all 4 layers slide (2,048)
    config = {"model_type": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "head_dim": None, "sliding_window": 2048, "torch_dtype": "bfloat16"}
    out = _kv_size(tmp_path, capsys, config, 3000)
    assert out["full_bytes_per_token"] == 0 and out["total_bytes"] == 4 * 2048 * 512  # 4,194,304
    assert _kv_size(tmp_path, capsys, config, 100)["total_bytes"] == 4 * 100 * 512  # 204,800


# -- chunked local attention --------------------------------------------------------------------
LLAMA4_TEXT = {"model_type": "llama4_text", "num_hidden_layers": 8, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512, "attention_chunk_size": 1024}


def test_llama4_chunked_local_layers_hold_the_current_chunk(tmp_path, capsys):
    # no_rope_layers: 1 = RoPE = chunked (6 layers), 0 = NoPE = global (layers 2, 6);
    # per layer 2 x 2 x 64 x 2 = 512 B/token. 2,500 tokens: the current chunk starts at
    # floor(2,499 / 1,024) x 1,024 = 2,048 -> 452 tokens held;
    # 2 x 2,500 x 512 = 2,560,000 + 6 x 452 x 512 = 1,388,544 -> 3,948,544
    config = {"model_type": "llama4", "torch_dtype": "bfloat16",
              "text_config": dict(LLAMA4_TEXT, no_rope_layers=[1, 1, 0, 1, 1, 1, 0, 1])}
    out = _kv_size(tmp_path, capsys, config, 2500)
    chunked = _kinds(out)["chunked_attention"]
    assert (chunked["layers"], chunked["window"], chunked["tokens_held"]) == (6, 1024, 452)
    assert out["total_bytes"] == 3_948_544 and out["max_fixed_bytes_per_sequence"] == 6 * 1024 * 512
    assert "chunked local attention" in out["note"]
    # 2,048 tokens: the second chunk is full (1,024): 2 x 2,048 x 512 + 6 x 1,024 x 512 = 5,242,880
    assert _kv_size(tmp_path, capsys, config, 2048)["total_bytes"] == 5_242_880
    # no_rope_layers empty -> every no_rope_layer_interval-th layer (here 2: 1, 3, 5, 7) is global:
    # 4 x 2,500 x 512 = 5,120,000 + 4 x 452 x 512 = 925,696 -> 6,045,696
    config["text_config"] = dict(LLAMA4_TEXT, no_rope_layers=[], no_rope_layer_interval=2)
    assert _kv_size(tmp_path, capsys, config, 2500)["total_bytes"] == 6_045_696


# -- MLA ----------------------------------------------------------------------------------------
DEEPSEEK_V2 = {"model_type": "deepseek_v2", "num_hidden_layers": 5, "num_attention_heads": 16,
               "num_key_value_heads": 16, "hidden_size": 1024, "kv_lora_rank": 256, "qk_rope_head_dim": 32,
               "qk_nope_head_dim": 64, "v_head_dim": 64, "q_lora_rank": None, "torch_dtype": "bfloat16"}


def test_mla_one_latent_per_layer_not_split_by_tp(tmp_path, capsys):
    # (256 kv_lora_rank + 32 qk_rope_head_dim) x 2 B = 576 B per layer and token, no heads;
    # 5 layers -> 2,880 B/token; 1,000 tokens -> 2,880,000
    out = _kv_size(tmp_path, capsys, DEEPSEEK_V2, 1000)
    assert (out["attention"], out["kv_heads"], out["head_dim"]) == ("mla", 0, 288)
    assert out["total_bytes"] == 2_880_000
    # tp 4: every rank holds the whole latent: 2,880,000 per rank, 4 x that on the ranks together
    out = _kv_size(tmp_path, capsys, DEEPSEEK_V2, 1000, "--tp", "4")
    assert (out["total_bytes"], out["all_ranks_total_bytes"]) == (2_880_000, 11_520_000)
    assert _kinds(out)["mla"]["tp_split"] is False and "not split" in out["note"]
    # tp 3 does not divide 16 heads, but MLA has no KV heads to split: fine
    assert _kv_size(tmp_path, capsys, DEEPSEEK_V2, 1000, "--tp", "3")["total_bytes"] == 2_880_000


def test_kimi_k2_latent_inside_a_multimodal_wrapper(tmp_path, capsys):
    # Kimi K2.5 keeps its DeepSeek-V3 text model under text_config; fp8 KV: (512 + 64) x 1 B
    # = 576 B per layer; 3 layers x 576 = 1,728 B/token; 4,096 tokens -> 7,077,888
    config = {"model_type": "kimi_k25", "vision_config": {"num_hidden_layers": 4},
              "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 3, "num_attention_heads": 64,
                              "num_key_value_heads": 64, "hidden_size": 7168, "kv_lora_rank": 512,
                              "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}}
    out = _kv_size(tmp_path, capsys, config, 4096, "--dtype", "fp8_e4m3")
    assert (out["bytes_per_token"], out["total_bytes"]) == (1728, 7_077_888)


# -- recurrent state ----------------------------------------------------------------------------
QWEN3_NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 1024, "torch_dtype": "bfloat16",
              "layer_types": ["linear_attention", "full_attention"] * 4, "linear_num_key_heads": 4,
              "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 32,
              "linear_conv_kernel_dim": 3}


def test_qwen3_next_gated_delta_net_state_per_sequence(tmp_path, capsys):
    # 4 full layers x 2 x 2 KV heads x 128 x 2 B = 4,096 B/token.
    # gated delta net, per layer: conv (3 - 1) x (2 x 4 x 64 + 8 x 32 = 768) x 2 B = 3,072
    # + state 8 value heads x 32 x 64 x 2 B = 32,768 -> 35,840; 4 layers -> 143,360 per sequence
    out = _kv_size(tmp_path, capsys, QWEN3_NEXT, 1000)
    gdn = _kinds(out)["gated_delta_net"]
    assert (gdn["layers"], gdn["state_bytes_per_layer"], gdn["state_shapes"]) == (4, 35_840, [[768, 2], [8, 32, 64]])
    assert (out["full_bytes_per_token"], out["fixed_bytes_per_sequence"]) == (4096, 143_360)
    assert out["total_bytes"] == 4_096_000 + 143_360
    assert "per sequence, whatever its length" in out["note"]
    # 5x the tokens: the state does not grow
    assert _kv_size(tmp_path, capsys, QWEN3_NEXT, 5000)["total_bytes"] == 20_480_000 + 143_360
    # tp 2: 1 KV head -> 2,048 B/token; conv 768 / 2 x 2 x 2 B = 1,536 + state 4 x 32 x 64 x 2 B
    # = 16,384 -> 17,920 x 4 = 71,680
    assert _kv_size(tmp_path, capsys, QWEN3_NEXT, 1000, "--tp", "2")["total_bytes"] == 2_048_000 + 71_680
    # fp32 recurrent state (vLLM's --mamba-ssm-cache-dtype): 8 x 32 x 64 x 4 = 65,536 + 3,072, x 4
    out = _kv_size(tmp_path, capsys, QWEN3_NEXT, 1000, "--mamba-ssm-cache-dtype", "float32")
    assert out["fixed_bytes_per_sequence"] == 4 * (3072 + 65_536)
    # layer_types absent: full_attention_interval (default 4) -> layers 3 and 7 are full
    derived = {k: v for k, v in QWEN3_NEXT.items() if k != "layer_types"}
    assert plan.layer_types(derived).count("full_attention") == 2


NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*M-M*", "num_hidden_layers": 52,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512,
              "mamba_num_heads": 16, "mamba_head_dim": 32, "ssm_state_size": 64, "n_groups": 2,
              "conv_kernel": 4, "torch_dtype": "bfloat16"}


def test_nemotron_h_pattern_and_float32_ssm_state(tmp_path, capsys):
    # pattern: 4 M (Mamba2), 2 * (attention), 2 - (MLP, no cache); num_hidden_layers is ignored
    # beside it, as in transformers. Attention: 2 layers x 2 x 2 x 64 x 2 B = 1,024 B/token.
    # Mamba2 per layer: conv (4 - 1) x (16 x 32 + 2 x 2 x 64 = 768) x 2 B = 4,608 + SSM
    # 16 x 32 x 64 x 4 B (float32: Nemotron-H's default, as vLLM) = 131,072 -> 135,680; x 4 = 542,720
    out = _kv_size(tmp_path, capsys, NEMOTRON_H, 1000)
    assert (out["layers"], out["fixed_bytes_per_sequence"]) == (8, 542_720)
    assert out["total_bytes"] == 1_024_000 + 542_720
    # tp 2: 1 KV head -> 512 B/token; conv 768 / 2 x 3 x 2 B = 2,304 + SSM 8 x 32 x 64 x 4 = 65,536
    # -> 67,840 x 4 = 271,360
    assert _kv_size(tmp_path, capsys, NEMOTRON_H, 1000, "--tp", "2")["total_bytes"] == 512_000 + 271_360
    # tp 4: 2 groups do not divide 4 ranks -> replicated to 4 groups: conv (512 + 2 x 4 x 64) / 4
    # = 256 x 3 x 2 B = 1,536 + SSM 4 x 32 x 64 x 4 = 32,768 -> 34,304 x 4 = 137,216;
    # 2 KV heads < 4 ranks: one head a rank (replicated) -> 512 B/token
    assert _kv_size(tmp_path, capsys, NEMOTRON_H, 1000, "--tp", "4")["total_bytes"] == 512_000 + 137_216
    # the config's own mamba_ssm_cache_dtype wins: bf16 SSM 16 x 32 x 64 x 2 = 65,536 + 4,608, x 4
    out = _kv_size(tmp_path, capsys, dict(NEMOTRON_H, mamba_ssm_cache_dtype="bfloat16"), 1000)
    assert out["fixed_bytes_per_sequence"] == 4 * (4608 + 65_536)


def test_granite4_hybrid_layer_types_and_auto_head_dim(tmp_path, capsys):
    # layer_types with transformers' legacy names: 4 mamba, 2 attention. Attention: 1 KV head x
    # (256 / 4 = 64) -> 2 x 1 x 64 x 2 B = 256 per layer, 512 B/token.
    # mamba_d_head auto = 2 x 256 / 8 = 64; conv (4 - 1) x (8 x 64 + 2 x 1 x 32 = 576) x 2 B = 3,456
    # + SSM 8 x 64 x 32 x 2 B = 32,768 -> 36,224 x 4 = 144,896
    config = {"model_type": "granitemoehybrid", "num_hidden_layers": 6, "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 1, "torch_dtype": "bfloat16",
              "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
              "mamba_n_heads": 8, "mamba_d_head": "auto", "mamba_d_state": 32, "mamba_n_groups": 1,
              "mamba_d_conv": 4, "mamba_expand": 2}
    out = _kv_size(tmp_path, capsys, config, 1000)
    assert (out["bytes_per_token"], out["fixed_bytes_per_sequence"]) == (512, 144_896)
    # tp 2: 1 group -> 2 (vLLM's extra groups for head shards): conv (512 + 2 x 2 x 32) / 2 = 320
    # x 3 x 2 B = 1,920 + SSM 4 x 64 x 32 x 2 = 16,384 -> 18,304 x 4 = 73,216; the 1 KV head is
    # replicated on both ranks -> still 512 B/token
    out = _kv_size(tmp_path, capsys, config, 1000, "--tp", "2")
    assert out["total_bytes"] == 512_000 + 73_216
    assert _kinds(out)["mamba2"]["state_shapes"] == [[320, 3], [4, 64, 32]]


def test_jamba_mamba1_layers_by_period_and_offset(tmp_path, capsys):
    # attn_layer_period 4, offset 1 -> attention on layers 1, 5; Mamba (v1) on the other 6.
    # Attention: 2 layers x 2 x 2 x 64 x 2 B = 1,024 B/token. Mamba inner = 2 x 256 = 512 (not the
    # MLP's intermediate_size): conv (3 - 1) x 512 x 2 B = 2,048 + SSM 512 x 8 x 2 B = 8,192
    # -> 10,240 x 6 = 61,440
    config = {"model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 1024,
              "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 4, "attn_layer_offset": 1,
              "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_expand": 2, "torch_dtype": "bfloat16"}
    out = _kv_size(tmp_path, capsys, config, 1000)
    assert _kinds(out)["mamba"]["layers"] == 6 and out["total_bytes"] == 1_024_000 + 61_440


def test_bamba_attn_layer_indices_in_float32(tmp_path, capsys):
    # attention on layer 2 only: 2 x 1 x 64 x 4 B = 512 B/token. Mamba2 x 3: mamba_d_head auto
    # = 2 x 128 / 4 = 64; conv 3 x (4 x 64 + 2 x 16 = 288) x 4 B = 3,456 + SSM 4 x 64 x 16 x 4 B
    # = 16,384 -> 19,840 x 3 = 59,520
    config = {"model_type": "bamba", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "attn_layer_indices": [2], "mamba_n_heads": 4, "mamba_d_head": "auto",
              "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2,
              "torch_dtype": "float32"}
    assert _kv_size(tmp_path, capsys, config, 100)["total_bytes"] == 51_200 + 59_520


def test_pure_mamba2_has_no_per_token_bytes(tmp_path, capsys):
    # conv 3 x (8 x 64 + 2 x 2 x 16 = 576) x 2 B = 3,456 + SSM 8 x 64 x 16 x 2 B = 16,384 -> 19,840 x 3
    config = {"model_type": "mamba2", "num_hidden_layers": 3, "hidden_size": 256, "num_heads": 8, "head_dim": 64,
              "state_size": 16, "n_groups": 2, "conv_kernel": 4, "expand": 2, "torch_dtype": "bfloat16"}
    for tokens in (10, 100_000):
        out = _kv_size(tmp_path, capsys, config, tokens)
        assert (out["attention"], out["bytes_per_token"], out["total_bytes"]) == ("none", 0, 59_520)


# -- what it cannot size ---------------------------------------------------------------------------
@pytest.mark.parametrize("config, needles", [
    (dict(QWEN3_NEXT, layer_types=["compressed_sparse_attention"] * 8),
     ("layer_types[0] 'compressed_sparse_attention' is not a supported layer type", "sliding_attention",
      "chunked_attention", "linear_attention")),
    (dict(NEMOTRON_H, hybrid_override_pattern="M*X"), ("hybrid_override_pattern[2] 'X'", "M (mamba)")),
    ({"model_type": "my_linear", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128,
      "layer_types": ["linear_attention", "full_attention"]}, ("model_type 'my_linear'", "cannot size", "Mamba2")),
    ({"model_type": "minimax", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128},
     ("model_type 'minimax' is not supported", "lightning")),
    (dict(QWEN3_NEXT, layer_types=["full_attention"] * 3), ("num_hidden_layers 8 but 3 layer types",)),
    (dict(QWEN2, model_type="falcon_h1", mamba_n_heads=8), ("model_type 'falcon_h1' is not supported",
                                                            "attention KV and Mamba2 state", "Qwen3-Next")),
    (dict(GEMMA3_TEXT, model_type="other", sliding_window=None,
          layer_types=["sliding_attention"] * 8), ("no 'sliding_window'",)),
    (dict(DEEPSEEK_V2, layer_types=["sliding_attention"] * 5, sliding_window=64), ("MLA with sliding",)),
])
def test_unsupported_shapes_are_one_line(tmp_path, capsys, config, needles):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _one_line(capsys, ["kv-size", str(path)], *needles)
    with pytest.raises(ConfigError):
        plan.kv_shape(config)


def test_tp_that_does_not_divide_the_state_is_one_line(tmp_path, capsys):
    # 1 KV head fits tp 3 (replicated), but 8 value heads of the gated delta net do not split 3 ways
    config = dict(QWEN3_NEXT, num_key_value_heads=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    _one_line(capsys, ["kv-size", str(path), "--tp", "3"], "tp 3 does not divide")


# -- breakeven and fleet-load read the same shapes -------------------------------------------------
def test_breakeven_sizes_the_prompt_from_the_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    # 1,000 tokens of the Qwen3-Next config: 4,239,360 B (above); at 1 GB/s: 4.23936 ms to load, the
    # same to store; recompute 100 ms -> p* = 4.23936 / (4.23936 + 95.76064) = 0.0423936
    argv = ["breakeven", "--model", str(tmp_path), "--tokens", "1000", "--bandwidth", "1GB/s", "--recompute-ms", "100"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes"] == 4_239_360 and out["breakeven_hit_rate"] == pytest.approx(0.0423936)
    assert out["kv_size"]["fixed_bytes_per_sequence"] == 143_360
    # tp 2: both ranks load their half: 2 x 2,119,680 = 4,239,360 as well
    assert main([*argv, "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] == 2 * 2_119_680
    _one_line(capsys, argv[:3] + argv[5:], "--model needs --tokens")
    _one_line(capsys, [*argv, "--kv-bytes", "1GB"], "not both")


def test_fleet_load_reads_the_checkpoint_size_from_the_model_dir(tmp_path, capsys):
    np = pytest.importorskip("numpy")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2))
    safetensors_numpy.save_file({"w": np.zeros((64, 64), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    size = (tmp_path / "model.safetensors").stat().st_size
    assert main(["fleet-load", "--model", str(tmp_path), "--pods", "10", "--bandwidth", "1GB/s",
                 "--tokens", "1000", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_bytes"] == size and out["total_bytes"] == 10 * size
    # MLA at tp 2: 2,880,000 per rank (above), the latent on both ranks
    assert (out["kv_size"]["total_bytes"], out["kv_size"]["all_ranks_total_bytes"]) == (2_880_000, 5_760_000)
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line(capsys, ["fleet-load", "--model", str(empty), "--pods", "1", "--bandwidth", "1GB/s"],
              "no *.safetensors files", "--model-size")
    _one_line(capsys, ["fleet-load", "--model-size", "1GB", "--tokens", "10", "--pods", "1", "--bandwidth", "1GB/s"],
              "give --model")


def test_kv_size_table_shows_each_kind_and_the_formula(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(NEMOTRON_H))
    assert main(["kv-size", str(tmp_path), "--tokens", "1000"]) == 0
    text = capsys.readouterr().out
    assert "mamba2 (4 layers)" in text and "542,720" in text and "Mamba2 layers x (conv" in text


# -- against vLLM's own KV cache specs (built without an engine) -----------------------------------
def test_page_sizes_match_vllm_kv_cache_specs(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    spec = pytest.importorskip("vllm.v1.kv_cache_interface")
    mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    calc = mamba_utils.MambaStateShapeCalculator
    block = 16
    bf16 = torch.bfloat16

    def per_token(config, kind, **kw):
        return _kinds(plan.kv_size(plan.kv_shape(config, **kw), 1))[kind]

    dense = per_token(QWEN2, "full_attention", tp=2)
    full = spec.FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=bf16)
    assert full.page_size_bytes == block * dense["bytes_per_token_per_layer"]
    gemma = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": dict(GEMMA3_TEXT)}
    sliding = per_token(gemma, "sliding_attention")
    swa = spec.SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=bf16, sliding_window=300)
    assert swa.page_size_bytes == block * sliding["bytes_per_token_per_layer"]
    chunked = per_token({"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": LLAMA4_TEXT},
                        "chunked_attention")
    local = spec.ChunkedLocalAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=bf16,
                                           attention_chunk_size=1024)
    assert local.page_size_bytes == block * chunked["bytes_per_token_per_layer"]
    mla = spec.MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=256 + 32, dtype=bf16)
    assert mla.page_size_bytes == block * per_token(DEEPSEEK_V2, "mla", tp=4)["bytes_per_token_per_layer"]

    # recurrent state: one page per sequence, whatever the block size
    shapes = calc.mamba2_state_shape(tp_world_size=4, intermediate_size=16 * 32, n_groups=2, num_heads=16,
                                     head_dim=32, state_size=64, conv_kernel=4)
    mamba2 = spec.MambaSpec(block_size=block, shapes=shapes, dtypes=(bf16, torch.float32))
    assert mamba2.page_size_bytes == per_token(NEMOTRON_H, "mamba2", tp=4)["state_bytes_per_layer"]
    shapes = calc.gated_delta_net_state_shape(2, 4, 8, 64, 32, 3)
    gdn = spec.MambaSpec(block_size=block, shapes=shapes, dtypes=(bf16, bf16))
    assert gdn.page_size_bytes == per_token(QWEN3_NEXT, "gated_delta_net", tp=2)["state_bytes_per_layer"]
    shapes = calc.mamba1_state_shape(tp_world_size=1, intermediate_size=512, state_size=8, conv_kernel=3)
    jamba = {"model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4,
             "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_expand": 2, "torch_dtype": "bfloat16"}
    mamba1 = spec.MambaSpec(block_size=block, shapes=shapes, dtypes=(bf16, bf16))
    assert mamba1.page_size_bytes == per_token(jamba, "mamba")["state_bytes_per_layer"]


# -- configs saved by transformers' own config classes ---------------------------------------------
_HF_CASES = {  # model_type -> small kwargs; transformers fills the rest with its defaults
    "gemma2": dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "gemma3_text": dict(num_hidden_layers=7, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, sliding_window=128),
    "gpt_oss": dict(num_hidden_layers=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "llama4_text": dict(num_hidden_layers=9, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, no_rope_layer_interval=3),
    "qwen3_next": dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       full_attention_interval=3),
    "jamba": dict(num_hidden_layers=10, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  attn_layer_period=3, attn_layer_offset=2),
    "bamba": dict(num_hidden_layers=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                  mamba_n_heads=8, attn_layer_indices=[0, 3]),
    "nemotron_h": dict(hybrid_override_pattern="M*-M-E*M", hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, mamba_num_heads=8, mamba_head_dim=64),
}
_HF_KIND = {"full_attention": "full_attention", "sliding_attention": "sliding_attention",
            "chunked_attention": "chunked_attention"}


@pytest.mark.parametrize("model_type", sorted(_HF_CASES))
def test_layer_kinds_match_transformers_own_layer_types(tmp_path, capsys, model_type):
    """The layer pattern read from a config.json that transformers wrote (its defaults filled in)
    counts the same layers of each kind as transformers' own ``layer_types``."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model(model_type, **_HF_CASES[model_type])
    config = json.loads(hf.to_json_string(use_diff=False))
    expected: dict[str, int] = {}
    for t in hf.layer_types:
        if t in ("mlp", "moe"):
            continue
        kind = _HF_KIND.get(t, "recurrent")
        expected[kind] = expected.get(kind, 0) + 1
    out = _kv_size(tmp_path, capsys, config, 100)
    got: dict[str, int] = {}
    for k in out["layer_kinds"]:
        kind = "recurrent" if k["state_bytes_per_layer"] else k["kind"]
        got[kind] = got.get(kind, 0) + k["layers"]
    assert got == expected

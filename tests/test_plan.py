"""The planning calculators reproduce the source document's figures; the CLI's JSON is stable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier import plan
from kvtier.cli import main
from kvtier.errors import ConfigError

QWEN_1_5B = {  # Qwen2.5-1.5B config.json (the fields that matter)
    "num_hidden_layers": 28, "hidden_size": 1536, "num_attention_heads": 12,
    "num_key_value_heads": 2, "torch_dtype": "bfloat16", "max_position_embeddings": 32768,
}
LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "torch_dtype": "bfloat16"}


def _write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_qwen_kv_size_matches_the_document():
    out = plan.kv_size(plan.kv_shape(QWEN_1_5B, "fp16"), 4864)
    assert out["bytes_per_token"] == 28_672
    assert out["total_bytes"] == 139_460_608
    assert round(out["total_gib"], 4) == 0.1299


def test_llama_70b_and_dtypes():
    assert plan.kv_shape(LLAMA_70B).bytes_per_token == 327_680  # bf16 from the config
    assert plan.kv_shape(LLAMA_70B, "fp8_e4m3").bytes_per_token == 163_840
    assert plan.kv_shape(LLAMA_70B, "float32").bytes_per_token == 655_360
    gqa_default = dict(LLAMA_70B, num_key_value_heads=None)  # absent -> as many as query heads
    assert plan.kv_shape(gqa_default).kv_heads == 64


def test_mla_caches_one_latent_per_layer():
    shape = plan.kv_shape(DEEPSEEK_V3)
    assert shape.attention == "mla"
    assert shape.bytes_per_token == 61 * (512 + 64) * 2


def test_kv_size_cli_json_from_dir_and_file(tmp_path, capsys):
    _write(tmp_path, QWEN_1_5B)
    assert main(["kv-size", str(tmp_path), "--tokens", "4864", "--dtype", "fp16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["bytes_per_token"], out["tokens"], out["total_bytes"]) == (28_672, 4864, 139_460_608)
    assert abs(out["total_gib"] - 0.12988) < 1e-4
    path = _write(tmp_path, LLAMA_70B, "llama.json")
    assert main(["kv-size", str(path), "--tokens", "32000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 327_680 * 32000


@pytest.mark.parametrize("content, message", [
    (None, "cannot read model config"),
    ("{not json", "not a JSON model config"),
    (json.dumps({"num_hidden_layers": 2}), "missing 'num_attention_heads'"),
    (json.dumps(dict(QWEN_1_5B, hidden_size=1537)), "not a multiple"),
    (json.dumps(dict(QWEN_1_5B, torch_dtype="int3")), "unknown KV dtype 'int3'"),
    (json.dumps(dict(QWEN_1_5B, num_hidden_layers="28")), "num_hidden_layers must be a positive integer"),
])
def test_kv_size_bad_config_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    assert main(["kv-size", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_breakeven_from_the_document():
    assert plan.breakeven(22.3, 527.6) == pytest.approx(0.04055, abs=1e-4)
    ttft = plan.breakeven_from_ttft(recompute_ms=576.2, hit_ms=48.6, store_ms=598.5)
    assert ttft["hit_gain_ms"] == pytest.approx(527.6) and ttft["miss_cost_ms"] == pytest.approx(22.3)
    assert plan.breakeven(10, 0) is None and plan.breakeven(0, 10) == 0.0


def test_breakeven_first_principles():
    # 0.13 GB at 13 GB/s + 0 ms = 10 ms load vs 560 ms recompute; a synchronous write costs 10 ms.
    out = plan.breakeven_first_principles(130_000_000, 13e9, 0.0, 560.0)
    assert out["load_ms"] == pytest.approx(10.0) and out["hit_gain_ms"] == pytest.approx(550.0)
    assert out["breakeven_hit_rate"] == pytest.approx(10 / 560)
    slow = plan.breakeven_first_principles(130_000_000, 0.1e9, 0.0, 560.0)  # 1.3 s to load
    assert slow["breakeven_hit_rate"] is None


def test_breakeven_cli_json(capsys):
    assert main(["breakeven", "--miss-cost-ms", "22.3", "--hit-gain-ms", "527.6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakeven_hit_rate"] == pytest.approx(0.0406, abs=1e-3)
    assert main(["breakeven", "--recompute-ms", "576.2", "--hit-ms", "48.6", "--store-ms", "598.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakeven_hit_rate"] == pytest.approx(0.0406, abs=1e-3)
    assert main(["breakeven", "--kv-bytes", "0.13GB", "--bandwidth", "13GB/s", "--recompute-ms", "560", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakeven_hit_rate"] == pytest.approx(10 / 560)
    assert main(["breakeven", "--hit-ms", "3"]) == 2
    assert "give --miss-cost-ms" in capsys.readouterr().err


def test_fleet_load_matches_the_document():
    out = plan.fleet_load(140 * 10**9, 100, 10e9)
    assert out["total_bytes"] == 14 * 10**12 and out["seconds"] == pytest.approx(1400)
    cached = plan.fleet_load(140 * 10**9, 100, 10e9, pods_per_node=8, tp=4)
    by_name = {s["scenario"].split(" (")[0]: s for s in cached["scenarios"]}
    assert by_name["node-local cache"]["total_bytes"] == 13 * 140 * 10**9  # ceil(100 / 8) nodes
    assert by_name["every rank reads the whole model"]["seconds"] == pytest.approx(5600)
    assert cached["per_rank_bytes"] == 35 * 10**9


def test_fleet_load_cli_json_subprocess():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvtier.cli import main; sys.exit(main())", "fleet-load",
         "--model-size", "140GB", "--pods", "100", "--bandwidth", "10GB/s", "--json"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["total_bytes"] == 14_000_000_000_000 and out["seconds"] == pytest.approx(1400.0)


@pytest.mark.parametrize("argv, message", [
    (["--model-size", "2 GiBs", "--pods", "1", "--bandwidth", "1GB/s"], "unknown unit"),
    (["--model-size", "abc", "--pods", "1", "--bandwidth", "1GB/s"], "cannot read 'abc' as a size"),
    (["--model-size", "1GB", "--pods", "0", "--bandwidth", "1GB/s"], "must be positive"),
    (["--model-size", "1GB", "--pods", "1", "--bandwidth", "0GB/s"], "bandwidth must be positive"),
    (["--model-size", "1GB", "--pods", "1", "--bandwidth", "0"], "has no unit"),
])
def test_fleet_load_bad_input_is_one_line(capsys, argv, message):
    assert main(["fleet-load", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_tables_print_without_json(tmp_path, capsys):
    _write(tmp_path, QWEN_1_5B)
    assert main(["kv-size", str(tmp_path), "--tokens", "4864", "--dtype", "fp16"]) == 0
    assert "28,672" in capsys.readouterr().out
    assert main(["fleet-load", "--model-size", "140GB", "--pods", "100", "--bandwidth", "10GB/s"]) == 0
    assert "14.00 TB" in capsys.readouterr().out


# -- issue 13: sliding windows, multimodal wrappers, vLLM's vocabulary, clamped pods per node ------
def _dense(**extra):
    return {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
            "torch_dtype": "bfloat16", **extra}


def test_sliding_window_sources():
    assert plan.sliding_layers(_dense(sliding_window=4096, use_sliding_window=False), 4) == (0, None)  # Qwen2
    assert plan.sliding_layers(_dense(sliding_window=4096), 4) == (4, 4096)  # Mistral 7B v0.1: every layer
    assert plan.sliding_layers(_dense(sliding_window=4096, model_type="gemma2"), 4) == (2, 4096)
    types_ = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert plan.sliding_layers(_dense(sliding_window=512, layer_types=types_), 4) == (3, 512)
    assert plan.sliding_layers(_dense(sliding_window=None), 4) == (0, None)


def test_sliding_window_sizes_below_and_above_the_window():
    shape = plan.kv_shape(_dense(sliding_window=100))
    per_layer = shape.bytes_per_token // 4
    assert plan.kv_size(shape, 50)["total_bytes"] == 50 * shape.bytes_per_token  # inside the window
    assert plan.kv_size(shape, 1000)["total_bytes"] == 4 * 100 * per_layer  # every layer capped
    assert plan.kv_size(plan.kv_shape(_dense()), 10)["note"] is None


def test_auto_dtype_and_token_counts():
    assert plan.kv_shape(_dense(), "auto").dtype_bytes == 2
    assert plan.parse_tokens("32k") == 32_000 and plan.parse_tokens("32K") == 32_768
    assert plan.parse_tokens("1.5m") == 1_500_000 and plan.parse_tokens(7) == 7
    for bad in ("0", "-3", "k", "12q"):
        with pytest.raises(ConfigError):
            plan.parse_tokens(bad)
    wrapped = {"text_config": _dense(max_position_embeddings=8192), "max_position_embeddings": 0}
    assert plan.max_tokens(wrapped) == 8192


def test_fleet_load_clamps_pods_per_node():
    out = plan.fleet_load(10**9, 3, 10**9, pods_per_node=10)
    assert out["pods_per_node"] == 3 and out["nodes"] == 1 and out["notes"]
    assert plan.fleet_load(10**9, 30, 10**9, pods_per_node=10)["notes"] == []

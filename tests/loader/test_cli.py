"""`kvtier probe`, `kvtier shard` and `kvtier load` from the command line (JSON outputs, one-line errors)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from kvtier.cli import main


def test_probe_json(tmp_path, capsys):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    assert main(["probe", str(path), "--block-sizes", "128KiB,1MiB", "--concurrency", "1,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["block_size"], r["concurrency"]) for r in rows] == [(131072, 1), (131072, 4), (1 << 20, 1), (1 << 20, 4)]
    assert all(r["gb_per_s"] > 0 for r in rows)


def test_load_json(tmp_path, capsys):
    model = tmp_path / "model.safetensors"
    save_file({"x.q_proj.weight": torch.randn(8, 4), "norm.weight": torch.ones(4)}, str(model))
    assert main(["load", str(model), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 2


def test_shard_of_a_non_model_is_one_line_error(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert main(["shard", str(tmp_path / "m"), "--tp", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a model directory with a config.json" in err and "\n" not in err
    assert main(["shard", str(tmp_path / "m"), "--tp", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--tp must be at least 1" in capsys.readouterr().err


def test_shard_refuses_an_output_that_holds_shards(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "model-rank-0-part-0.safetensors").write_bytes(b"")
    assert main(["shard", str(tmp_path / "m"), "--tp", "1", "--out", str(tmp_path / "o")]) == 2
    assert "already holds pre-sharded files" in capsys.readouterr().err


def test_bad_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    assert main(["load", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.safetensors" in err and "\n" not in err


def _broken_checkpoint(root, bad_header: bytes):
    """A model directory (config.json + index) whose second file has the header ``bad_header``."""
    model = root / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    save_file({"a": torch.ones(4)}, str(model / "m-1.safetensors"))
    (model / "m-2.safetensors").write_bytes(struct.pack("<Q", len(bad_header)) + bad_header + bytes(8))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "m-1.safetensors", "w": "m-2.safetensors"}}))
    return model


@pytest.mark.parametrize("bad,needle", [
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
     b' "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', "tensor 'w' appears more than once"),
    (b'{"w": {"dtype": "F32", "shape": [18446744073709551616, 0], "data_offsets": [0, 0]}}', "beyond int64"),
    (b'{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', "is 12 bytes but data_offsets span 8"),
    (b'{"w": ', "not valid JSON"),
])
def test_shard_of_a_malformed_checkpoint_fails_fast_without_an_engine(tmp_path, bad, needle):
    """Issue 9, item 16: `kvtier shard` started vLLM for ~30 s and then printed only "Engine core
    initialization failed". Every header is checked first: one line naming the file, exit 2, in
    seconds, and no engine (no output directory, no engine log)."""
    model = _broken_checkpoint(tmp_path, bad)
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "shard", str(model), "--tp", "1", "--out", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith(f"kvtier shard: error: {model / 'm-2.safetensors'}: ") and needle in err, err
    assert not out.exists(), "an engine was started (the output directory and its log were created)"
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_shard_of_a_checkpoint_missing_a_file_fails_before_the_engine(tmp_path, capsys):
    model = _broken_checkpoint(tmp_path, b"{}")
    os.unlink(model / "m-2.safetensors")
    assert main(["shard", str(model), "--tp", "1", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "index names 'm-2.safetensors', which is not there" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_check_model_validates_every_file_and_cross_file_names(tmp_path):
    """``check_model`` reads only headers: a name in two files is refused, a pre-sharded layout is not."""
    from kvtier.errors import LoaderError
    from kvtier.integrations.vllm.shard import check_checkpoint
    from kvtier.loader.reader import check_model

    model = tmp_path / "m"
    model.mkdir()
    save_file({"a": torch.ones(4)}, str(model / "x-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(model / "x-2.safetensors"))
    with pytest.raises(LoaderError, match=r"x-2\.safetensors: tensor 'a' also appears in .*x-1\.safetensors"):
        check_model(str(model))
    assert len(check_model(str(model), unique_names=False)) == 2
    ranks = tmp_path / "r"
    ranks.mkdir()
    for r in range(2):
        save_file({"a": torch.ones(2)}, str(ranks / f"model-rank-{r}-part-0.safetensors"))
    assert check_checkpoint(str(ranks)) == 2


def test_a_real_checkpoint_passes_the_pre_engine_check(qwen2_dir):
    """The check that runs before the sharding engine accepts what transformers writes (index, padding)."""
    from kvtier.integrations.vllm.shard import check_checkpoint

    assert check_checkpoint(qwen2_dir) == len([n for n in os.listdir(qwen2_dir) if n.endswith(".safetensors")]) > 1

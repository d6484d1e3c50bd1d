"""`kvtier probe`, `kvtier shard` and `kvtier load` from the command line (JSON outputs, one-line errors)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from kvtier.cli import main


def test_probe_json(tmp_path, capsys):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    assert main(["probe", str(path), "--block-sizes", "128k,1m", "--concurrency", "1,4", "--json"]) == 0
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

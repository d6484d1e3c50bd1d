"""Chunk keys, multimodal folding, per-worker keys and the weights identity (kvtier.keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest

from kvtier.keys import (
    ROOT,
    WEIGHTS_WINDOW,
    MMItem,
    Namespace,
    chunk_keys,
    lora_identity,
    weights_digest,
    worker_key,
)

TOKENS = list(range(1000, 1000 + 8 * 16))  # 8 chunks of 16
NS = Namespace("m")


def test_mm_item_changes_the_chunks_it_overlaps_and_every_later_one():
    plain = chunk_keys(TOKENS, NS, 16)
    a = chunk_keys(TOKENS, NS, 16, mm=[MMItem("a", 20, 30)])  # tokens 20..49: chunks 1-3
    b = chunk_keys(TOKENS, NS, 16, mm=[MMItem("b", 20, 30)])
    assert a[0] == b[0] == plain[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))
    assert chunk_keys(TOKENS, NS, 16, mm=[MMItem("a", 20, 30)]) == a


def test_mm_item_order_does_not_matter_and_resume_matches():
    items = [MMItem("a", 20, 30), MMItem("c", 70, 5)]
    full = chunk_keys(TOKENS, NS, 16, mm=items)
    assert chunk_keys(TOKENS, NS, 16, mm=items[::-1]) == full
    assert chunk_keys(TOKENS, NS, 16, start=3, prev=full[2], mm=items) == full[3:]
    # only the second item differs: chunks before it (0..3) keep their keys
    other = chunk_keys(TOKENS, NS, 16, mm=[items[0], MMItem("d", 70, 5)])
    assert other[:4] == full[:4] and other[4] != full[4]


def test_mm_item_position_and_length_are_keyed():
    base = chunk_keys(TOKENS, NS, 16, mm=[MMItem("a", 20, 30)])
    assert chunk_keys(TOKENS, NS, 16, mm=[MMItem("a", 21, 30)])[1] != base[1]
    assert chunk_keys(TOKENS, NS, 16, mm=[MMItem("a", 20, 29)])[1] != base[1]


@pytest.mark.parametrize("bad", [("", 0, 1), ("a", -1, 2), ("a", 0, 0)])
def test_mm_item_rejects_bad_spans(bad):
    with pytest.raises(ValueError):
        MMItem(*bad)


def test_worker_key_per_rank_and_stage():
    key = chunk_keys(TOKENS, NS, 16)[0]
    assert worker_key(key) == key
    shares = {worker_key(key, r, 2, s, pp) for r in range(2) for s in range(2) for pp in (1, 2) if s < pp}
    assert len(shares) == 6 and key not in shares
    assert worker_key(key, 1, 2) == worker_key(key, 1, 2, 0, 1)  # TP-only keys are unchanged


@pytest.mark.parametrize("name", [f.name for f in fields(Namespace) if f.name != "model"])
def test_every_namespace_field_changes_the_digest(name):
    default = getattr(NS, name)
    changed = replace(NS, **{name: default + 1 if isinstance(default, int) else default + "x"})
    assert changed.digest() != NS.digest()
    assert chunk_keys(TOKENS, changed, 16)[0] != chunk_keys(TOKENS, NS, 16)[0]


def test_lora_identity_names_path_and_digest():
    ids = {lora_identity("sql", "/a"), lora_identity("sql", "/b"), lora_identity("sql2", "/a"),
           lora_identity("sql", "/a", "d1")}
    assert len(ids) == 4


def _model(path, seed: int, name: str = "model.safetensors"):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    save_file({"a.weight": torch.randn(64, 64, generator=g), "b.bias": torch.randn(64, generator=g)}, path / name)
    (path / "config.json").write_text('{"model_type": "x"}')
    return path


def test_weights_digest_sees_a_fine_tune_at_the_same_path_and_ignores_copies(tmp_path):
    model = _model(tmp_path / "m", seed=0)
    first = weights_digest(model)
    assert first and weights_digest(model) == first
    copy = _model(tmp_path / "copy", seed=0)  # same bytes elsewhere, other mtimes
    os.utime(copy / "model.safetensors", (1, 1))
    assert weights_digest(copy) == first
    _model(model, seed=1)  # a "fine-tune" written over the same path, same config.json
    assert weights_digest(model) != first


def test_weights_digest_sees_a_change_inside_a_sampled_window(tmp_path):
    model = _model(tmp_path / "m", seed=0)
    before = weights_digest(model)
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-WEIGHTS_WINDOW // 2] ^= 1  # inside the last tensor's tail window
    path.write_bytes(bytes(data))
    assert weights_digest(model) != before


def test_weights_digest_index_and_fallbacks(tmp_path):
    assert weights_digest(tmp_path / "absent") == "" and weights_digest("org/hub-id") == ""
    assert weights_digest(tmp_path) == ""  # no weight files
    model = _model(tmp_path / "sharded", seed=0, name="model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}))
    (model / "stray.safetensors").write_bytes(b"not read: not in the index")
    assert weights_digest(model)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(np.arange(100000, dtype=np.uint8).tobytes())
    assert weights_digest(tmp_path / "bin")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\xff" * 100)  # not parseable: sampled evenly
    assert weights_digest(junk)


_CHILD = """
import json, sys
from kvtier.keys import MMItem, Namespace, chunk_keys, weights_digest, worker_key
ns = Namespace("m", revision="r", weights_digest=weights_digest(sys.argv[1]), pp_world_size=2, lora="l")
keys = chunk_keys(list(range(64)), ns, 16, mm=[MMItem("img", 10, 20)])
print(json.dumps([k.hex() for k in keys] + [worker_key(keys[-1], 1, 2, 1, 2).hex()]))
"""


def test_keys_are_the_same_in_two_processes_with_different_hash_seeds(tmp_path):
    model = _model(tmp_path / "m", seed=0)
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(model)], env=env, capture_output=True, text=True,
                              timeout=120, check=True)
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1] and len(outs[0]) == 5 and ROOT.hex() not in outs[0]


def test_token_ids_key_alike_as_a_list_a_tuple_and_an_array():
    """A list or tuple is packed without numpy; the keys are the same bytes either way, the
    4-byte little-endian form the key format fixes (checked against a hand-built first key)."""
    import hashlib

    tokens = [0, 1, 2**32 - 1, 255, 256, 65535, 65536, 123456789] * 4
    keys = chunk_keys(tokens, NS, 16)
    assert keys == chunk_keys(tuple(tokens), NS, 16)
    assert keys == chunk_keys(np.array(tokens, dtype=np.int64), NS, 16)
    assert keys == chunk_keys(np.array(tokens, dtype=np.uint32), NS, 16)
    assert keys == chunk_keys([np.int64(t) for t in tokens], NS, 16)
    raw = b"".join(t.to_bytes(4, "little") for t in tokens[:16])
    assert keys[0] == hashlib.sha256(ROOT + NS.digest() + raw).digest()


@pytest.mark.parametrize("bad", [[1, -1], [2**32], (5, 2**40)])
def test_token_ids_outside_uint32_are_refused_for_lists_and_arrays(bad):
    from kvtier.errors import ConfigError

    for tokens in (bad, np.array(bad, dtype=np.int64)):
        with pytest.raises(ConfigError, match="token ids must be in"):
            chunk_keys(list(tokens) * 16, NS, 16)

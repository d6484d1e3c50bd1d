"""The connector's key namespace separates every engine setting that changes KV bytes (issue 9,
item 2), and is the same in two processes for the same setting.

Each test builds the connector's scheduler side from a real VllmConfig over a tiny random model
(no engine) and compares the keys of one prompt: a change of model revision, weights at the
same path (a fine-tune, config.json unchanged), quantization, pipeline-parallel size or layer
split, or LoRA adapter path must change every key; the same setting must not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integration._vllm_config import make_tiny_model, scheduler_connector, vllm_config  # noqa: E402

PROMPT = list(range(100, 196))  # 3 chunks of 32
ROOT_DIR = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ns") / "model")


_ids = iter(range(10**6))


def prompt_keys(config, lora=None) -> list[bytes]:
    """The chunk keys the connector built from ``config`` gives ``PROMPT``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    conn = scheduler_connector(config)
    try:
        req = Request(request_id=f"r{next(_ids)}", prompt_token_ids=PROMPT, sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, lora_request=lora)
        return list(conn._request_state(req).keys)
    finally:
        conn.shutdown()


def assert_all_differ(a: list[bytes], b: list[bytes]) -> None:
    assert len(a) == len(b) == 3 and all(x != y for x, y in zip(a, b))


def test_same_config_same_keys(model):
    assert prompt_keys(vllm_config(model)) == prompt_keys(vllm_config(model))


def test_revision_changes_keys(model):
    assert_all_differ(prompt_keys(vllm_config(model)), prompt_keys(vllm_config(model, revision="v2")))


def test_quantization_changes_keys(model):
    assert_all_differ(prompt_keys(vllm_config(model)), prompt_keys(vllm_config(model, quantization="fp8")))


def test_dtype_changes_keys(model):
    assert_all_differ(prompt_keys(vllm_config(model)), prompt_keys(vllm_config(model, dtype="float16")))


def test_pipeline_parallel_size_and_layer_split_change_keys(model, monkeypatch):
    base, pp2 = prompt_keys(vllm_config(model)), prompt_keys(vllm_config(model, pp=2))
    assert_all_differ(base, pp2)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1")
    assert_all_differ(pp2, prompt_keys(vllm_config(model, pp=2)))


def test_pipeline_stages_have_their_own_keys(model):
    conn = scheduler_connector(vllm_config(model, pp=2))
    try:
        key = bytes(32)
        shares = {conn._rank_key(key, 0, stage) for stage in range(2)}
        assert len(shares) == 2 and key not in shares
    finally:
        conn.shutdown()


def test_fine_tune_at_the_same_path_changes_keys(tmp_path):
    path = make_tiny_model(tmp_path / "model", seed=0)
    before = prompt_keys(vllm_config(path))
    config_json = (path / "config.json").read_bytes()
    make_tiny_model(path, seed=1)  # other weights, same architecture, written over the same path
    assert (path / "config.json").read_bytes() == config_json
    assert_all_differ(before, prompt_keys(vllm_config(path)))


def test_weights_id_replaces_the_sampled_digest(model):
    named = prompt_keys(vllm_config(model, extra={"weights_id": "release-7"}))
    assert_all_differ(prompt_keys(vllm_config(model)), named)
    assert_all_differ(named, prompt_keys(vllm_config(model, extra={"weights_id": "release-8"})))


def test_an_fp8_tier_changes_keys_and_a_lossless_one_does_not(model, tmp_path):
    """A lossy tier codec makes another KV: its engine keys apart from engines without it; a
    lossless one stores the same KV, so engines with and without it share entries."""
    def tiers(codec: str) -> dict:
        return {"tiers": [{"type": "ram", "capacity": "16MiB"},
                          {"type": "fs", "path": str(tmp_path / codec), "capacity": "16MiB", "codec": codec}]}

    plain = prompt_keys(vllm_config(model, extra=tiers("none")))
    assert prompt_keys(vllm_config(model)) == plain  # the lower tier itself is not keyed
    assert_all_differ(plain, prompt_keys(vllm_config(model, extra=tiers("fp8"))))
    if importlib.util.find_spec("blosc2") is not None:
        assert prompt_keys(vllm_config(model, extra=tiers("lossless"))) == plain


def test_lora_adapter_path_and_content_change_keys(model, tmp_path):
    from vllm.lora.request import LoRARequest

    a, b = tmp_path / "a", tmp_path / "b"
    for d, fill in ((a, b"\x01"), (b, b"\x02")):
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(fill * 4096)  # sampled as opaque bytes
    config = vllm_config(model)
    base = prompt_keys(config)
    at_a = prompt_keys(config, LoRARequest("sql", 1, str(a)))
    assert_all_differ(base, at_a)
    assert_all_differ(at_a, prompt_keys(config, LoRARequest("sql", 1, str(b))))  # same name, other path
    assert prompt_keys(config, LoRARequest("sql", 2, str(a))) == at_a  # the int id is per-process: not keyed
    (a / "adapter_model.safetensors").write_bytes(b"\x03" * 4096)  # other adapter weights at the same path
    assert_all_differ(at_a, prompt_keys(config, LoRARequest("sql", 1, str(a))))


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from tests.integration.test_namespace import prompt_keys
from tests.integration._vllm_config import vllm_config
from vllm.lora.request import LoRARequest
keys = prompt_keys(vllm_config(sys.argv[1], revision="r1"), LoRARequest("sql", 1, sys.argv[1]))
print("KEYS " + json.dumps([k.hex() for k in keys]))
"""


@pytest.mark.slow
def test_same_config_same_keys_in_two_processes(model):
    """Keys must not depend on PYTHONHASHSEED or anything else about the process."""
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(model), str(ROOT_DIR)], env=env, cwd=str(ROOT_DIR),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("KEYS "))[5:]))
    assert outs[0] == outs[1] and len(outs[0]) == 3

"""``kvtier bench codec --kv engine``: the KV a real vLLM engine stores through kvtier's connector
(dumped to an fs tier, read back entry by entry) is what the codecs are measured on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("blosc2")


def _bench(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "codec", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.vllm
def test_the_small_family_engine_kv_is_coded_and_reported_against_the_targets():
    tokens = 1024
    proc = _bench("--kv", "engine", "--families", "small", "--tokens", str(tokens), "--rates", "", "--no-local",
                  "--repeat", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    (fam,) = report["families"]
    assert fam["family"] == "small" and fam["model"].startswith("qwen2-random-small")
    per_token = 8 * 2 * 2 * 64 * 2  # layers x (K, V) x KV heads x head_dim x bf16 bytes
    # every whole chunk of the prompt, as the engine saved it (not a transformers recomputation)
    assert 0.85 * tokens * per_token <= fam["bf16_bytes"] <= tokens * per_token, fam["bf16_bytes"]
    assert fam["bf16_bytes"] % (per_token * 16) == 0 and fam["other_dtypes"] == {}
    lossless = next(r for r in fam["codecs"] if r["codec"].startswith("lossless"))
    assert lossless["ratio"] > 1.2 and lossless["encode_gbps"] > 0 and lossless["decode_gbps"] > 0
    assert fam["targets"]["lossless_ratio_ge_1_3"] == (lossless["ratio"] >= 1.3)
    assert 0.5 < fam["fp8"]["stored_fraction"] <= 0.55 and fam["targets"]["fp8_stored_le_0_55"]
    assert 0 < fam["fp8"]["mean_abs_error"] < 0.05 * fam["fp8"]["mean_abs_value"]
    assert report["targets"]["fp8_stored_le_0_55_every_family"]
    assert report["through_store"]["bit_exact"] and report["kv_source"].startswith("vLLM engine (small)")


@pytest.mark.parametrize("args, message", [
    (["--families", "small,nope"], "--families: unknown nope; valid: small, swa, mla, hybrid"),
    (["--families", ","], "--families: name at least one of"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--rates", "1,x"], "--rates: not a comma-separated list"),
])
def test_bad_engine_bench_input_is_one_line(args, message):
    proc = _bench("--kv", "engine", *args, "--json", timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]

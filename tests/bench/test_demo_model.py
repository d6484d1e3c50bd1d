"""``kvtier demo --model DIR`` / ``--variant`` (issue 26 item 7): argument checks (no engine), the
JSON's bookkeeping (stored bytes per document beside item 1's formula, extended for recurrent
state; first generated tokens against vLLM alone's), and small engine runs of ``--variant swa``
and ``--variant hybrid`` (recurrent state stored and restored by the connector) with ``--json``."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from kvtier.bench import offload
from kvtier.bench.offload import Setting
from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.plan import kv_shape

GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 64, "hidden_size": 512, "sliding_window": 1024, "torch_dtype": "bfloat16", "vocab_size": 32000,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
QWEN3_NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 1024, "torch_dtype": "bfloat16",
              "layer_types": ["linear_attention", "full_attention"] * 4, "linear_num_key_heads": 4,
              "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 32,
              "linear_conv_kernel_dim": 3}
# the random families of kvtier.bench.models as their config.json states them (plan reads these keys)
QWEN3NEXT_GDN = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 64, "hidden_size": 256, "torch_dtype": "bfloat16", "vocab_size": 32000,
                 "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                 "linear_conv_kernel_dim": 4}
NEMOTRONH_MAMBA2 = {"model_type": "nemotron_h", "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256, "torch_dtype": "bfloat16",
                    "vocab_size": 32000, "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
                    "mamba_num_heads": 8, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 1, "conv_kernel": 4,
                    "expand": 2}


def _model_dir(tmp_path, config: dict | None = GEMMA3, weights: bool = True, name: str = "m"):
    d = tmp_path / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if weights:
        (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return d


def _demo(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["demo", *argv])
    return rc, capsys.readouterr().err.strip()


# -- argument checks (no engine) ----------------------------------------------------------------
@pytest.mark.parametrize("case, expected", [
    ("missing", "not a directory"),
    ("no-config", "not a model directory (no config.json)"),
    ("no-weights", "no *.safetensors weights"),
])
def test_a_model_directory_vllm_cannot_load_is_one_line(tmp_path, capsys, case, expected):
    path = {"missing": lambda: tmp_path / "nope", "no-config": lambda: _model_dir(tmp_path, config=None),
            "no-weights": lambda: _model_dir(tmp_path, weights=False)}[case]()
    rc, err = _demo(capsys, "--model", str(path), "--json")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--model {path}" in err and expected in err, err


def test_a_config_that_is_not_json_is_one_line(tmp_path, capsys):
    d = _model_dir(tmp_path)
    (d / "config.json").write_text("{not json")
    rc, err = _demo(capsys, "--model", str(d))
    assert rc == 2 and len(err.splitlines()) == 1 and "not a JSON model config" in err, err


def test_hybrid_variant_and_recurrent_models_are_offered_not_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hybrid: Qwen3-Next shape: 4 layers, 3 gated delta net : 1 full attention" in out
    assert "recurrent state (Mamba2, gated delta net) runs with the connector" in out
    assert "engine steps of one block" in out and "refuses" not in out
    assert not hasattr(offload, "REFUSED_VARIANTS") and not hasattr(offload, "_refuse_recurrent")


@pytest.mark.parametrize("config, chunk, valid", [
    (QWEN3NEXT_GDN, "128", 256),  # the state page (fp32) is larger than a 128-token attention page
    (NEMOTRONH_MAMBA2, "256", 384),
    (QWEN3_NEXT, "256", 128),  # another shape: its 128-token attention page already holds the state
])
def test_chunk_tokens_other_than_the_block_on_a_recurrent_model_is_one_line(tmp_path, capsys, config, chunk, valid):
    d = _model_dir(tmp_path, config)
    t0 = time.monotonic()
    rc, err = _demo(capsys, "--model", str(d), "--chunk-tokens", chunk, "--json")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--chunk-tokens {chunk}" in err and "recurrent-state layers" in err and f"valid: {valid} " in err, err
    assert time.monotonic() - t0 < 5  # refused before any engine starts
    shape = offload._shape(str(d), config)
    assert offload.check_chunk_tokens(shape, valid, None, "m") == valid == offload.check_chunk_tokens(shape, valid, valid, "m")
    assert offload.check_chunk_tokens(kv_shape(GEMMA3), 128, 512, "m") == 512  # no state: any chunk


def test_a_pool_too_small_for_one_document_counts_the_raised_block(tmp_path, capsys):
    d = _model_dir(tmp_path, NEMOTRONH_MAMBA2)
    # 2,048 tokens hold 16 blocks of 128 (enough for 1,536 + 64 tokens) but only 5 of 384, one kept back
    rc, err = _demo(capsys, "--model", str(d), "--tokens", "1536", "--pool-tokens", "2048")
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "cannot hold one document of 1536 tokens" in err and "384-token blocks" in err, err
    assert "use at least 2304" in err, err  # (ceil(1,600 / 384) + 1) x 384
    offload.check_pool(2304, 1536, 384)
    offload.check_pool(1792, 1536, 128)
    with pytest.raises(ConfigError, match="use at least 1792"):
        offload.check_pool(1664, 1536, 128)


def test_recurrent_models_get_the_block_vllm_raises_to_and_the_mamba2_workaround():
    gdn, mamba2 = offload._shape("m", QWEN3NEXT_GDN), offload._shape("m", NEMOTRONH_MAMBA2)
    # the blocks vLLM 0.32 logs for these families ("Setting attention block size to N tokens",
    # tests/integration/test_hybrid_engine.py), fp32 SSM state as the demo runs it
    assert offload.engine_block_tokens(gdn) == 256 and offload.engine_block_tokens(mamba2) == 384
    assert offload.engine_block_tokens(kv_shape(GEMMA3)) == 128
    assert offload.engine_args(gdn, 256) == {"block_size": 256, "mamba_ssm_cache_dtype": "float32"}
    assert offload.engine_args(mamba2, 384) == {"block_size": 384, "mamba_ssm_cache_dtype": "float32",
                                                "max_num_batched_tokens": 384}  # steps of one block
    assert offload.engine_args(kv_shape(GEMMA3), 128) == {}
    # the pool: pool_tokens / block blocks per full-attention group, a few blocks per state group
    assert offload.kv_cache_groups(gdn) == 4 and offload.kv_cache_groups(gdn, state=True) == 3
    assert offload.kv_cache_groups(gdn, state=False) == 1
    assert offload.pool_blocks(gdn, 2048, 256, 1536) == 8 + 3 * offload.STATE_BLOCKS_PER_GROUP
    # per window group: its window's blocks (+1) for each document the full group holds, and the
    # rest of one request's worst case (a document's blocks + 1, as vLLM sizes a window group);
    # documents no longer than the window keep every block; and vLLM's null block
    assert offload.pool_blocks(kv_shape(GEMMA3), 1792, 128, 400) == 14 + 5 * (4 * 4 + 1) + 1
    gemma = offload.pool_blocks(kv_shape(GEMMA3), 21504, 128, 5000)
    assert gemma == 168 + 5 * (4 * 9 + 41 - 9) + 1
    # the defaults' 10 documents (40 full blocks + 5 windows of 9 blocks each at rest) do not fit:
    # vLLM alone loses them before they come back, as with a dense model
    assert 5 * (40 + 5 * 9) < gemma < 10 * (40 + 5 * 9)
    assert offload.kv_cache_groups(kv_shape(GEMMA3), state=True) == 0


def test_state_is_counted_once_per_document_at_the_prompts_last_boundary():
    assert offload.state_boundaries(1536, 256) == 1  # stored at 1,280 (measured: not at 1,536)
    assert offload.state_boundaries(2310, 256) == 1
    assert offload.state_boundaries(256, 256) == 0  # a re-read resumes at 0 tokens: nothing to store
def test_unknown_variant_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--variant", "moe"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "small" in err and "kv-heavy" in err and "swa" in err and "mla" in err and "hybrid" in err


@pytest.mark.parametrize("value", ["0", "65"])
def test_compare_tokens_out_of_range_is_one_line(tmp_path, capsys, value):
    rc, err = _demo(capsys, "--model", str(_model_dir(tmp_path)), "--compare-tokens", value)
    assert rc == 2 and "--compare-tokens must be 1..64" in err, err


def test_a_model_directory_is_accepted_and_its_tokenizer_noticed(tmp_path):
    d = _model_dir(tmp_path)
    assert offload.check_model_dir(str(d)) == str(d)
    assert not offload.has_tokenizer(str(d))
    (d / "tokenizer.json").write_text("{}")
    assert offload.has_tokenizer(str(d))


# -- sizes -------------------------------------------------------------------------------------
def test_documents_stay_inside_a_small_vocabulary_and_are_unchanged_for_a_large_one():
    docs, warmup, hits = offload._documents(2, 300, vocab=500)
    ids = [t for doc in docs + hits + [warmup] for t in doc]
    assert max(ids) < 500 and min(ids) >= 0
    rng = np.random.default_rng(20261007)  # the sequence the demo drew before vocabularies were read
    assert offload._documents(1, 300)[0][0] == rng.integers(100, 31000, 300).tolist()
    assert offload._vocab_size({"text_config": {"vocab_size": 262_144}}) == 262_144
    assert offload._vocab_size({}) == 32000


def _spec_groups(counts: dict[str, int]) -> int:
    """vLLM 0.32's own KV cache grouping of layers of these kinds (uniform page size)."""
    import torch
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from vllm.v1.kv_cache_interface import MambaSpec

    common = dict(block_size=128, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    page = FullAttentionSpec(**common).page_size_bytes
    make = {"full_attention": lambda: FullAttentionSpec(**common),
            "linear_attention": lambda: MambaSpec(block_size=128, shapes=((512, 3), (4, 64, 64)),
                                                  dtypes=(torch.bfloat16, torch.float32), page_size_padded=page),
            "sliding_attention": lambda: SlidingWindowSpec(sliding_window=1024, **common),
            "chunked_attention": lambda: ChunkedLocalAttentionSpec(attention_chunk_size=2048, **common)}
    specs = {f"layers.{kind}.{i}": make[kind]() for kind, n in counts.items() for i in range(n)}
    return len(_get_kv_cache_groups_uniform_page_size(specs))


@pytest.mark.parametrize("counts", [
    {"full_attention": 8},
    {"linear_attention": 3, "full_attention": 1},  # recurrent state layers are grouped too
    {"linear_attention": 6, "full_attention": 2},
    {"linear_attention": 5, "full_attention": 4},
    {"sliding_attention": 5, "full_attention": 1},
    {"sliding_attention": 10, "full_attention": 2},
    {"sliding_attention": 6, "full_attention": 2},
    {"sliding_attention": 12, "full_attention": 13},  # gpt-oss + drafter: the larger count is the group size
    {"sliding_attention": 7, "full_attention": 2},  # padding: ceil(7 / 2) groups
    {"chunked_attention": 9, "full_attention": 3},
])
def test_kv_cache_groups_match_vllms_own_grouping(counts):
    pytest.importorskip("vllm")
    types = [kind for kind, n in counts.items() for _ in range(n)]
    config = {**GEMMA3, "num_hidden_layers": len(types), "layer_types": types, "attention_chunk_size": 2048}
    if "linear_attention" in counts:
        config = {**QWEN3NEXT_GDN, "num_hidden_layers": len(types), "layer_types": types}
    assert offload.kv_cache_groups(kv_shape(config)) == _spec_groups(counts)


def test_model_summary_states_item_1s_formula_at_the_stored_prefix(tmp_path):
    d = _model_dir(tmp_path)
    shape = kv_shape(GEMMA3)
    summary = offload.model_summary(str(d), GEMMA3, shape, 1920, "swa")
    per_layer_token = 2 * 4 * 64 * 2
    assert summary["formula_bytes"] == (1 * 1920 + 5 * 1024) * per_layer_token  # full x prefix + window x window
    assert summary["kv_cache_groups"] == 6 and summary["tokenizer"] is False and summary["prompts"] == "token ids"
    assert "5 sliding layers x min(tokens, 1,024)" in summary["formula"] and summary["model_type"] == "gemma3_text"
    assert offload.model_summary(str(d), GEMMA3, shape, 512, None)["formula_bytes"] == 6 * 512 * per_layer_token
    assert summary["state_bytes_per_boundary"] == 0 and summary["state_boundaries"] == 0


def test_model_summary_extends_the_formula_with_state_bytes_per_stored_boundary(tmp_path):
    d = _model_dir(tmp_path, QWEN3NEXT_GDN)
    shape = offload._shape(str(d), QWEN3NEXT_GDN)
    summary = offload.model_summary(str(d), QWEN3NEXT_GDN, shape, 1536, "hybrid", boundaries=1, block_tokens=256,
                                    chunk_tokens=256, engine_args=offload.engine_args(shape, 256))
    # kvtier kv-size's state per sequence: 3 layers x (conv 3 x (2 x 2 x 64 + 4 x 64) x 2 B + 4 x 64 x 64 x 4 B)
    state = 3 * (3 * 512 * 2 + 4 * 64 * 64 * 4)
    assert summary["state_bytes_per_boundary"] == state == 205_824 and summary["state_boundaries"] == 1
    assert summary["attention_bytes"] == 1536 * 2 * 2 * 64 * 2  # 1 full layer x prefix
    assert summary["formula_bytes"] == summary["attention_bytes"] + state
    assert "1 stored boundary x 3 gated delta net layers" in summary["formula"], summary["formula"]
    assert summary["kv_cache_groups"] == 4 and summary["state_cache_groups"] == 3 and summary["block_tokens"] == 256
    assert summary["engine_args"]["mamba_ssm_cache_dtype"] == "float32"
    two = offload.model_summary(str(d), QWEN3NEXT_GDN, shape, 1536, None, boundaries=2)
    assert two["formula_bytes"] == summary["attention_bytes"] + 2 * state and "2 stored boundaries x" in two["formula"]


# -- the JSON's bookkeeping --------------------------------------------------------------------
def _req(doc: int, tokens: list[int], ttft: float = 10.0) -> dict:
    return {"doc": doc, "token_ids": tokens, "ttft_ms": ttft, "hit_tokens": 0, "local_hit_tokens": 0,
            "query_tokens": 100, "logprobs": {}}


def test_the_formula_counts_the_whole_chunks_the_engine_computed():
    assert offload.stored_tokens(2048, 16, 128) == 2048  # the prompt's 16th chunk is whole
    assert offload.stored_tokens(2047, 1, 128) == 1920
    assert offload.stored_tokens(5000, 16, 128) == 4992  # 5,015 computed tokens: 39 whole chunks


def test_stored_bytes_per_document_come_from_the_first_pass_counters_beside_the_formula():
    before = {"saved_bytes": 4096, "saved_chunks": 4, "tier_written_bytes": {"ram": 4096}}
    after = {"saved_bytes": 4096 + 3 * 7000, "saved_chunks": 4 + 30,
             "tier_written_bytes": {"ram": 4096 + 3 * 7000, "disk": 3 * 7100}}
    delta = offload._counter_delta(before, after)
    assert delta == {"saved_bytes": 21000, "saved_chunks": 30, "tier_written_bytes": {"ram": 21000, "disk": 21300}}
    kv = Setting("kvtier-ram", offload._kvtier([], None), result={"passes": {}, "stored": delta})
    alone = Setting("vllm", None, result={"passes": {}})
    out = offload.stored_bytes([alone, kv], 3, 7000)
    assert list(out) == ["kvtier-ram"]  # vLLM alone stores nothing: no row
    row = out["kvtier-ram"]
    assert row["per_document_bytes"] == 7000 and row["formula_per_document_bytes"] == 7000
    assert row["ratio_to_formula"] == 1.0 and row["saved_chunks"] == 30
    assert row["tier_written_per_document_bytes"] == {"ram": 7000, "disk": 7100}
    assert offload._is_kvtier(kv) and not offload._is_kvtier(alone)
    assert not offload._is_kvtier(Setting("example-connector", {"kv_connector": "ExampleConnector"}))


def test_first_tokens_are_compared_per_document_with_the_equal_prefix():
    alone = Setting("vllm", None, result={"passes": {
        "first": [_req(0, [1, 2, 3, 4]), _req(1, [5, 6, 7, 8])],
        "again": [_req(0, [1, 2, 3, 4]), _req(1, [5, 6, 7, 8])]}})
    kv = Setting("kvtier-ram", offload._kvtier([], None), result={"passes": {
        "first": [_req(0, [1, 2, 3, 4]), _req(1, [5, 6, 7, 8])],
        "again": [_req(0, [1, 2, 9, 9]), _req(1, [5, 6, 7, 8])]}})
    out = offload.first_tokens([alone, kv], 4)
    assert out["compare_tokens"] == 4 and out["reference"] == "vllm/first"
    assert "vllm/first" not in out["settings"] and out["settings"]["vllm/again"]["equal"] == "2/2"
    again = out["settings"]["kvtier-ram/again"]
    assert again["equal"] == "1/2"
    assert again["docs"][0] == {"doc": 0, "equal": False, "equal_prefix": 2, "tokens": 4}
    assert again["docs"][1] == {"doc": 1, "equal": True, "equal_prefix": 4, "tokens": 4}
    assert offload.first_tokens([kv], 4) == {"compare_tokens": 4, "reference": None, "settings": {}}
    report = offload._report([alone, kv], 1 << 20, 1 << 19, 2.0)
    json.dumps(report)  # the rest of the report still builds from these results


def test_first_rounds_are_ratios_of_medians_round_by_round(capsys):
    """``--first-rounds``: per round the setting's median first-pass TTFT over vLLM alone's of
    the same round, then their median, min and max (a round's noise stays in its own ratio)."""
    def first(ttfts_by_round):
        return [{"doc": 10 * r + i, "round": r, "ttft_ms": t, "token_ids": []}
                for r, ttfts in enumerate(ttfts_by_round) for i, t in enumerate(ttfts)]

    alone = Setting("vllm", None, result={"passes": {"first": first([[100, 100, 300], [200, 200, 200], [50, 50, 50]])}})
    kv = Setting("kvtier-ram", offload._kvtier([], None),
                 result={"passes": {"first": first([[110, 90, 105], [200, 220, 210], [50, 60, 40]])}})
    out = offload.first_rounds([alone, kv])
    assert out["rounds"] == 3
    # medians 105 / 100, 210 / 200, 50 / 50
    assert out["settings"]["kvtier-ram"] == {"ratios": [1.05, 1.05, 1.0], "median": 1.05, "min": 1.0, "max": 1.05}
    assert offload.first_rounds([kv]) == {}
    assert main(["demo", "--first-rounds", "0"]) == 2  # one line, before any engine or model
    assert "--first-rounds must be 1..100" in capsys.readouterr().err


def test_own_hits_pair_each_re_read_with_the_same_engines_hit_asked_right_after_it():
    """The re-read beside its own engine's hit of the same document: per document the ratio, then
    the median, min and max; a pair counts only for a re-read from the connector followed by a
    whole local hit (a recompute, a re-read vLLM's own pool served, or a second ask that was not a
    full local hit is no pair). vLLM alone reports its own hits with no ratio."""
    def again(ttft, hit, local, own_ttft, own_hit, own_local):
        return {"doc": 0, "ttft_ms": ttft, "hit_tokens": hit, "local_hit_tokens": local, "token_ids": [],
                "own_hit": {"ttft_ms": own_ttft, "hit_tokens": own_hit, "local_hit_tokens": own_local}}

    kv = Setting("kvtier-ram", offload._kvtier([], None), result={"passes": {"again": [
        again(24, 4992, 0, 20, 0, 4992),      # 1.2
        again(30, 4992, 0, 20, 0, 4992),      # 1.5
        again(11, 4864, 128, 10, 0, 4992),    # 1.1 (part of it still in vLLM's pool)
        again(12, 0, 4992, 10, 0, 4992),      # vLLM's own pool served the re-read: no pair
        again(500, 0, 0, 20, 0, 4992),        # recomputed: no pair
        again(25, 4992, 0, 26, 4992, 0),      # the second ask came from the connector too: no pair
        again(25, 4992, 0, 26, 0, 2048),      # the second ask found less than the re-read: no pair
    ]}})
    alone = Setting("vllm", None, result={"passes": {"again": [again(600, 0, 0, 18, 0, 4992),
                                                               again(610, 0, 0, 22, 0, 4992)]}})
    out = offload.own_hits([alone, kv])
    assert out["vllm"] == {"own_hit_p50_ms": 20, "own_hits": 2, "pairs": 0}
    row = out["kvtier-ram"]
    assert row["pairs"] == 3 and row["ratios"] == [1.2, 1.5, 1.1]
    assert (row["median"], row["min"], row["max"], row["reread_p50_ms"]) == (1.2, 1.1, 1.5, 24)
    assert row["own_hits"] == 5  # every whole local hit, paired or not
    targets = {t["target"]: t for t in offload._targets({}, [], float("nan"), None, out)}
    met = targets["kvtier-ram re-read / its engine's own hit, paired per document"]
    assert met["value"] == 1.2 and met["met"] is True
    assert offload.own_hits([Setting("x", None, result={"passes": {"first": []}})]) == {}


# -- one small engine run per family ----------------------------------------------------------
def _tiny_demo(tmp_path, capsys, variant: str, pool_tokens: int):
    """``kvtier demo --variant VARIANT --json`` with 2 documents of 1,536 tokens, vLLM alone beside
    a RAM tier, engines eager; prints its figures (times and token equality are printed, not
    asserted) and returns (report, rows by (setting, pass), first_tokens' settings, the RAM
    setting's stored bytes)."""
    rc = main(["demo", "--variant", variant, "--json", "--docs", "2", "--tokens", "1536", "--pool-tokens",
               str(pool_tokens), "--settings", "vllm,kvtier-ram", "--capacity-fractions", "", "--compare-tokens", "16",
               "--max-engines", "2", "--settle-ms", "500", "--enforce-eager", "--work-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    report = json.loads(captured.out)
    rows = {(r["setting"], r["pass"]): r for r in report["rows"]}
    first = report["first_tokens"]["settings"]
    stored = report["stored_bytes"]["kvtier-ram"]
    with capsys.disabled():
        print(json.dumps({"ttft_p50_ms": {f"{s}/{p}": round(r["ttft_p50_ms"], 1) for (s, p), r in rows.items()},
                          "engine_hit_ms": report["engine_hit_ttft_p50_ms"], "stored": stored,
                          "hit_tokens": {f"{s}/{p}": f"{r['hit_tokens']}+{r['local_hit_tokens']} local/{r['query_tokens']}"
                                         for (s, p), r in rows.items()},
                          "first_tokens": {k: v["equal"] for k, v in first.items()},
                          "equal_prefix": {k: [d["equal_prefix"] for d in v["docs"]] for k, v in first.items()}}))
    return report, rows, first, stored


@pytest.mark.vllm
def test_demo_variant_swa_json_on_a_real_engine(tmp_path, capsys):
    """``kvtier demo --variant swa --json``, tiny: 2 documents of 1,536 tokens (past the 1,024-token
    window) through a pool of 1,792 tokens per KV cache group (one document), vLLM alone beside a
    RAM tier, engines eager. Checked: the figures are there and consistent (stored bytes within
    1.1 x the formula at the stored token count, the re-read loads every whole chunk but the
    last token's, every request generated --compare-tokens tokens); token equality and times
    are printed, not asserted (near-ties on random weights; a loaded machine)."""
    report, rows, first, stored = _tiny_demo(tmp_path, capsys, "swa", 1792)
    model = report["model"]
    assert model["variant"] == "swa" and model["model_type"] == "gemma3_text" and model["kv_cache_groups"] == 6
    assert model["stored_prefix_tokens"] == 1536  # 1,536 + 16 - 1 computed tokens: 12 whole chunks
    assert stored["formula_per_document_bytes"] == model["formula_bytes"]
    assert 0.99 <= stored["ratio_to_formula"] <= 1.1, stored
    again = rows[("kvtier-ram", "again")]
    # (1,536 - 1) // 128 chunks of each document: vLLM computes the last token. What vLLM's own pool
    # kept (its window groups hold less) is a local hit, the rest comes from kvtier
    assert again["hit_tokens"] + again["local_hit_tokens"] == 2 * 1408, again
    assert again["hit_tokens"] >= 1408, again
    assert set(first) >= {"kvtier-ram/first", "kvtier-ram/again", "vllm/again"}
    assert all(d["tokens"] == 16 for row in first.values() for d in row["docs"])


@pytest.mark.vllm
def test_demo_variant_hybrid_json_on_a_real_engine(tmp_path, capsys):
    """``kvtier demo --variant hybrid --json``, tiny: the Qwen3-Next-like model (3 gated delta net
    : 1 full attention; vLLM raises its block to 256 tokens to fit the fp32 state page), 2
    documents of 1,536 tokens through a pool of 2,048 tokens (one document), vLLM alone beside
    a RAM tier, engines eager. Checked: the connector stores and restores the recurrent state
    (the re-read resumes at the prompt's last chunk boundary, 1,280 tokens, where only a stored
    state lets it), the stored bytes are item 1's formula with the state once per document
    (within 1.1 x), every request generated --compare-tokens tokens; token equality and times
    are printed, not asserted (near-ties on random weights; a loaded machine)."""
    report, rows, first, stored = _tiny_demo(tmp_path, capsys, "hybrid", 2048)
    model = report["model"]
    assert model["variant"] == "hybrid" and model["model_type"] == "qwen3_next"
    assert model["block_tokens"] == model["chunk_tokens"] == 256 and model["kv_cache_groups"] == 4
    assert model["state_cache_groups"] == 3 and model["state_boundaries"] == 1 and model["state_bytes_per_boundary"] > 0
    assert model["stored_prefix_tokens"] == 1536  # 1,536 + 16 - 1 computed tokens: 6 whole chunks
    assert stored["formula_per_document_bytes"] == model["formula_bytes"]
    assert 0.99 <= stored["ratio_to_formula"] <= 1.1, stored
    again = rows[("kvtier-ram", "again")]
    # a re-read resumes at (1,536 - 1) // 256 chunks = 1,280 tokens at most, and only with the three
    # state groups' states at that boundary: an external hit is the connector's restored state.
    # Both documents: the RAM tier is sized on their arena pages (a state entry takes a whole page)
    assert model["ram_working_set_bytes"] > 2 * model["formula_bytes"]
    assert again["hit_tokens"] == 2 * 1280 and again["local_hit_tokens"] == 0, again
    assert set(first) >= {"kvtier-ram/first", "kvtier-ram/again", "vllm/again"}
    assert all(d["tokens"] == 16 for row in first.values() for d in row["docs"])


def test_fs_codec_settings_put_ram_over_an_fs_tier_with_each_codec(tmp_path):
    from kvtier.integrations.vllm.config import ConnectorConfig

    codecs = {**offload.FS_CODEC_SETTINGS, **offload.FS_DIRECT_SETTINGS}
    names = list(codecs)
    settings = offload._settings(names, [], 10 << 20, tmp_path, None)
    assert [s.name for s in settings] == names
    paths = set()
    for setting in settings:
        extra = setting.kv_transfer_config["kv_connector_extra_config"]
        ram, fs = extra["tiers"]
        assert ram["type"] == "ram" and fs["type"] == "fs" and fs["codec"] == codecs[setting.name]
        assert fs["o_direct"] == setting.name.endswith("-direct")
        tier = ConnectorConfig.from_extra_config(extra).store.tiers[1].config  # a valid config
        assert (tier.codec, tier.o_direct) == (fs["codec"], fs["o_direct"])
        paths.add(fs["path"])
    assert len(paths) == len(names)  # no two settings share a directory
    with pytest.raises(ConfigError, match="kvtier-ram\\+fs-lossless"):  # the valid choices, in one line
        offload._parse_settings("vllm,kvtier-ram+fs-zip")


def test_the_serve_setting_runs_the_connector_over_a_kvtier_serve_process_it_starts(tmp_path):
    """``kvtier-serve``: the connector keeps no tiers and names a server socket; the demo starts
    a real ``kvtier serve`` with an arena as large as kvtier-ram's tier on exactly that socket
    (a client reaches it there and stores a chunk in batches), and stops it after."""
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.server import ServerStore

    names = ["kvtier-ram", "kvtier-serve", "kvtier-serve-async"]
    assert offload._parse_settings(",".join(names)) == names
    settings = {s.name: s for s in offload._settings(names, [], 10 << 20, tmp_path, None)}
    ram = settings["kvtier-ram"].kv_transfer_config["kv_connector_extra_config"]["tiers"][0]["capacity"]
    addresses = set()
    for name in ("kvtier-serve", "kvtier-serve-async"):
        setting = settings[name]
        extra = setting.kv_transfer_config["kv_connector_extra_config"]
        config = ConnectorConfig.from_extra_config(extra)
        assert "tiers" not in extra and config.server == extra["server"]
        assert config.transfer_mode == ("async" if name.endswith("-async") else "sync")
        assert setting.serve_arena_bytes == ram
        addresses.add(extra["server"])
    assert len(addresses) == 2  # each its own server
    setting = settings["kvtier-serve"]
    with offload._kvtier_serve(setting) as target:
        pid = target._child.pid
        with ServerStore(setting.kv_transfer_config["kv_connector_extra_config"]["server"]) as client:
            capacity = client.stats()["tiers"][0]["capacity_bytes"]
            assert setting.serve_arena_bytes - 256 * 1024 < capacity <= setting.serve_arena_bytes  # whole pages
            assert client.put_many([(bytes([i]) * 32, bytes([i]) * 4096) for i in range(3)]) == [True] * 3
            assert client.stats()["server"]["direct_batches"] == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_async_settings_are_the_same_tiers_in_transfer_mode_async_with_their_own_directories(tmp_path):
    from kvtier.integrations.vllm.config import ConnectorConfig

    names = ["kvtier-ram", "kvtier-ram-async", "kvtier-ram+disk", "kvtier-ram+disk-async", "kvtier-ram+fs-lossless-async"]
    assert offload._parse_settings(",".join(names)) == names
    settings = {s.name: s for s in offload._settings(names, [], 10 << 20, tmp_path, None)}
    assert set(settings) == set(names)
    for name in names:
        extra = settings[name].kv_transfer_config["kv_connector_extra_config"]
        mode = ConnectorConfig.from_extra_config(extra).transfer_mode
        assert mode == ("async" if name.endswith("-async") else "sync"), name
        sync = settings.get(name.removesuffix("-async"))
        if sync is not None and sync is not settings[name]:  # the same tiers, another directory
            twin = sync.kv_transfer_config["kv_connector_extra_config"]["tiers"]
            tiers = extra["tiers"]
            assert [t["type"] for t in tiers] == [t["type"] for t in twin]
            assert all(a.get("path") != b.get("path") for a, b in zip(tiers, twin) if "path" in a)
    for bad in ("vllm-async", "example-connector-async", "kvtier-ram-async-async", "kvtier-ram-asyn"):
        with pytest.raises(ConfigError, match="-async"):
            offload._parse_settings(bad)


def test_idle_settings_are_the_same_tiers_with_their_writers_under_sched_idle(tmp_path):
    """``-idle`` (before ``-async``) on any kvtier setting, a Redis one too: the store's
    ``writer_idle``, its own directories; a wrong order or a non-kvtier setting is refused."""
    from kvtier.integrations.vllm.config import ConnectorConfig

    names = ["kvtier-ram+disk", "kvtier-ram+disk-idle", "kvtier-ram+disk-idle-async", "kvtier-ram+fs-lossless-idle"]
    assert offload._parse_settings(",".join(names)) == names
    settings = {s.name: s for s in offload._settings(names, [], 10 << 20, tmp_path, None)}
    assert set(settings) == set(names)
    paths = set()
    for name in names:
        extra = settings[name].kv_transfer_config["kv_connector_extra_config"]
        config = ConnectorConfig.from_extra_config(extra)
        assert config.store.writer_idle == ("-idle" in name) and config.store.writer_nice == 0, name
        assert config.transfer_mode == ("async" if name.endswith("-async") else "sync"), name
        paths.add(extra["tiers"][1]["path"])
    assert len(paths) == len(names)  # each setting's own directory
    assert offload.SHARED_SETTING.fullmatch("kvtier-ram+redis-1g-lossless-idle-async")
    for bad in ("vllm-idle", "kvtier-ram+disk-async-idle", "kvtier-ram+disk-idle-idle"):
        with pytest.raises(ConfigError, match="-idle"):
            offload._parse_settings(bad)


def test_the_buffered_setting_is_ram_over_a_disk_tier_without_o_direct_in_its_own_directory(tmp_path):
    """``kvtier-ram+disk-buffered`` (and its -idle/-async forms): kvtier-ram+disk's tiers with the
    disk tier's ``o_direct`` off, each in a directory of its own; the plain setting keeps the
    tier's default (on)."""
    from kvtier.integrations.vllm.config import ConnectorConfig

    names = ["kvtier-ram+disk", "kvtier-ram+disk-buffered", "kvtier-ram+disk-buffered-idle-async"]
    assert offload._parse_settings(",".join(names)) == names
    settings = {s.name: s for s in offload._settings(names, [], 10 << 20, tmp_path, None)}
    paths = set()
    for name in names:
        extra = settings[name].kv_transfer_config["kv_connector_extra_config"]
        config = ConnectorConfig.from_extra_config(extra)
        disk = config.store.tiers[1]
        assert disk.type == "disk" and disk.config.o_direct == ("buffered" not in name), name
        paths.add(disk.config.path)
    assert len(paths) == len(names)


@pytest.mark.redis
def test_shared_settings_put_ram_over_redis_across_a_paced_link_with_each_codec(tmp_path):
    """``kvtier-ram+redis-<R>g[-codec]``: one real redis-server, a delay proxy per setting pacing
    its responses at R Gb/s; the setting's Redis tier reaches redis through it (a chunk put and
    read back bit-exact, the read no faster than the link allows), with the codec named."""
    import time

    import numpy as np

    from kvtier.integrations.vllm.config import ConnectorConfig

    names = ["kvtier-ram+redis-0.1g", "kvtier-ram+redis-10g-lossless", "kvtier-ram+redis-10g-lossless-nice"]
    assert offload._parse_settings(",".join(names)) == names
    with offload.shared_links(names) as links:
        assert set(links) == set(names) and len(set(links.values())) == 3  # a link each
        settings = offload._settings(names, [], 10 << 20, tmp_path, None, links)
        for setting, codec, nice in zip(settings, ("none", "lossless", "lossless"), (0, 0, offload.NICE_WRITERS)):
            extra = setting.kv_transfer_config["kv_connector_extra_config"]
            ram, redis = extra["tiers"]
            assert ram["type"] == "ram" and redis["type"] == "redis" and redis["codec"] == codec
            assert redis["url"] == links[setting.name]
            assert ConnectorConfig.from_extra_config(extra).store.writer_nice == nice
        tier_spec = ConnectorConfig.from_extra_config(
            settings[0].kv_transfer_config["kv_connector_extra_config"]).store.tiers[1]
        chunk = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        with tier_spec.build() as tier:
            assert tier.put(b"\x01" * 32, chunk)
            out = np.empty_like(chunk)
            start = time.monotonic()
            assert tier.get_into(b"\x01" * 32, out) == chunk.nbytes and np.array_equal(out, chunk)
            assert time.monotonic() - start >= 0.9 * chunk.nbytes / (0.1e9 / 8)  # 1 MiB at 0.1 Gb/s: 84 ms
    for bad in ("kvtier-ram+redis-0g", "kvtier-ram+redis-1g-zip", "kvtier-ram+redis-1g,kvtier-ram+redis-1g",
                "kvtier-ram+redis-1g-nice-lossless"):
        with pytest.raises(ConfigError, match="setting"):
            offload._parse_settings(bad)


def test_the_ram_tier_is_sized_on_arena_pages_where_state_entries_round_up():
    """A recurrent layer's state (smaller than the attention page vLLM pads it to) takes whole
    arena pages: the RAM working set adds that padding per stored boundary and layer; models
    without state take exactly the formula's bytes."""
    for config in (GEMMA3, QWEN3_NEXT):
        shape = kv_shape(config)
        block = offload.engine_block_tokens(shape)
        page = block * max(k.bytes_per_token for k in shape.kinds if k.bytes_per_token)
        states = [k for k in shape.kinds if k.state_bytes]
        for boundaries in (0, 1, 3):
            got = offload.ram_bytes_per_document(shape, block, 10 << 20, boundaries)
            padding = sum(k.layers * (-(-k.state_bytes // page) * page - k.state_bytes) for k in states)
            assert got == (10 << 20) + boundaries * padding
            assert (got > 10 << 20) == bool(states and boundaries)
        for k in states:  # each layer's state plus its padding is whole pages
            assert 0 < k.state_bytes <= page and (k.state_bytes + (page - k.state_bytes % page) % page) % page == 0


def test_first_pairs_compare_storing_with_not_storing_in_the_same_engine(capsys):
    """``--first-pairs``: per pair of fresh documents, the TTFT of the one stored over the one
    with ``kvtier.skip_save``; a pair with any hit (not fresh) or missing a side is left out."""
    def probe(pair, skip, ttft, hit=0, local=0):
        return {"pair": pair, "skip_save": skip, "ttft_ms": ttft, "hit_tokens": hit, "local_hit_tokens": local}

    kv = Setting("kvtier-ram", offload._kvtier([], None), result={"first_pairs": [
        probe(0, True, 100), probe(0, False, 103),
        probe(1, False, 220), probe(1, True, 200),   # the order alternated
        probe(2, True, 100), probe(2, False, 90, hit=128),  # a hit: left out
        probe(3, True, 100),  # no partner: left out
    ]})
    out = offload.first_pairs([Setting("vllm", None, result={"passes": {}}), kv])
    row = out["kvtier-ram"]
    assert list(out) == ["kvtier-ram"]
    assert row["pairs"] == 2 and row["with_hits"] == 1 and row["ratios"] == [1.03, 1.1]
    assert (row["median"], row["min"], row["max"]) == (1.065, 1.03, 1.1)
    assert main(["demo", "--first-pairs", "-1"]) == 2  # one line, before any engine or model
    assert "--first-pairs must be 0..100" in capsys.readouterr().err


def test_probe_documents_are_fresh_and_reproducible():
    docs, _, hit_docs = offload._documents(10, 300, 32000)
    probes = offload._probe_documents(6, 300, 32000)
    assert probes == offload._probe_documents(6, 300, 32000) and len(probes) == 6
    assert all(len(p) == 300 and max(p) < 31000 for p in probes)
    assert not {tuple(p) for p in probes} & {tuple(d) for d in docs + hit_docs}

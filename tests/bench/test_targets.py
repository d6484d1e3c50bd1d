"""kvtier.bench.targets: one table of the issues' targets, checked by the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench import offload, targets
from kvtier.bench.targets import TARGETS, IssueTarget, evaluate


def test_keys_are_unique_per_benchmark_and_every_row_is_well_formed():
    keys = [(t.benchmark, t.key) for t in TARGETS]
    assert len(keys) == len(set(keys))
    assert {t.benchmark for t in TARGETS} == {"tiers", "offload", "load", "serve"}
    for t in TARGETS:
        assert t.issue > 0 and t.name and t.numerator


def test_bad_comparison_is_refused():
    with pytest.raises(ValueError):
        IssueTarget(1, "x", "k", "n", "a", comparison="==")


def test_missing_or_zero_measurements_are_not_run():
    assert evaluate("tiers", {}) == []
    assert evaluate("tiers", {"gbps:ram/get/4MiB": 5.0, "gbps:memcpy/get/4MiB": 0.0}) == []


def test_tiers_targets_bind_each_size_and_op():
    rows = evaluate("tiers", {"gbps:ram/get/4MiB": 7.0, "gbps:memcpy/get/4MiB": 10.0,
                              "gbps:redis/put/2MiB": 1.0, "gbps:redis-py-loop/put/2MiB": 2.0})
    by = {r["target"]: r for r in rows}
    assert by["ram get 4 MiB vs memcpy"]["met"] is True and by["ram get 4 MiB vs memcpy"]["value"] == 0.7
    assert by["redis put 2 MiB vs redis-py loop"]["met"] is False
    assert by["redis put 2 MiB vs redis-py loop"]["issue"] == 5
    assert by["redis put 2 MiB vs redis-py loop"]["limit"] == ">= 0.9"


def test_offload_targets_as_the_demo_checked_them():
    p50 = {("vllm", "first"): 700.0, ("kvtier-ram", "first"): 714.0, ("vllm", "again"): 750.0,
           ("kvtier-ram", "again"): 25.0, ("kvtier-ram+disk", "again"): 40.0}
    curve = [{"capacity_fraction": 0.33, "hit_tokens": 30, "query_tokens": 100},
             {"capacity_fraction": 0.67, "hit_tokens": 50, "query_tokens": 100},
             {"capacity_fraction": 1.33, "hit_tokens": 95, "query_tokens": 100}]
    rows = {r["target"]: r for r in offload._targets(p50, curve, 20.0)}
    assert rows["kvtier-ram re-read / engine hit"]["value"] == 1.25 and rows["kvtier-ram re-read / engine hit"]["met"]
    assert rows["vLLM re-read / kvtier-ram re-read"]["met"] is True
    assert rows["kvtier-ram+disk re-read / engine hit"]["met"] is True
    assert rows["kvtier-ram first pass overhead"]["value"] == 0.02 and rows["kvtier-ram first pass overhead"]["met"]
    assert rows["capacity 0.33: hit share"]["met"] is True
    assert rows["capacity 0.67: hit share"]["met"] is False
    assert rows["capacity 1.33: hit share"]["met"] is True
    assert not any("lmcache" in name or "example" in name for name in rows)  # not run: not reported
    without_hit = [r["target"] for r in offload._targets(p50, [], float("nan"))]
    assert without_hit and not any(name.endswith("engine hit") for name in without_hit)
    assert not any("memcpy" in name for name in rows)  # no bound measured: not run
    bound = {r["target"]: r for r in offload._targets(p50, curve, 20.0, 24.0)}
    assert bound["kvtier-ram re-read / (engine hit + KV bytes / memcpy)"]["value"] == pytest.approx(25 / 24, abs=1e-3)
    assert bound["kvtier-ram re-read / (engine hit + KV bytes / memcpy)"]["met"] is True


def test_physical_bound_is_the_engine_hit_plus_a_documents_bytes_at_the_measured_copy_rate():
    gbps = offload.memcpy_gbps(64 << 20, repeats=2)
    assert 0.1 < gbps < 1000  # a plausible copy bandwidth, measured
    report = offload._report([], 10 << 30, 1 << 30, 2.0)
    assert report["physical_bound_ms"] is None  # no engine hit measured: no bound


def test_load_report_only_targets_have_no_verdict():
    rows = evaluate("load", {"gbps:kvtier/s3": 0.5, "gbps:single-stream/s3": 0.25})
    assert rows == [{"issue": 4, "target": "s3 vs single GET (report)", "metric": "gbps:kvtier/s3 / gbps:single-stream/s3",
                     "value": 2.0, "limit": "report", "met": None}]


def test_print_targets(capsys):
    targets.print_targets(evaluate("tiers", {"gbps:disk/put/4MiB": 1.0, "gbps:file/put/4MiB": 2.0}))
    out = capsys.readouterr().out
    assert "disk put 4 MiB vs file" in out and "NO" in out


def test_bench_tiers_json_carries_the_targets(tmp_path):
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "tiers", "--tiers", "memcpy,ram", "--sizes", "4MiB",
           "--total", "16MiB", "--repeat", "1", "--work-dir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert {r["target"] for r in report["targets"]} == {"ram put 4 MiB vs memcpy", "ram get 4 MiB vs memcpy"}


def test_demo_warm_up_prompt_fits_the_shortest_documents():
    """--tokens 512 once failed at engine start: the 600-token warm-up exceeded max_model_len."""
    docs, warmup, hit_docs = offload._documents(1, 300)
    assert len(warmup) == 300 and len(docs[0]) == 300 and all(len(d) == 300 for d in hit_docs)
    assert len(offload._documents(1, 5000)[1]) == 600

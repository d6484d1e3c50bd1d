"""kvtier bench store: its bookkeeping (percentiles, merging rounds, ratios, the ABBA order) on
made-up samples, and one tiny real run over an fs lower tier."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench import store as bench
from kvtier.cli.bench import BENCHMARKS


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))  # 1..100
    assert bench.percentile(values, 50) == 50.0
    assert bench.percentile(values, 99) == 99.0
    assert bench.percentile(values, 100) == 100.0
    assert bench.percentile([7], 99) == 7.0
    assert bench.percentile([], 50) is None
    assert bench.percentile([3, 1, 2], 50) == 2.0  # unsorted input


def test_summarize_merges_rounds_per_setting_and_takes_the_ratio():
    alone = [bench.Phase("alone", hit_ns=[10_000] * 99 + [100_000], deletes=3, stats_ns=[2_000_000]),
             bench.Phase("alone", hit_ns=[10_000] * 100, deletes=2)]
    slow = [bench.Phase("slow", hit_ns=[12_000] * 196 + [300_000] * 4, put_ns=[5_000], misses=1)]
    out = bench.summarize(alone + slow)
    a, s = out["settings"]["alone"], out["settings"]["slow"]
    assert (a["rounds"], a["ram_hits"], a["deletes"], a["stats_calls"]) == (2, 200, 5, 1)
    assert a["ram_hit_p50_us"] == 10.0 and a["ram_hit_p99_us"] == 10.0 and a["ram_hit_max_us"] == 100.0
    assert a["stats_p50_ms"] == 2.0 and a["puts"] == 0 and a["put_p99_us"] is None
    assert s["ram_hit_p99_us"] == 300.0 and s["misses"] == 1 and s["puts"] == 1
    assert out["p99_ratio"] == 30.0 and out["p50_ratio"] == 1.2
    assert out["meets_target"] is False and out["target_p99_ratio"] == 1.2
    assert bench.summarize(alone)["settings"].keys() == {"alone"} and "p99_ratio" not in bench.summarize(alone)


def test_rounds_alternate_abba():
    assert bench.order(1) == ["alone", "slow"]
    assert bench.order(3) == ["alone", "slow", "slow", "alone", "alone", "slow"]


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.mark.parametrize("bad, needle", [({"clients": 0}, "--clients"), ({"duration": 0}, "--duration"),
                                         ({"entry_bytes": "abc"}, "--entry-bytes")])
def test_bad_options_are_one_line_errors(bad, needle, capsys):
    assert bench.run(_args(**bad)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_a_tiny_run_over_a_crowded_fs_tier(tmp_path, capsys):
    assert BENCHMARKS["store"][0] == "kvtier.bench.store"
    args = _args(clients=2, duration=0.3, rounds=1, lower="fs", fs_entries=50, hot=8, entry_bytes="4KiB",
                 think_ms=0.5, stats_interval=0.05, work_dir=str(tmp_path))
    args.json = True
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    for setting in ("alone", "slow"):
        s = out["settings"][setting]
        assert s["ram_hits"] > 0 and s["wrong"] == 0 and s["stats_calls"] >= 2 and s["deletes"] > 0
    assert out["p99_ratio"] > 0 and out["lower"] == "fs" and out["fs_entries"] == 50
    assert list(tmp_path.iterdir()) == []  # its work directory is removed


def test_a_tiny_run_through_kvtier_serve_scrapes_its_metrics(tmp_path, capsys):
    """``--via serve``: the store is a ``kvtier serve`` process per round, each client has its
    own connection, and the scraper fetches ``/metrics`` over HTTP."""
    args = _args(clients=2, duration=0.5, rounds=1, lower="fs", fs_entries=50, hot=8, entry_bytes="4KiB",
                 think_ms=0.5, stats_interval=0.05, work_dir=str(tmp_path), via="serve")
    args.json = True
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["via"] == "serve"
    for setting in ("alone", "slow"):
        s = out["settings"][setting]
        assert s["ram_hits"] > 0 and s["wrong"] == 0 and s["stats_calls"] >= 2 and s["deletes"] > 0
    assert list(tmp_path.iterdir()) == []

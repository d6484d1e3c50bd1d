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
    _alloc,
    _prompt,
    gemma_like,
    kv_cache_config,
    request,
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return gemma_like(tmp_path_factory.mktemp("packs"))


def _prefill_and_look_up(eng, chunks: int, busy: bool = False):
    """Prefill (and save) a prompt of ``chunks`` whole chunks and one token, then look it up
    again: (its tokens, a fresh request of them, the hit in tokens, whether it loads in the
    background). ``busy``: another background load is in flight (a hit of several groups then
    loads in the background too)."""
    tokens = _prompt(chunks * CHUNK + 1)
    eng.prefill(request(tokens))
    if busy:
        eng.sched.scheduler._room.loading("elsewhere", 10**6)
    req = request(tokens)
    hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
    return tokens, req, hit, background


def _start_background(eng, req, hit):
    """Allocate as vLLM does for ``hit`` external tokens and start the background load (without
    waiting for it); the tables."""
    from kvtier.integrations.vllm.connector import KVTierMetadata

    tables = _alloc(eng, req, hit)
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
        tokens, req, hit, background = _prefill_and_look_up(eng, 8)
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
        assert not eng.work.worker._background  # no load of it left to report: a later call is final
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
        tokens, req, hit, background = _prefill_and_look_up(eng, 12, busy=True)
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

        blocked = threading.Event()  # the writer has reached a full pack's entry

        def slow_full(key, *args, **kwargs):  # a full pack's entry takes a while to write
            if key in full_keys:
                blocked.set()
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
        assert blocked.wait(30)  # what the writer wrote before the full pack's entry is in the events

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


# --------------------------------------------------------------------------- entries of another size


def _entry_size(store, key):
    """The bytes of ``key``'s entry (None: absent)."""
    from kvtier.buffers import total_bytes

    sizes = []
    return sizes[0] if store.read(key, lambda segs: sizes.append(total_bytes(segs))) else None


def test_a_pack_entry_of_another_size_heals_once_the_prefix_is_saved_again(gemma):
    """A forged or truncated pack entry is a counted miss for the request that met it (its
    blocks recomputed). It must not stay: the recomputed prefix is saved again under the same key,
    and a store that still holds the bad entry keeps it (a write of a key held is a no-op), so
    every later re-read of that prefix would fail the same way."""
    cfg = vllm_config(gemma)
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        tokens = _prompt(8 * CHUNK + 1)
        eng.prefill(request(tokens))
        window = next(g for g in eng.groups if g.kind != "full")
        key = _pack_keys(eng, tokens, window.index)[7]
        store = eng.work.worker.store
        good = _entry_size(store, key)
        assert store.delete(key) and store.write(key, good - 512, lambda segs: [s.__setitem__(slice(None), 7)
                                                                              for s in segs])
        eng.sync_events()
        req = request(tokens)
        hit, _ = eng.sched.get_num_new_matched_tokens(req, 0)
        _, _, results = eng.load(req, hit)
        assert req.request_id in results.failed_recving  # a miss: recomputed
        eng.prefill(request(tokens))  # the recomputed prefix saved again
        assert _entry_size(store, key) == good
        again = request(tokens)
        hit, _ = eng.sched.get_num_new_matched_tokens(again, 0)
        _, _, results = eng.load(again, hit)
        assert hit == 8 * CHUNK and again.request_id not in results.failed_recving
    finally:
        eng.close()


def test_a_save_missing_one_member_of_a_pack_writes_no_entry(gemma):
    """A step's saves that name only some groups of a pack (a hostile or broken plan) must not
    store a short entry under the pack's key: every later load of that chunk would be a miss,
    and the entry would never be replaced."""
    from kvtier.integrations.vllm.connector import KVTierMetadata

    cfg = vllm_config(gemma)
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        windows = [g for g in eng.groups if g.kind != "full"]
        assert len(windows) > 1
        tokens = _prompt(8 * CHUNK + 1)
        req = request(tokens)
        n = -(-len(tokens) // BLOCK)
        state = eng.sched._request_state(req)
        eng.sched.scheduler._set_blocks(state, [eng.fresh(n) for _ in eng.groups])
        meta = KVTierMetadata()
        eng.sched._plan(meta, req.request_id, state, len(tokens))
        meta.saves = [s for s in meta.saves if s.group != windows[1].index]  # one member's saves gone
        eng.work.bind_connector_metadata(meta)
        eng.work.wait_for_save()
        eng.work.clear_connector_metadata()
        store = eng.work.worker.store
        assert all(_entry_size(store, key) is None for key in _pack_keys(eng, tokens, windows[0].index))
        full = next(g for g in eng.groups if g.kind == "full")
        assert all(_entry_size(store, key) for key in _pack_keys(eng, tokens, full.index))  # the rest saved
    finally:
        eng.close()


def test_a_load_missing_one_member_of_a_pack_is_a_counted_miss_that_writes_no_page(gemma):
    """A load plan that names only some groups of a pack: its entries do not cut into those
    groups' parts, so the load fails for the request before any page is written."""
    cfg = vllm_config(gemma)
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        windows = [g for g in eng.groups if g.kind != "full"]
        tokens = _prompt(8 * CHUNK + 1)
        src, _ = eng.prefill(request(tokens))
        req = request(tokens)
        hit, _ = eng.sched.get_num_new_matched_tokens(req, 0)
        plan = eng.sched.scheduler._take_load

        def without_one(*args, **kwargs):
            return [spec for spec in plan(*args, **kwargs) if spec.group != windows[1].index]

        eng.sched.scheduler._take_load = without_one
        dst, loads, results = eng.load(req, hit)
        assert req.request_id in results.failed_recving
        assert eng.work.get_block_ids_with_load_errors() == set()
        g = windows[0].index  # the member still named: none of its pages loaded
        for b in range(windows[0].first_block(hit), hit // BLOCK):
            assert not all(torch.equal(a, b_) for a, b_ in zip(eng.page(g, dst[g][b]), eng.page(g, src[g][b])))
        stats = eng.work.get_kv_connector_stats()
        assert stats is not None and stats.data["counters"].get("load_error_chunks", 0) > 0
    finally:
        eng.close()


# --------------------------------------------------------------------------- uneven packs


def uneven_config(window: int = 48):
    """A KV cache config whose window groups differ in layer count (vLLM's last group of a kind
    may hold fewer layers): window groups of 3, 3 and 1 layers in one pack, a full group of 2."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from tests.integration.test_hybrid_groups import HEAD, HEADS, NUM_BLOCKS

    common = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    names = iter(f"model.layers.{i}.self_attn.attn" for i in range(9))
    groups = [KVCacheGroupSpec([next(names) for _ in range(n)], SlidingWindowSpec(sliding_window=window, **common))
              for n in (3, 3, 1)]
    groups.append(KVCacheGroupSpec([next(names) for _ in range(2)], FullAttentionSpec(**common)))
    return KVCacheConfig(num_blocks=4 * NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("mode, copy", [("sync", "host"), ("async", "host"), ("async", "torch"), ("sync", "torch")])
def test_a_pack_of_groups_with_different_layer_counts_round_trips(gemma, monkeypatch, mode, copy):
    """Each member's part at its own offset and size, in both save modes and both copy engines
    (the torch engine's background saves land several groups' gathers in one slot, ``_Landing``;
    its loads stage each member and scatter on the engine's thread), the top-tier copy split over
    two threads."""
    import kvtier.integrations.vllm.worker as worker_module
    from kvtier.integrations.vllm.groups import packs

    monkeypatch.setattr(worker_module, "SPLIT_COPY_BYTES", 1)
    cfg = vllm_config(gemma, {"transfer_mode": mode})
    eng = Engine(cfg, uneven_config())
    for layout in eng.work.worker._layouts.values():
        layout.engine = copy
    try:
        sizes = {g.index: len(g.layer_names) for g in eng.groups}
        assert sizes == {0: 3, 1: 3, 2: 1, 3: 2} and [len(m) for m in packs(eng.groups).values()] == [3, 1]
        tokens = _prompt(10 * CHUNK + 5)
        src, _ = eng.prefill(request(tokens))
        req = request(tokens)
        hit, _ = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 10 * CHUNK
        dst, _, results = eng.load(req, hit)
        assert not results.failed_recving
        for g in eng.groups:
            for b in range(g.first_block(hit), hit // BLOCK):
                assert all(torch.equal(a, b_) for a, b_ in zip(eng.page(g.index, dst[g.index][b]),
                                                               eng.page(g.index, src[g.index][b]))), (g.index, b)
    finally:
        eng.close()


def test_a_failed_chunk_in_the_first_half_of_a_split_copy_stops_the_count_there(tmp_path, monkeypatch):
    """An inline load (one group) split over two threads: a chunk of the first half is gone, the
    second half's chunks load meanwhile, and still only the chunks before the gap count as
    loaded; every block from the gap on is reported for recomputation."""
    import kvtier.integrations.vllm.worker as worker_module
    from tests.integration._vllm_config import make_tiny_model

    monkeypatch.setattr(worker_module, "SPLIT_COPY_BYTES", 1)
    model = make_tiny_model(tmp_path / "tiny")
    cfg = vllm_config(model)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tests.integration.test_hybrid_groups import HEAD, HEADS, NUM_BLOCKS

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)])
    eng = Engine(cfg, kcc)
    try:
        tokens, req, hit, background = _prefill_and_look_up(eng, 8)
        assert hit == 8 * CHUNK and not background
        assert eng.work.worker.store.delete(_pack_keys(eng, tokens, 0)[1])
        eng.work.get_kv_connector_stats()
        dst, loads, _ = eng.load(req, hit)
        bpc = CHUNK // BLOCK
        assert eng.work.get_block_ids_with_load_errors() == set(dst[0][bpc : 8 * bpc])
        stats = eng.work.get_kv_connector_stats().data
        assert stats["counters"]["load_error_chunks"] == 7
        assert sum(t.get("loaded_chunks", 0) for t in stats["tiers"].values()) == 1
    finally:
        eng.close()


# --------------------------------------------------------------------------- MLA under TP, state beside windows


@pytest.mark.parametrize("tier", ["fs", "disk"])
def test_a_pack_of_replicated_mla_groups_loads_on_every_rank(tmp_path, tier):
    """Two MLA groups (one pack) under TP=2, the latent the same on both ranks. An fs tier is one
    directory for every rank: rank 0 writes the pack's entry once and rank 1 loads it. A disk tier
    is a directory per rank (``DiskTier.for_rank``): rank 1 must keep its own copy, or it never
    finds one and every hit fails on it."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.groups import groups_of
    from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, LoadSpec, SaveSpec
    from kvtier.integrations.vllm.worker import KVTierWorker
    from kvtier.keys import WorkerShare

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=512 + 64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    kcc = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[:2], spec), KVCacheGroupSpec(names[2:], spec)])
    groups = groups_of(kcc, "deepseek_v2")
    assert [g.pack_index for g in groups] == [0, 0]
    config = ConnectorConfig.from_extra_config({"tiers": [{"type": tier, "path": str(tmp_path / tier),
                                                           "capacity": "8MiB"}]})
    geometry = ChunkGeometry(BLOCK, CHUNK)
    workers, kvs = [], []
    try:
        for rank in (0, 1):
            torch.manual_seed(0)  # replicated: the same latent on every rank
            kv = {n: torch.randn(32, BLOCK, 576).to(torch.bfloat16) for n in names}
            w = KVTierWorker(config, geometry, WorkerShare(rank, 2), groups=groups, replicated=True)
            w.register_kv_caches(kv)
            workers.append(w)
            kvs.append(kv)
        key = b"m" * 32
        src = {0: [1, 2], 1: [3, 4]}
        dst = {0: [5, 6], 1: [8, 9]}
        saves = KVTierMetadata(saves=[SaveSpec("r", key, None, 0, src[g.index], group=g.index) for g in groups])
        for w in workers:
            w.wait_for_save(saves)
        loads = KVTierMetadata(loads=[LoadSpec("r", [key], 0, dst[g.index], 0, group=g.index) for g in groups])
        workers[1].start_load_kv(loads)
        assert not workers[1].failed_blocks() and not workers[1].failed_loads()
        for g in groups:
            for s_, d in zip(src[g.index], dst[g.index]):
                for n in g.layer_names:
                    assert torch.equal(kvs[1][n][d], kvs[1][n][s_])
    finally:
        for w in workers:
            w.close()


def test_a_state_group_beside_window_groups_round_trips(tmp_path):
    """Recurrent state (its own pack), two window groups (one pack) and a full group: every
    group's kept blocks loaded bit-exactly at the prompt's last boundary."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvtier.integrations.vllm.groups import STATE, WINDOW
    from tests.integration._vllm_config import make_tiny_model
    from tests.integration.test_hybrid_groups import HEAD, HEADS, NUM_BLOCKS, PAGE, StateEngine, mamba_spec

    model = make_tiny_model(tmp_path / "tiny")
    cfg = vllm_config(model, extra={"chunk_tokens": BLOCK})
    cfg.cache_config.kv_cache_layout = "LBHNC"
    common = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = {"model.layers.0.mixer": mamba_spec(), "model.layers.1.self_attn.attn": FullAttentionSpec(**common),
             "model.layers.2.self_attn.attn": SlidingWindowSpec(sliding_window=40, **common),
             "model.layers.3.self_attn.attn": SlidingWindowSpec(sliding_window=40, **common),
             "model.layers.4.mixer": mamba_spec()}
    kcc = get_kv_cache_configs(cfg, [specs], [4 * NUM_BLOCKS * PAGE * len(specs)])[0]
    eng = StateEngine(cfg, kcc)
    try:
        kinds = sorted(g.kind for g in eng.groups)
        assert kinds.count(STATE) >= 1 and WINDOW in kinds
        tokens = _prompt(12 * BLOCK + 9)
        resume = (len(tokens) - 1) // BLOCK
        states = [g for g in eng.groups if g.kind == STATE]
        offered = {g.index: eng.fresh(1)[0] for g in states}
        src, _ = eng.prefill_offering(request(tokens), [(g.index, offered[g.index], resume * BLOCK) for g in states])
        req = request(tokens)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == resume * BLOCK and background
        dst, _, results = eng.load(req, hit)
        assert not results.failed_recving
        for g in eng.groups:
            if g.kind == STATE:
                pairs = [(dst[g.index][resume - 1], offered[g.index])]
            else:
                pairs = [(dst[g.index][b], src[g.index][b]) for b in range(g.first_block(hit), resume)]
            assert pairs
            for d, s_ in pairs:
                assert all(torch.equal(a, b) for a, b in zip(eng.page(g.index, d), eng.page(g.index, s_))), g
    finally:
        eng.close()


# --------------------------------------------------------------------------- pipeline parallelism


def test_pipeline_stages_each_holding_some_members_of_a_pack_round_trip(gemma):
    """PP=2: each stage holds only some layers, so some groups of the window pack live on one
    stage only and one may be split between them. Each stage stores its members' parts of the
    pack under its own key and loads them back bit-exactly; the scheduler's plan names every
    group."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector, KVTierMetadata
    from kvtier.integrations.vllm.worker import KVTierWorker
    from kvtier.keys import WorkerShare
    from tests.integration.test_hybrid_groups import HEAD, HEADS

    cfg = vllm_config(gemma, pp=2)
    kcc = kv_cache_config(cfg)
    sched = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    groups = sched.groups
    layers = [n for g in kcc.kv_cache_groups for n in g.layer_names]
    order = sorted(layers, key=lambda n: int(n.split(".")[2]))
    stages = [order[: len(order) // 2 + 1], order[len(order) // 2 + 1:]]
    torch.manual_seed(0)
    kv = {n: torch.randn(kcc.num_blocks, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16) for n in layers}
    for t in kv.values():
        t[NULL].zero_()
    workers = []
    for s, names in enumerate(stages):
        w = KVTierWorker(sched.config, sched.geometry, WorkerShare(0, 1, s, 2), groups=groups)
        w.register_kv_caches({n: kv[n] for n in names})
        workers.append(w)
    try:
        window = [g for g in groups if g.kind != "full"]
        held = [{g.index for g in window if set(g.layer_names) & set(names)} for names in stages]
        assert held[0] != held[1]  # the stages hold different members of the pack
        tokens = _prompt(8 * CHUNK + 1)
        req = request(tokens)
        n = -(-len(tokens) // BLOCK)
        nxt = iter(range(1, kcc.num_blocks))
        src = [[next(nxt) for _ in range(n)] for _ in groups]
        state = sched._request_state(req)
        sched.scheduler._set_blocks(state, src)
        meta = KVTierMetadata()
        sched._plan(meta, req.request_id, state, len(tokens))
        for w in workers:
            w.wait_for_save(meta)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=workers[0].worker_meta()))
        again = request(tokens)
        hit, background = sched.get_num_new_matched_tokens(again, 0)
        assert hit == 8 * CHUNK and background
        dst = []
        for g in groups:
            nulls = g.first_block(hit)
            dst.append([NULL] * nulls + [next(nxt) for _ in range(n - nulls)])
        sched.update_state_after_alloc(again, Blocks(dst), hit)
        meta = KVTierMetadata()
        meta.loads, sched.scheduler._async_loads = sched.scheduler._async_loads, []
        for w in workers:
            w.start_load_kv(meta)
        for w in workers:
            for _ in range(2000):
                if again.request_id in w.finished_loads():
                    break
                time.sleep(0.005)
            else:
                raise AssertionError("the load was never reported")
            assert not w.failed_loads()
        for g in groups:
            for b in range(g.first_block(hit), hit // BLOCK):
                for name in g.layer_names:
                    assert torch.equal(kv[name][dst[g.index][b]], kv[name][src[g.index][b]]), (g.index, b, name)
    finally:
        for w in workers:
            w.close()
        sched.shutdown()


# --------------------------------------------------------------------------- async mode, one window group


def test_a_window_only_models_hit_below_ram_loads_in_the_background(tmp_path):
    """A model whose every layer is sliding (Mistral-7B-v0.1-like: one window group, one pack) in
    ``async`` mode: a hit found only on disk (RAM evicted) must load in the background, as a dense
    model's does, not inline in the step."""
    cfg = vllm_config(gemma_like(tmp_path, 4, 9), {
        "transfer_mode": "async",
        "tiers": [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(tmp_path / "d"),
                                                          "capacity": "64MiB"}]})
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        assert len(eng.groups) == 1 and eng.groups[0].kind == "window"
        tokens = _prompt(8 * CHUNK + 1)
        eng.prefill(request(tokens))
        assert eng.work.worker.store.flush()
        hit, background = eng.sched.get_num_new_matched_tokens(request(tokens), 0)
        assert hit == 8 * CHUNK and not background  # in RAM: inline
        eng.sched.scheduler._present.clear()  # RAM evicted (as its removal events would say)
        hit, background = eng.sched.get_num_new_matched_tokens(request(tokens), 0)
        assert hit == 8 * CHUNK and background
    finally:
        eng.close()

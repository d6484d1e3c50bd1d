"""Every KV cache group (issue 26): sliding-window and chunked-local groups beside full attention,
MLA, recurrent state (Mamba2 / gated delta net state in vLLM's "align" mode stored per chunk
boundary, refused without it), group specs in the namespace.

The KV cache configs are built by vLLM's own code (``get_kv_cache_configs``) from a random
Gemma-3-like model's config; the connector's scheduler side plans and its worker side copies on
CPU tensors of that layout into a real RAM tier, as vLLM would drive them (per-group block
tables, null blocks before a window group's window). The engine run is in
``test_hybrid_engine.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integration._vllm_config import CHUNK, vllm_config  # noqa: E402

BLOCK = 16
HEADS, HEAD = 1, 16
NUM_BLOCKS = 96
NULL = 0  # vLLM's null block: block 0 of the pool


def gemma_like(tmp: Path, layers: int = 8, ratio: int = 3, window: int = 48) -> Path:
    from kvtier.bench.models import make_family_model

    return make_family_model("gemma3-swa", out_dir=tmp / f"g{layers}-{ratio}-{window}", num_hidden_layers=layers,
                             hidden_size=64, intermediate_size=128, num_attention_heads=2,
                             num_key_value_heads=HEADS, head_dim=HEAD, sliding_window=window, local_per_global=ratio)


def kv_cache_config(cfg, chunked: int = 0):
    """vLLM's KV cache config for the model of ``cfg`` (layer specs from its layer types; with
    ``chunked`` the sliding layers are chunked-local attention of that chunk size instead)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    hf = cfg.model_config.hf_config
    common = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = {}
    for i, kind in enumerate(hf.layer_types):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "full_attention":
            specs[name] = FullAttentionSpec(**common)
        elif chunked:
            specs[name] = ChunkedLocalAttentionSpec(attention_chunk_size=chunked, **common)
        else:
            specs[name] = SlidingWindowSpec(sliding_window=hf.sliding_window, **common)
    cfg.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it; the CPU layout
    page = BLOCK * HEADS * HEAD * 2 * 2
    return get_kv_cache_configs(cfg, [specs], [NUM_BLOCKS * page * len(specs)])[0]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return gemma_like(tmp_path_factory.mktemp("hybrid"))


class Blocks:
    """What vLLM's ``KVCacheBlocks.get_block_ids`` hands the connector: one table per group."""

    def __init__(self, tables):
        self.tables = tables

    def get_block_ids(self):
        return tuple(self.tables)


_ids = iter(range(10**6))


def request(tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=f"h{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None)


class Engine:
    """The connector's two sides over CPU KV tensors, wired as vLLM wires them."""

    def __init__(self, cfg, kcc):
        from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

        self.kcc = kcc
        self.sched = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
        self.work = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
        torch.manual_seed(0)
        self.kv = {name: torch.randn(kcc.num_blocks, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)
                   for g in kcc.kv_cache_groups for name in g.layer_names}
        for t in self.kv.values():
            t[NULL].zero_()
        self.work.register_kv_caches(self.kv)
        self.groups = self.sched.groups
        self._next = 1

    def close(self):
        self.sched.shutdown()
        self.work.shutdown()

    def fresh(self, n):
        ids = list(range(self._next, self._next + n))
        self._next += n
        assert self._next <= self.kcc.num_blocks
        return ids

    def sync_events(self):
        from vllm.v1.outputs import KVConnectorOutput

        meta = self.work.build_connector_worker_meta()
        self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))

    def prefill(self, req):
        """A one-step prefill of the whole prompt: every group holds a block per token; then
        the step's saves run on the worker side."""
        from kvtier.integrations.vllm.connector import KVTierMetadata

        n = -(-len(req.prompt_token_ids) // BLOCK)
        tables = [self.fresh(n) for _ in self.groups]
        state = self.sched._request_state(req)
        self.sched.scheduler._set_blocks(state, tables)
        meta = KVTierMetadata()
        self.sched._plan(meta, req.request_id, state, len(req.prompt_token_ids))
        self.work.bind_connector_metadata(meta)
        self.work.wait_for_save()
        self.work.clear_connector_metadata()
        assert self.work.worker.drain_saves()  # async mode: the background writer's saves
        self.sync_events()
        return tables, meta

    def load(self, req, hit):
        """Allocate as vLLM does for ``hit`` external tokens (a window group's blocks before its
        window are null), plan and run the background load; the tables and the load specs."""
        from kvtier.integrations.vllm.connector import KVTierMetadata

        tables = _alloc(self, req, hit)
        meta = KVTierMetadata()
        meta.loads, self.sched.scheduler._async_loads = self.sched.scheduler._async_loads, []
        state = self.sched._request_state(req)
        inline = state.load is not None  # one group: loaded inline when the request is scheduled
        if inline:
            meta.loads = self.sched.scheduler._take_load(req.request_id, state, background=False)
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        self.work.clear_connector_metadata()
        if inline:
            return tables, meta.loads, self.work.get_transfer_results(set())
        for _ in range(2000):
            results = self.work.get_transfer_results(set())
            if req.request_id in results.finished_recving:
                return tables, meta.loads, results
            import time

            time.sleep(0.005)
        raise AssertionError("the load was never reported")

    def page(self, group, block):
        return [self.kv[name][block].clone() for name in self.kcc.kv_cache_groups[group].layer_names]


def _prompt(n, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(5, 900, n).tolist()


# --------------------------------------------------------------------------- the groups


@pytest.mark.parametrize("layers, ratio, window", [(8, 3, 48), (6, 1, 100), (12, 5, 33), (4, 3, 200)])
def test_groups_follow_vllms_own_grouping_for_any_ratio_and_window(tmp_path, layers, ratio, window):
    from kvtier.integrations.vllm.groups import FULL, WINDOW, groups_of, namespace_groups

    cfg = vllm_config(gemma_like(tmp_path, layers, ratio, window))
    kcc = kv_cache_config(cfg)
    groups = groups_of(kcc, "gemma3_text")
    assert len(groups) == len(kcc.kv_cache_groups) > 1
    for g, spec in zip(groups, kcc.kv_cache_groups):
        assert g.layer_names == tuple(spec.layer_names)
        assert g.kind == (WINDOW if type(spec.kv_cache_spec).__name__ == "SlidingWindowSpec" else FULL)
    full_layers = sum(len(g.layer_names) for g in groups if g.kind == FULL)
    assert full_layers == sum(1 for i in range(layers) if (i + 1) % (ratio + 1) == 0)
    assert all(g.sliding_window == window for g in groups if g.kind == WINDOW)
    assert f"sliding_window={window}" in namespace_groups(groups)


def test_skipped_tokens_are_vllms_own():
    """A window group's null blocks are where vLLM's managers put them (their own code)."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    from kvtier.integrations.vllm.groups import WINDOW, GroupSpec

    for window, extra in ((48, 0), (100, 0), (512, 0), (33, 5)):
        ours = GroupSpec(0, WINDOW, (), BLOCK, sliding_window=window, extra_retained=extra)
        theirs = SimpleNamespace(sliding_window=window, extra_retained_tokens=extra)
        for t in range(0, 1200, 7):
            assert ours.skipped_tokens(t) == SlidingWindowManager.get_num_skipped_tokens(theirs, t)
    for size in (32, 48, 256):
        ours = GroupSpec(0, WINDOW, (), BLOCK, attention_chunk=size)
        theirs = SimpleNamespace(attention_chunk_size=size)
        for t in range(0, 1200, 7):
            assert ours.skipped_tokens(t) == ChunkedLocalAttentionManager.get_num_skipped_tokens(theirs, t)


# --------------------------------------------------------------------------- saves and loads


@pytest.mark.parametrize("chunked, layers, ratio, mode, copy", [
    (0, 8, 3, "sync", "host"), (64, 8, 3, "sync", "host"), (0, 4, 9, "sync", "host"),
    (0, 8, 3, "async", "host"), (0, 12, 5, "async", "torch")])
def test_a_hybrid_prefix_round_trips_every_group_and_stores_only_the_windows(tmp_path, chunked, layers, ratio,
                                                                             mode, copy):
    """Saves: full groups every chunk, window groups the chunks in the window before the prompt's
    last chunk boundary, the window groups of one rule in one entry per chunk (a pack). Re-read:
    a hit of that boundary (>= 0.95 of the prompt), every group's kept blocks loaded bit-exactly
    from its part of the pack's entries, null blocks never written. (4 layers at 9:1: every layer
    sliding, one window group: loaded inline, found by its window too.) Both transfer modes' saves
    (``async``: staged, written by the background writer) and both copy engines."""
    from kvtier.integrations.vllm.groups import FULL, window_chunks

    cfg = vllm_config(gemma_like(tmp_path, layers, ratio), {"transfer_mode": mode})
    kcc = kv_cache_config(cfg, chunked=chunked)
    eng = Engine(cfg, kcc)
    for layout in eng.work.worker._layouts.values():
        layout.engine = copy  # the torch engine runs on CPU tensors too (the CUDA path's plan)
    try:
        tokens = _prompt(20 * CHUNK + 9)
        resume = (len(tokens) - 1) // CHUNK  # chunks a re-read can load
        src, meta = eng.prefill(request(tokens))
        bpc = CHUNK // BLOCK
        for g in eng.groups:
            saved = sorted(s.chunk_index for s in meta.saves if s.group == g.index)
            assert saved == list(window_chunks(g, resume, bpc)), g
        # bytes stored: full layers x prefix + window layers x (window rounded to whole chunks)
        token_bytes = HEADS * HEAD * 2 * 2
        stored = sum(len(g.layer_names) * CHUNK * token_bytes for g in eng.groups for s in meta.saves
                     if s.group == g.index)
        full = sum(len(g.layer_names) for g in eng.groups if g.kind == FULL)
        windowed = sum(len(g.layer_names) for g in eng.groups if g.kind != FULL)
        window = chunked or cfg.model_config.hf_config.sliding_window
        assert stored <= (full * resume * CHUNK + windowed * (window + CHUNK)) * token_bytes
        assert stored < (full + windowed) * resume * CHUNK * token_bytes / 2  # not all layers x prefix
        # the groups of one storage rule (a pack) share one entry per chunk: one store operation
        # per pack and chunk, whatever the number of groups vLLM split the layers into
        from kvtier.integrations.vllm.groups import packs
        from kvtier.keys import group_key

        leads = {index: members[0] for index, members in packs(eng.groups).items()}
        assert len(leads) == len({g.kind for g in eng.groups}) < len(eng.groups) or len(eng.groups) == 1
        state = eng.sched._request_state(request(tokens))
        entries = [group_key(state.keys[c], index) for index, lead in leads.items()
                   for c in window_chunks(lead, resume, bpc)]
        assert all(eng.work.worker.store.locate(key) for key in entries)
        assert eng.work.worker.store.stats()["tiers"][0]["entries"] == len(entries)

        req = request(tokens)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        # wholly in the RAM tier, nothing in flight: inline (several groups: the worker vouched for
        # its tier's room)
        assert hit == resume * CHUNK and hit >= 0.95 * len(tokens) and not background
        assert eng.work.worker._reports_room == (len(eng.groups) > 1)
        dst, loads, results = eng.load(req, hit)
        assert not results.failed_recving and not eng.work.get_block_ids_with_load_errors()
        null_pages = eng.page(0, NULL)
        for g in eng.groups:
            first = g.first_block(hit)
            (load,) = [spec for spec in loads if spec.group == g.index] or [None]
            if first >= hit // BLOCK:
                assert load is None  # chunked-local at a local-chunk boundary: nothing kept
                continue
            assert load.first_chunk * bpc + load.skip_blocks == first
            for b in range(first, hit // BLOCK):
                for a, b_ in zip(eng.page(g.index, dst[g.index][b]), eng.page(g.index, src[g.index][b])):
                    assert torch.equal(a, b_)
        for g in eng.groups:  # the null block was never written
            assert all(torch.equal(a, b) for a, b in zip(eng.page(g.index, NULL), null_pages))
    finally:
        eng.close()


def test_a_hit_is_a_hit_only_when_every_group_loads_at_the_same_count(gemma):
    """A longer prompt over a stored one: its hit is the stored prompt's boundary (where the
    windows are), not its full groups' longer run; a window entry gone: no hit at all."""
    cfg = vllm_config(gemma)
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        tokens = _prompt(12 * CHUNK + 3)
        eng.prefill(request(tokens))
        stored_resume = (len(tokens) - 1) // CHUNK * CHUNK
        longer = tokens + _prompt(5 * CHUNK, seed=1)
        assert eng.sched.get_num_new_matched_tokens(request(longer), 0)[0] == stored_resume
        # a prompt that ends one chunk earlier: the full groups hold it, the windows do not
        shorter = tokens[: stored_resume - CHUNK + 1]
        assert eng.sched.get_num_new_matched_tokens(request(shorter), 0) == (0, False)
        # drop one window group's last entry: no count is loadable by every group
        state = eng.sched._request_state(request(tokens))
        window = next(g for g in eng.groups if g.kind != "full")
        from kvtier.keys import group_key

        key = group_key(state.keys[stored_resume // CHUNK - 1], window.index)
        assert eng.work.worker.store.delete(key)
        eng.sync_events()
        assert eng.sched.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
    finally:
        eng.close()


@pytest.fixture
def stored_prefix(gemma):
    """(engine, request, hit tokens, its scheduler state): an 8-chunk prompt (+1 token) of the
    Gemma-like model prefilled and saved, then looked up again (the hit: every whole chunk)."""
    cfg = vllm_config(gemma)
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        tokens = _prompt(8 * CHUNK + 1)
        eng.prefill(request(tokens))
        req = request(tokens)
        hit, _ = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 8 * CHUNK
        yield eng, req, hit, eng.sched._request_state(req)
    finally:
        eng.close()


def busy(eng):
    """Another request's background load is in flight: its promotions could evict from the RAM
    tier, so a hit of several groups loads in the background (``room.py``)."""
    eng.sched.scheduler._room.loading("elsewhere", 10**6)


def test_a_failed_load_of_a_hybrid_model_is_reported_per_request_not_per_block(stored_prefix):
    """vLLM raises on block-level failures of a multi-group model: the worker reports the request
    in ``failed_recving`` (vLLM recomputes it) and no block ids."""
    from kvtier.keys import group_key

    eng, req, hit, state = stored_prefix
    busy(eng)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (hit, True)
    full = next(g for g in eng.groups if g.kind == "full")
    eng.work.worker.store.delete(group_key(state.keys[3], full.index))  # gone after the lookup
    _, _, results = eng.load(req, hit)
    assert req.request_id in results.failed_recving and req.request_id in results.finished_recving
    assert eng.work.get_block_ids_with_load_errors() == set()


def _step(eng, req, tables, computed: int):
    """The scheduler's metadata for a step that schedules all of ``req``'s prompt beyond its
    first ``computed`` tokens (blocks ``tables``), built by its own ``build_connector_meta``
    (which counts what the step may put into the worker's top tier)."""
    new = SimpleNamespace(req_id=req.request_id, block_ids=tuple(tables), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return eng.sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - computed}))


def _execute(eng, meta):
    """The worker carries out one step (loads, then saves); its report, not yet delivered."""
    eng.work.bind_connector_metadata(meta)
    eng.work.start_load_kv(None)
    eng.work.wait_for_save()
    report = eng.work.build_connector_worker_meta()
    eng.work.clear_connector_metadata()
    return report


def _deliver(eng, report):
    from vllm.v1.outputs import KVConnectorOutput

    eng.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))


def _alloc(eng, req, hit):
    """Blocks for ``req`` as vLLM allocates them for ``hit`` external tokens (null before a
    window group's window), handed to ``update_state_after_alloc``."""
    n = -(-len(req.prompt_token_ids) // BLOCK)
    tables = []
    for g in eng.groups:
        nulls = g.first_block(hit)
        tables.append([NULL] * nulls + eng.fresh(n - nulls))
    eng.sched.update_state_after_alloc(req, Blocks(tables), hit)
    return tables


@pytest.mark.parametrize("capacity, inline", [("16MiB", True), ("40KiB", False)])
def test_a_hybrid_hit_loads_inline_only_when_no_step_in_flight_can_evict_it(gemma, capacity, inline):
    """vLLM plans step N+1 before it has seen step N's output: a hit wholly in the RAM tier loads
    inline only when the room the worker last reported covers every entry the steps in flight
    may put (else in the background, where vLLM takes its failure per request). Large tier: the
    hit loads inline, in the step, bit-exact, after the in-flight step's saves. A tier the stored
    prefix fills: the same hit loads in the background, and the in-flight saves do evict it."""
    from kvtier.keys import group_key

    cfg = vllm_config(gemma, {"tiers": [{"type": "ram", "capacity": capacity, "page_size": "1KiB"}]})
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        a = _prompt(4 * CHUNK + 1)
        src, _ = eng.prefill(request(a))  # stored and reported
        assert eng.work.worker._reports_room
        b = request(_prompt(4 * CHUNK + 1, seed=7))
        eng.sched.get_num_new_matched_tokens(b, 0)
        b_meta = _step(eng, b, [eng.fresh(9) for _ in eng.groups], 0)  # in flight: not reported
        assert b_meta.saves
        req = request(a)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 4 * CHUNK and background is not inline
        dst = _alloc(eng, req, hit)
        _deliver(eng, _execute(eng, b_meta))  # the step in flight runs first (its saves), then A's
        state = eng.sched._request_state(req)
        a_keys = [group_key(k, g.pack_index) for k in state.keys[:4] for g in eng.groups]
        if not inline:
            assert not all(eng.work.worker.store.locate(k) for k in a_keys if k)  # B's saves evicted A's
            return
        meta = _step(eng, req, dst, hit)
        assert meta.loads and not any(load.background for load in meta.loads)
        _deliver(eng, _execute(eng, meta))
        assert eng.work.get_block_ids_with_load_errors() == set()
        assert not eng.work.get_transfer_results(set()).failed_recving
        for g in eng.groups:
            for blk in range(g.first_block(hit), hit // BLOCK):
                for x, y in zip(eng.page(g.index, dst[g.index][blk]), eng.page(g.index, src[g.index][blk])):
                    assert torch.equal(x, y)
    finally:
        eng.close()


def test_a_worker_that_cannot_vouch_for_its_top_tier_gets_background_hybrid_loads(gemma, tmp_path):
    """A disk top tier in ``async`` mode (saves written by the background writer, at no step's
    time): the worker reports no room, and a hybrid hit waits for a background load."""
    cfg = vllm_config(gemma, {"transfer_mode": "async", "tiers": [{"type": "disk", "path": str(tmp_path / "d"),
                                                                    "capacity": "16MiB"}]})
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        tokens = _prompt(4 * CHUNK + 1)
        eng.prefill(request(tokens))
        assert not eng.work.worker._reports_room
        assert eng.work.build_connector_worker_meta() is None or eng.work.build_connector_worker_meta().room is None
        assert eng.sched.get_num_new_matched_tokens(request(tokens), 0) == (4 * CHUNK, True)
    finally:
        eng.close()


def _idle(eng):
    """The metadata of a step that schedules nothing."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return eng.sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                                                          num_scheduled_tokens={}))


def lagged_rereads(eng, execute, seed: int, steps: int = 120) -> tuple[int, int]:
    """Random prompts (four of four chunks and a token) prefilled and re-read over ``eng``, each
    step planned as vLLM's asynchronous scheduling plans it (while the step before runs: its
    report is seen a step later), 3 steps in 10 with nothing for kvtier; ``execute(eng, meta)``
    carries a step out and returns its report. Every inline load must complete, bit-exact.
    Returns (inline loads, hits sent to the background)."""
    import random

    rng = random.Random(seed)
    prompts = [_prompt(4 * CHUNK + 1, seed=seed * 10 + s) for s in range(4)]
    homes = {}  # prompt -> the block tables its prefill computed (its pages' true bytes)
    dst = [eng.fresh(9) for _ in eng.groups]  # where every re-read goes
    inline_loads = background_hits = 0
    reports = []
    for _ in range(steps):
        if len(reports) > 1:
            _deliver(eng, reports.pop(0))  # the report of the step before the previous one
        if rng.random() < 0.3:  # a step with nothing for kvtier (decodes, an idle engine)
            reports.append(execute(eng, _idle(eng)))
            continue
        p = rng.randrange(len(prompts))
        req = request(prompts[p])
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        if hit and background:  # not this path: the step runs without the request
            background_hits += 1
            reports.append(execute(eng, _idle(eng)))
            continue
        if not hit:
            if p not in homes:
                homes[p] = [eng.fresh(9) for _ in eng.groups]
            reports.append(execute(eng, _step(eng, req, homes[p], 0)))
            continue
        tables = [[NULL] * g.first_block(hit) + dst[g.index][g.first_block(hit):] for g in eng.groups]
        eng.sched.update_state_after_alloc(req, Blocks(tables), hit)
        for g in eng.groups:  # the forward pass computes the blocks after the hit
            for blk in range(hit // BLOCK, 9):
                for name in eng.kcc.kv_cache_groups[g.index].layer_names:
                    eng.kv[name][dst[g.index][blk]] = eng.kv[name][homes[p][g.index][blk]]
        meta = _step(eng, req, tables, hit)
        assert meta.loads and not any(load.background for load in meta.loads)
        reports.append(execute(eng, meta))
        assert eng.work.get_block_ids_with_load_errors() == set()
        assert not eng.work.get_transfer_results(set()).failed_recving
        inline_loads += 1
        for g in eng.groups:
            for blk in range(g.first_block(hit), hit // BLOCK):
                for x, y in zip(eng.page(g.index, dst[g.index][blk]), eng.page(g.index, homes[p][g.index][blk])):
                    assert torch.equal(x, y)
    return inline_loads, background_hits


def test_under_one_step_of_scheduling_lag_no_inline_hybrid_load_ever_fails(gemma, caplog):
    """Random prompts over a RAM tier that holds about three of four (``lagged_rereads``): every
    inline load completes, bit-exact, and many do load inline."""
    cfg = vllm_config(gemma, {"tiers": [{"type": "ram", "capacity": "128KiB", "page_size": "1KiB"}]})
    eng = Engine(cfg, kv_cache_config(cfg))
    try:
        inline_loads, background_hits = lagged_rereads(eng, _execute, seed=3)
        assert inline_loads >= 10 and background_hits >= 1, (inline_loads, background_hits)
        assert "inline load" not in caplog.text
    finally:
        eng.close()


def test_a_pack_entry_of_another_size_is_a_miss_that_writes_no_page(stored_prefix):
    """A window pack's entry replaced by one group's part alone (the size of an entry of the
    layout before packs, or a forged one): its load fails for the request, before any member
    group's page is written."""
    from kvtier.keys import group_key

    eng, req, hit, state = stored_prefix
    windows = [g for g in eng.groups if g.kind != "full"]
    assert len(windows) > 1
    key = group_key(state.keys[7], windows[0].index)
    store = eng.work.worker.store
    part = eng.work.worker._layouts[windows[0].index].chunk_bytes
    assert store.delete(key) and store.write(key, part, lambda segs: [s.__setitem__(slice(None), 7) for s in segs])
    tables, _, results = eng.load(req, hit)
    assert req.request_id in results.failed_recving and eng.work.get_block_ids_with_load_errors() == set()
    for g in windows:  # the chunk's blocks of every member group: untouched (never 7s)
        for b in tables[g.index][7 * (CHUNK // BLOCK):8 * (CHUNK // BLOCK)]:
            assert not any(bool((page.view(torch.uint8) == 7).all()) for page in eng.page(g.index, b))


# --------------------------------------------------------------------------- keys


def test_models_differing_only_in_their_window_never_share_an_entry(tmp_path):
    from kvtier.integrations.vllm.groups import groups_of, namespace_groups

    spaces = []
    for window in (48, 64):
        cfg = vllm_config(gemma_like(tmp_path, window=window))
        kcc = kv_cache_config(cfg)
        groups = groups_of(kcc)
        spaces.append(namespace_groups(groups))
        from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

        conn = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
        spaces.append(conn.namespace)
        conn.shutdown()
    assert spaces[0] != spaces[2]  # the groups' specs alone tell them apart
    assert spaces[1].kv_groups != spaces[3].kv_groups and spaces[1].digest() != spaces[3].digest()
    # the same config with its layers' config digest forced equal still differs by its groups
    from dataclasses import replace

    assert replace(spaces[1], config_digest="x").digest() != replace(spaces[3], config_digest="x").digest()


def test_a_dense_models_namespace_digest_is_unchanged():
    """One plain full-attention group and no lossy codec: ``kv_groups`` and ``kv_codec`` are empty
    and left out of the digest."""
    import hashlib
    import json
    from dataclasses import asdict

    from kvtier.keys import Namespace

    ns = Namespace(model="m", kv_layout="cpu:FullAttentionSpec:16")
    old = {k: v for k, v in asdict(ns).items() if k not in ("kv_groups", "kv_codec")}  # fields added later
    assert ns.digest() == hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).digest()
    assert Namespace(model="m", kv_groups="0:x").digest() != Namespace(model="m").digest()


# --------------------------------------------------------------------------- MLA, recurrent state


def _mla_config(tp_kv_replicas=1):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=512 + 64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]), spec


def test_mla_latent_pages_and_one_copy_under_tensor_parallelism(tmp_path):
    """The latent layout ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` is one page per
    block of the spec's page size; a replicated latent is keyed as rank 0's on every rank, and
    with a store the ranks share only rank 0 writes it."""
    from kvtier.integrations.vllm.config import ConnectorConfig
    from kvtier.integrations.vllm.groups import groups_of, namespace_groups
    from kvtier.integrations.vllm.metadata import ChunkGeometry
    from kvtier.integrations.vllm.pages import PageLayout
    from kvtier.integrations.vllm.worker import KVTierWorker
    from kvtier.keys import WorkerShare

    kcc, spec = _mla_config()
    groups = groups_of(kcc, "deepseek_v2")
    assert groups[0].replicated and "MLAAttentionSpec" in namespace_groups(groups)
    latent = {n: torch.randn(NUM_BLOCKS, BLOCK, 576).to(torch.bfloat16) for n in groups[0].layer_names}
    layout = PageLayout(latent, NUM_BLOCKS, CHUNK // BLOCK)
    assert (layout.pieces, layout.piece_bytes) == (1, spec.page_size_bytes)
    geometry = ChunkGeometry(BLOCK, CHUNK)
    ram = ConnectorConfig.from_extra_config({"tiers": [{"type": "ram", "capacity": "4MiB"}]})
    shared = ConnectorConfig.from_extra_config({"tiers": [{"type": "fs", "path": str(tmp_path / "f"), "capacity": "4MiB"}]})
    per_rank = ConnectorConfig.from_extra_config({"tiers": [{"type": "disk", "path": str(tmp_path / "d"),
                                                             "capacity": "4MiB"}]})
    key = b"k" * 32
    workers = []
    try:
        for cfg in (ram, shared, per_rank):
            for rank in (0, 1):
                workers.append((cfg, rank, KVTierWorker(cfg, geometry, WorkerShare(rank, 2), groups=groups,
                                                        replicated=True)))
        keys = {w._key(key) for _, _, w in workers}
        assert len(keys) == 1 and keys == {WorkerShare(0, 2).key(key)}
        name = {id(ram): "ram", id(shared): "fs", id(per_rank): "disk"}
        saving = {(name[id(cfg)], rank): w._saves_on for cfg, rank, w in workers}
        # private RAM, a disk directory per rank: each rank keeps its own copy to load from; a
        # shared store (fs): rank 0's only
        assert saving == {("ram", 0): True, ("ram", 1): True, ("fs", 0): True, ("fs", 1): False,
                          ("disk", 0): True, ("disk", 1): True}
        plain = KVTierWorker(ram, geometry, WorkerShare(1, 2), groups=groups, replicated=False)
        workers.append((ram, 1, plain))
        assert plain._key(key) != WorkerShare(0, 2).key(key)
    finally:
        for _, _, w in workers:
            w.close()


def test_recurrent_state_without_prefix_caching_is_refused_at_start_in_one_line():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.groups import groups_of

    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16, 16)), dtypes=(torch.float32, torch.float32))
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a.0"], attn), KVCacheGroupSpec(["m.1"], mamba)])
    with pytest.raises(ConfigError) as err:
        groups_of(kcc, "qwen3_next")
    message = str(err.value)
    assert "\n" not in message and "qwen3_next" in message and "MambaSpec" in message and "recurrent" in message
    assert "mamba_cache_mode 'none'" in message and "--enable-prefix-caching" in message


# --------------------------------------------------------------------------- recurrent state (align mode)

STATE_SHAPES = ((3, 40), (2, 8, 8))  # (conv state, SSM state) of one layer, as vLLM's MambaSpec
STATE_DTYPES = (torch.bfloat16, torch.float32)
PAGE = BLOCK * HEADS * HEAD * 2 * 2  # the attention page; vLLM pads the state page to it


def mamba_spec(**kw):
    from vllm.v1.kv_cache_interface import MambaSpec

    args = dict(block_size=BLOCK, shapes=STATE_SHAPES, dtypes=STATE_DTYPES, mamba_cache_mode="align",
                page_size_padded=PAGE)
    return MambaSpec(**{**args, **kw})


def state_config(tmp: Path, **kw):
    """A hybrid of two Mamba2 layers and one attention layer, its KV cache config built by vLLM's
    own code (``get_kv_cache_configs``: one group per Mamba2 layer, one attention group), and the
    connector's config with chunks of one block (what a state group needs)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tests.integration._vllm_config import make_tiny_model

    model = tmp / "tiny"
    if not model.exists():
        make_tiny_model(model)
    cfg = vllm_config(model, extra={"chunk_tokens": BLOCK})
    cfg.cache_config.kv_cache_layout = "LBHNC"
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    specs = {"model.layers.0.mixer": mamba_spec(**kw), "model.layers.1.self_attn.attn": attn,
             "model.layers.2.mixer": mamba_spec(**kw)}
    return cfg, get_kv_cache_configs(cfg, [specs], [NUM_BLOCKS * PAGE * len(specs)])[0]


def state_pages(num_blocks: int) -> torch.Tensor:
    """A Mamba layer's tensor as vLLM hands it to a connector on CPU: ``[num_blocks, 1, 1, state
    bytes]`` int8 over pages of the padded size (block stride ``PAGE``, not contiguous)."""
    content = sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size()
                  for s, d in zip(STATE_SHAPES, STATE_DTYPES))
    raw = torch.randint(-128, 127, (num_blocks * PAGE,), dtype=torch.int8)
    return raw.as_strided((num_blocks, 1, 1, content), (PAGE, content, content, 1))


class StateEngine(Engine):
    """``Engine`` with the Mamba layers' tensors in vLLM's padded state layout, prefilling in
    steps of one block as vLLM does in align mode and offering each step's boundary state the
    way vLLM's scheduler does (``kv_connector_block_state.boundary_state_offloads``)."""

    def __init__(self, cfg, kcc):
        from vllm.v1.kv_cache_interface import MambaSpec

        self.kcc = kcc
        from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

        self.sched = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
        self.work = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
        torch.manual_seed(0)
        self.kv = {}
        for g in kcc.kv_cache_groups:
            for name in g.layer_names:
                if isinstance(g.kv_cache_spec, MambaSpec):
                    self.kv[name] = state_pages(kcc.num_blocks)
                else:
                    self.kv[name] = torch.randn(kcc.num_blocks, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)
        for t in self.kv.values():
            t[NULL].zero_()
        self.work.register_kv_caches(self.kv)
        self.groups = self.sched.groups
        self._next = 1

    def prefill_offering(self, req, offers):
        """Plan the whole prompt's saves (the attention groups' blocks positionally) and run this
        step's ``build_connector_meta`` with vLLM's boundary-state ``offers`` (``(group, block,
        boundary tokens)``); the worker then saves. The tables and the metadata."""
        from vllm.v1.core.sched.output import KVConnectorBlockState

        from kvtier.integrations.vllm.connector import KVTierMetadata

        n = -(-len(req.prompt_token_ids) // BLOCK)
        tables = [self.fresh(n) for _ in self.groups]
        state = self.sched._request_state(req)
        self.sched.scheduler._set_blocks(state, tables)
        meta = KVTierMetadata()
        self.sched.scheduler._plan(meta, req.request_id, state, len(req.prompt_token_ids))
        step = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                               kv_connector_block_state=KVConnectorBlockState(
                                   req_ids={req.request_id}, resolve_block_ids=lambda _: tuple(tables),
                                   boundary_state_offloads={req.request_id: offers}))
        meta.saves += self.sched.build_connector_meta(step).saves
        self.work.bind_connector_metadata(meta)
        self.work.wait_for_save()
        self.work.clear_connector_metadata()
        assert self.work.worker.drain_saves()  # async mode: the background writer's saves
        self.sync_events()
        return tables, meta


def test_recurrent_state_groups_in_align_mode_are_stored_and_keyed_by_their_spec(tmp_path):
    from kvtier.integrations.vllm.groups import FULL, STATE, groups_of, namespace_groups

    cfg, kcc = state_config(tmp_path)
    groups = groups_of(kcc, "nemotron_h")
    assert sorted(g.kind for g in groups) == [FULL, STATE, STATE]
    space = namespace_groups(groups)
    assert "shapes=((3, 40), (2, 8, 8))" in space and "torch.float32" in space and "MAMBA2" in space
    # a state of another shape or dtype (e.g. --mamba-ssm-cache-dtype) is another namespace
    _, other = state_config(tmp_path, dtypes=(torch.bfloat16, torch.bfloat16))
    assert namespace_groups(groups_of(other)) != space
    # GroupSpec follows vLLM's MambaManager: only the state after the last computed token is kept
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    state = next(g for g in groups if g.kind == STATE)
    for t in range(1, 300, 7):
        assert state.skipped_tokens(t) == MambaManager.get_num_skipped_tokens(None, t)


def test_recurrent_state_with_speculative_blocks_is_refused_in_one_line(tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.groups import groups_of

    _, kcc = state_config(tmp_path, num_speculative_blocks=1)
    with pytest.raises(ConfigError) as err:
        groups_of(kcc, "qwen3_next")
    assert "\n" not in str(err.value) and "qwen3_next" in str(err.value) and "speculative" in str(err.value)


def test_recurrent_state_with_a_lossy_tier_codec_is_refused_in_one_line(tmp_path):
    """fp8 quantizes a tier's bytes as the engine's KV elements: a recurrent state (fp32 here,
    and its error would compound over every later token) is never coded that way."""
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

    cfg, kcc = state_config(tmp_path)
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    extra["tiers"] = [{"type": "ram", "capacity": "16MiB"},
                      {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "16MiB", "codec": "fp8"}]
    with pytest.raises(ConfigError) as err:
        KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    message = str(err.value)
    assert "\n" not in message and "recurrent state" in message and "'fp8'" in message
    assert "valid codecs for it: none, lossless, auto" in message


@pytest.mark.parametrize("engine", ["host", "torch"])
def test_state_pages_are_each_blocks_leading_bytes_and_other_strides_are_refused(engine):
    """A padded state page is copied as its state bytes only (the padding is never read or
    written), by both copy engines; a tensor whose blocks are not whole rows (e.g. transposed)
    is still refused."""
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.pages import PageLayout

    t = state_pages(8)
    layout = PageLayout({"m": t}, 8, 1, engine=engine)
    assert (layout.pieces, layout.piece_bytes) == (1, t.shape[-1])
    raw = torch.as_strided(t, (8 * PAGE,), (1,), t.storage_offset())
    before = raw.clone()
    page = torch.arange(t.shape[-1], dtype=torch.int64).remainder(251).to(torch.uint8).numpy()
    layout.load([page.tobytes()], [3])
    assert torch.equal(t[3].reshape(-1).view(torch.uint8), torch.from_numpy(page))
    changed = (raw != before).nonzero().flatten()
    assert changed.numel() and int(changed.min()) >= 3 * PAGE and int(changed.max()) < 3 * PAGE + t.shape[-1]
    saved = bytearray(t.shape[-1])
    layout.save([3], [memoryview(saved)])
    assert bytes(saved) == page.tobytes()
    with pytest.raises(ConfigError):
        PageLayout({"m": torch.zeros(16, 8).t()}, 8, 1)
    layout.close()


def test_a_recurrent_state_needs_chunks_of_one_block(tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

    cfg, kcc = state_config(tmp_path)
    cfg.kv_transfer_config.kv_connector_extra_config["chunk_tokens"] = 2 * BLOCK
    with pytest.raises(ConfigError) as err:
        KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    assert "\n" not in str(err.value) and "recurrent state" in str(err.value) and "block size (16)" in str(err.value)


def test_recurrent_state_round_trips_from_the_offered_block_beside_the_attention_kv(tmp_path):
    """Saves: the attention group every chunk (its blocks positionally); each state group only the
    state at the prompt's last chunk boundary, from the block vLLM offers for it (not the table's
    block at that position), and never a boundary off a chunk or before it. Re-read: a hit of that
    boundary in every group; each state loaded bit-exactly into the block at index ``hit / block
    - 1`` (the table before it null, never written); the attention pages loaded bit-exactly."""
    from kvtier.integrations.vllm.groups import STATE

    cfg, kcc = state_config(tmp_path)
    eng = StateEngine(cfg, kcc)
    try:
        tokens = _prompt(20 * BLOCK + 9)
        resume = (len(tokens) - 1) // BLOCK
        states = [g for g in eng.groups if g.kind == STATE]
        offered = {g.index: eng.fresh(1)[0] for g in states}  # vLLM's exact blocks for the boundary
        offers = [(g.index, offered[g.index], resume * BLOCK) for g in states]
        offers += [(g.index, eng.fresh(1)[0], (resume - 3) * BLOCK) for g in states]  # an earlier boundary
        offers += [(g.index, eng.fresh(1)[0], resume * BLOCK - 5) for g in states]  # not on a chunk boundary
        offers += [(99, 1, resume * BLOCK)]  # not a state group kvtier knows
        src, meta = eng.prefill_offering(request(tokens), offers)
        for g in eng.groups:
            saves = [s for s in meta.saves if s.group == g.index]
            if g.kind == STATE:
                assert [(s.chunk_index, s.block_ids) for s in saves] == [(resume - 1, [offered[g.index]])]
            else:
                assert sorted(s.chunk_index for s in saves) == list(range(20))

        req = request(tokens)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == resume * BLOCK and background and hit >= 0.95 * len(tokens)
        null_pages = {g.index: eng.page(g.index, NULL) for g in eng.groups}
        dst, loads, results = eng.load(req, hit)
        assert not results.failed_recving and not eng.work.get_block_ids_with_load_errors()
        for g in eng.groups:
            (load,) = [spec for spec in loads if spec.group == g.index]
            if g.kind == STATE:
                assert load.first_chunk == resume - 1 and dst[g.index][: resume - 1] == [NULL] * (resume - 1)
                pairs = [(dst[g.index][resume - 1], offered[g.index])]
            else:
                pairs = [(dst[g.index][b], src[g.index][b]) for b in range(resume)]
            for d, s_ in pairs:
                assert all(torch.equal(a, b) for a, b in zip(eng.page(g.index, d), eng.page(g.index, s_)))
            assert all(torch.equal(a, b) for a, b in zip(eng.page(g.index, NULL), null_pages[g.index]))
    finally:
        eng.close()


def test_a_recurrent_hit_is_a_hit_only_where_every_state_was_stored(tmp_path):
    """The attention KV of a longer prompt's whole run is there, but states only at the stored
    boundary: the hit is that boundary; one state group's entry gone: no hit at all."""
    from kvtier.integrations.vllm.groups import STATE
    from kvtier.keys import group_key

    cfg, kcc = state_config(tmp_path)
    eng = StateEngine(cfg, kcc)
    try:
        tokens = _prompt(12 * BLOCK + 3)
        resume = (len(tokens) - 1) // BLOCK
        states = [g for g in eng.groups if g.kind == STATE]
        eng.prefill_offering(request(tokens), [(g.index, eng.fresh(1)[0], resume * BLOCK) for g in states])
        longer = tokens + _prompt(5 * BLOCK, seed=1)
        assert eng.sched.get_num_new_matched_tokens(request(longer), 0)[0] == resume * BLOCK
        shorter = tokens[: (resume - 1) * BLOCK + 1]  # its boundary has the attention KV, no state
        assert eng.sched.get_num_new_matched_tokens(request(shorter), 0) == (0, False)
        key = group_key(eng.sched._request_state(request(tokens)).keys[resume - 1], states[1].index)
        assert eng.work.worker.store.delete(key)
        eng.sync_events()
        assert eng.sched.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
    finally:
        eng.close()

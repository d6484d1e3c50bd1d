"""Hostile review of the inline loads of multi-group (hybrid) models (``room.RoomLedger``).

vLLM 0.32 ignores ``failed_recving`` for a running request and raises on block-level failures of
a model with several KV cache groups, so an inline load of such a model that misses a chunk
leaves garbage KV in the engine. Each test drives the connector's two sides as vLLM does (the
harness of ``test_hybrid_groups.py``: real TieredStore, real RAM/disk tiers) through one way
an entry could go missing between the scheduler's lookup and the worker's load, and asserts
the guarantee: a hit the scheduler sends inline loads completely (no failed request, no error
blocks, the pages bit-exact), else it goes to the background.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests.integration._vllm_config import CHUNK, vllm_config  # noqa: E402
from tests.integration.test_hybrid_groups import (  # noqa: E402,F401
    BLOCK,
    Engine,
    _alloc,
    _deliver,
    _execute,
    _idle,
    _prompt,
    _step,
    gemma,
    kv_cache_config,
    lagged_rereads,
    request,
)

PROMPT = 4 * CHUNK + 1  # 4 chunks: 4 full-pack entries of 4 KiB + 2 window-pack entries of 12 KiB = 40 KiB


def _engine(gemma, extra):
    cfg = vllm_config(gemma, extra)
    return Engine(cfg, kv_cache_config(cfg))


def _step_many(eng, reqs):
    """The scheduler's metadata for a step that schedules each ``(req, tables, computed)`` new
    request to the end of its prompt, in order (the worker loads them in this order)."""
    news = [SimpleNamespace(req_id=r.request_id, block_ids=tuple(t), num_computed_tokens=c) for r, t, c in reqs]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return eng.sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=news, scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) - c for r, _, c in reqs}))


def _execute_deferred(eng, meta):
    """One step as vLLM's GPU runner carries it out with speculative decoding
    (``defer_finalize``): loads, the report (``build_connector_worker_meta``), and only then,
    after the drafter, ``wait_for_save``."""
    eng.work.bind_connector_metadata(meta)
    eng.work.start_load_kv(None)
    report = eng.work.build_connector_worker_meta()
    eng.work.wait_for_save()
    eng.work.clear_connector_metadata()
    return report


def _assert_loaded(eng, hit, dst, src):
    """The inline load ended with no failure of any kind and the pages equal the source's."""
    results = eng.work.get_transfer_results(set())
    assert not results.failed_recving, "an inline load of a hybrid model failed: vLLM keeps garbage KV"
    assert eng.work.get_block_ids_with_load_errors() == set()
    for g in eng.groups:
        for blk in range(g.first_block(hit), hit // BLOCK):
            for x, y in zip(eng.page(g.index, dst[g.index][blk]), eng.page(g.index, src[g.index][blk])):
                assert torch.equal(x, y)


# --------------------------------------------------------------------------- a RAM tier under RAM


def test_a_hit_in_a_second_ram_tier_never_loads_inline_where_the_first_can_evict_for_it(gemma):
    """Two RAM tiers (a small fast one over a larger one): both are mirrored under the same
    medium, so the scheduler's mirror cannot tell a chunk of the lower RAM tier from one of the
    top tier, while the worker's room covers the top tier only. A's chunks were demoted to the
    second RAM tier; the top tier is full of D's. The reported room (0) covers the 0 entries
    planned, so both hits look safe; in the step that loads both inline, A's reads from the
    second tier promote into the full top tier, evicting D's chunks before D's load reads them
    (their demotion still queued behind a slow lower-tier writer): D's inline load fails.
    Correct: a hit partly outside the top tier loads in the background (or the load succeeds)."""
    eng = _engine(gemma, {
        "write_through": False,
        "tiers": [{"type": "ram", "capacity": "40KiB", "page_size": "1KiB"},
                  {"type": "ram", "capacity": "1MiB", "page_size": "1KiB"}]})
    store = eng.work.worker.store
    lower = store.tiers[1]
    gate = threading.Event()
    try:
        a, d = _prompt(PROMPT, seed=1), _prompt(PROMPT, seed=2)
        eng.prefill(request(a))
        src_d, _ = eng.prefill(request(d))  # evicts A from the top tier: demoted into the second RAM tier
        assert store.flush()
        eng.sync_events()
        assert store.stats()["tiers"][1]["entries"] == 6  # A lies wholly in the lower RAM tier

        put = lower.put  # from now on the lower tier's writer is slow (a stalled tier): fault injection

        def slow_put(*args, **kw):
            gate.wait(5)
            return put(*args, **kw)

        lower.put = slow_put
        ra, rd = request(a), request(d)
        hit_a, bg_a = eng.sched.get_num_new_matched_tokens(ra, 0)
        hit_d, bg_d = eng.sched.get_num_new_matched_tokens(rd, 0)
        assert hit_a == hit_d == 4 * CHUNK
        assert bg_a  # A's chunks lie outside the top tier: its load would put (promote) there
        if bg_d:
            return  # the worker does not vouch for a store with a second mirrored tier at all
        dst_d = _alloc(eng, rd, hit_d)
        meta = _step_many(eng, [(rd, dst_d, hit_d)])
        assert meta.loads and not any(load.background for load in meta.loads)
        eng.work.bind_connector_metadata(meta)
        eng.work.start_load_kv(None)
        eng.work.clear_connector_metadata()
        _assert_loaded(eng, hit_d, dst_d, src_d)
    finally:
        gate.set()
        eng.close()


# --------------------------------------------------------------------------- speculative decoding


@pytest.mark.parametrize("capacity", ["40KiB", "64KiB"])
def test_speculative_decodings_deferred_saves_stay_counted_until_a_report_covers_them(gemma, capacity):
    """With speculative decoding vLLM builds the worker's report before that step's
    ``wait_for_save`` (``defer_finalize``). The report then vouches for the step before (its
    ``step``), so the deferred step's saves stay counted: a hit they would evict is not sent
    inline on the strength of a room measured before them."""
    eng = _engine(gemma, {"tiers": [{"type": "ram", "capacity": capacity, "page_size": "1KiB"}]})
    try:
        a = _prompt(PROMPT, seed=3)
        src, _ = eng.prefill(request(a))
        b = request(_prompt(PROMPT, seed=4))
        eng.sched.get_num_new_matched_tokens(b, 0)
        b_meta = _step(eng, b, [eng.fresh(9) for _ in eng.groups], 0)
        assert len(b_meta.saves) >= 6
        _deliver(eng, _execute_deferred(eng, b_meta))  # B's saves ran after its report was built
        req = request(a)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 4 * CHUNK
        if background:
            return
        dst = _alloc(eng, req, hit)
        meta = _step(eng, req, dst, hit)
        _deliver(eng, _execute_deferred(eng, meta))
        _assert_loaded(eng, hit, dst, src)
    finally:
        eng.close()


def test_under_deferred_saves_and_one_step_of_lag_no_inline_load_fails(gemma):
    """The random workload of ``test_under_one_step_of_scheduling_lag_...`` with every step run
    as speculative decoding runs it (report before ``wait_for_save``): no inline load fails."""
    eng = _engine(gemma, {"tiers": [{"type": "ram", "capacity": "128KiB", "page_size": "1KiB"}]})
    try:
        inline, _ = lagged_rereads(eng, _execute_deferred, seed=11)
        assert inline >= 5
    finally:
        eng.close()


# --------------------------------------------------------------------------- background loads


@pytest.mark.parametrize("aborted", [False, True])
def test_a_background_loads_promotions_keep_ram_hits_background_until_it_is_reported(gemma, tmp_path, aborted):
    """A disk tier under RAM with write-through: A's hit lies on disk and loads in the
    background; its promotions into the full RAM tier may evict C's chunks at any time until
    the worker reports the load finished, also when A was aborted meanwhile (vLLM keeps its
    blocks until then). While it runs, C's hit (wholly in RAM) must not load inline; once it is
    reported, C loads inline and completely."""
    eng = _engine(gemma, {"tiers": [{"type": "ram", "capacity": "40KiB", "page_size": "1KiB"},
                                    {"type": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}]})
    store = eng.work.worker.store
    disk = store.tiers[1]
    gate = threading.Event()
    try:
        a, c = _prompt(PROMPT, seed=5), _prompt(PROMPT, seed=6)
        eng.prefill(request(a))
        assert store.flush()
        src_c, _ = eng.prefill(request(c))  # evicts A from RAM: A is on disk only
        assert store.flush()
        eng.sync_events()
        get_into = disk.get_into

        def slow_get_into(*args, **kw):  # a slow disk: the background load stays in flight
            gate.wait(5)
            return get_into(*args, **kw)

        disk.get_into = slow_get_into
        ra = request(a)
        hit, background = eng.sched.get_num_new_matched_tokens(ra, 0)
        assert hit == 4 * CHUNK and background
        _alloc(eng, ra, hit)
        meta = _idle(eng)  # the step that carries A's background load
        assert meta.loads and all(load.background for load in meta.loads)
        _deliver(eng, _execute(eng, meta))
        if aborted:
            eng.sched.request_finished_all_groups(ra, ())
        rc = request(c)
        hit_c, background_c = eng.sched.get_num_new_matched_tokens(rc, 0)
        assert hit_c == 4 * CHUNK and background_c  # A's promotions could evict C before its load
        gate.set()
        for _ in range(400):
            results = eng.work.get_transfer_results(set())
            if ra.request_id in results.finished_recving:
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError("A's background load was never reported")
        from vllm.v1.outputs import KVConnectorOutput

        eng.sched.update_connector_output(KVConnectorOutput(finished_recving=results.finished_recving,
                                                            kv_connector_worker_meta=eng.work.build_connector_worker_meta()))
        hit_c, background_c = eng.sched.get_num_new_matched_tokens(rc, 0)
        if background_c:
            return  # A's promotions evicted C: not in RAM any more, or no room: background is right
        dst = _alloc(eng, rc, hit_c)
        _deliver(eng, _execute(eng, _step(eng, rc, dst, hit_c)))
        _assert_loaded(eng, hit_c, dst, src_c)
    finally:
        gate.set()
        eng.close()


# --------------------------------------------------------------------------- chunked prefill, stale reports


def test_a_prefill_over_several_steps_counts_each_steps_saves(gemma):
    """Chunked prefill: B's prompt computed over two steps, both in flight (neither reported);
    each step's saves are counted, so A's hit, which those saves evict from a tier it fills,
    does not load inline."""
    eng = _engine(gemma, {"tiers": [{"type": "ram", "capacity": "52KiB", "page_size": "1KiB"}]})
    try:
        a = _prompt(PROMPT, seed=7)
        src, _ = eng.prefill(request(a))
        b = request(_prompt(PROMPT, seed=8))
        eng.sched.get_num_new_matched_tokens(b, 0)
        tables = [eng.fresh(9) for _ in eng.groups]
        half = 2 * CHUNK
        first = eng.sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=b.request_id, block_ids=tuple(tables), num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                  num_computed_tokens=[]),
            num_scheduled_tokens={b.request_id: half}))
        second = eng.sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[b.request_id], new_block_ids=[None], resumed_req_ids=set(),
                                                  num_computed_tokens=[half]),
            num_scheduled_tokens={b.request_id: PROMPT - half}))
        assert first.saves and second.saves
        req = request(a)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        assert hit == 4 * CHUNK
        dst = _alloc(eng, req, hit)
        _deliver(eng, _execute(eng, first))
        _deliver(eng, _execute(eng, second))
        if background:
            return
        _deliver(eng, _execute(eng, _step(eng, req, dst, hit)))
        _assert_loaded(eng, hit, dst, src)
    finally:
        eng.close()


def test_a_stale_report_never_releases_a_newer_steps_saves(gemma):
    """Reports delivered out of order: the report of a step after B's in-flight step is seen,
    then an older one (stale): the older one's larger room must not be taken."""
    eng = _engine(gemma, {"tiers": [{"type": "ram", "capacity": "64KiB", "page_size": "1KiB"}]})
    try:
        a = _prompt(PROMPT, seed=9)
        src, _ = eng.prefill(request(a))
        old = eng.work.build_connector_worker_meta()  # room after A only (step 0)
        b = request(_prompt(PROMPT, seed=10))
        eng.sched.get_num_new_matched_tokens(b, 0)
        new = _execute(eng, _step(eng, b, [eng.fresh(9) for _ in eng.groups], 0))  # B's saves fill the tier
        _deliver(eng, new)
        _deliver(eng, old)
        c = request(_prompt(PROMPT, seed=12))
        eng.sched.get_num_new_matched_tokens(c, 0)
        c_meta = _step(eng, c, [eng.fresh(9) for _ in eng.groups], 0)  # in flight before A's step
        req = request(a)
        hit, background = eng.sched.get_num_new_matched_tokens(req, 0)
        if not hit or background:
            return
        dst = _alloc(eng, req, hit)
        _deliver(eng, _execute(eng, c_meta))
        _deliver(eng, _execute(eng, _step(eng, req, dst, hit)))
        _assert_loaded(eng, hit, dst, src)
    finally:
        eng.close()


# --------------------------------------------------------------------------- who cannot vouch


def test_no_worker_vouches_in_async_mode_with_a_background_writer_nor_the_scheduler_for_a_server(gemma, tmp_path):
    """Where no step accounts for the top tier's writes (a disk top tier: the background save
    writer) the worker reports no room; a scheduler of a cache server keeps no ledger."""
    from kvtier.integrations.vllm.connector import KVConnectorRole, KVTierConnector

    eng = _engine(gemma, {"transfer_mode": "async",
                          "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}]})
    try:
        a = _prompt(PROMPT, seed=13)
        eng.prefill(request(a))
        assert eng.work.worker._saves is not None
        report = eng.work.build_connector_worker_meta()
        assert report is None or report.room is None
        assert eng.sched.get_num_new_matched_tokens(request(a), 0) == (4 * CHUNK, True)
    finally:
        eng.close()
    cfg = vllm_config(gemma, {"server": "unix:///nonexistent/kvtier.sock"})
    sched = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    try:
        assert sched.scheduler._room is None
    finally:
        sched.shutdown()

"""KV events of a hybrid model (issue 26): kvtier publishes every KV cache group's entries as vLLM
publishes that group's blocks, and ``kvtier route`` counts a prefix only where every group can load
it at the same token count.

The KV cache config is vLLM's own (``get_kv_cache_configs`` over a random Gemma-3-like model:
sliding-window groups beside a full-attention group), the requests are hashed by vLLM's own block
hasher, the connector's two sides run over CPU tensors of that layout (``test_hybrid_groups``), and
the events cross the wire as vLLM's ZMQ publisher encodes them. The engine run is at the end
(``test_an_engine_publishes_every_group_over_zmq``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integration._vllm_config import CHUNK, vllm_config  # noqa: E402
from tests.integration.test_hybrid_groups import BLOCK, Engine, gemma_like, kv_cache_config  # noqa: E402

HERE = Path(__file__).parent
WINDOW = 48
BPC = CHUNK // BLOCK
PROMPT = 8 * CHUNK + 5  # 8 whole chunks (the last boundary a re-read resumes at) and a partial one

_ids = iter(range(10**6))


def hashed_request(tokens):
    """A vLLM request hashed as the engine core hashes it (sha256, fixed seed)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return Request(request_id=f"he{next(_ids)}", prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, fn))


def _prompt(n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(5, 900, n).tolist()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(vllm config with KV events on, vLLM's KV cache config) of an 8-layer 3:1 model, window 48."""
    cfg = vllm_config(gemma_like(tmp_path_factory.mktemp("hev"), 8, 3, WINDOW), events=True)
    return cfg, kv_cache_config(cfg)


@pytest.fixture
def engine(hybrid):
    cfg, kcc = hybrid
    eng = Engine(cfg, kcc)
    yield eng
    eng.close()


def _vllm_annotation(kcc):
    """(kind, sliding window) per group, as vLLM's ``KVCacheManager.take_events`` annotates its own
    ``BlockStored`` events (its ``kv_cache_event_metadata``)."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    return [(get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kcc.kv_cache_groups]


def _prefill_events(engine, tokens):
    """Prefill ``tokens`` (every group's saves run), then the connector's events."""
    req = hashed_request(tokens)
    engine.sched.take_events()
    engine.prefill(req)
    return req, engine.sched.take_events()


def test_every_group_is_published_with_vllms_own_group_fields(engine, hybrid):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier.integrations.vllm.groups import FULL, window_chunks

    _, kcc = hybrid
    annotation = _vllm_annotation(kcc)
    assert {kind for kind, _ in annotation} == {"full_attention", "sliding_window"}
    tokens = _prompt(PROMPT, 1)
    req, events = _prefill_events(engine, tokens)
    assert events and all(isinstance(e, BlockStored) for e in events)
    engine_hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    by_group: dict[int, list] = {}
    for e in events:
        by_group.setdefault(e.group_idx, []).append(e)
        # the group's fields exactly as vLLM's own events of that group carry them
        assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == annotation[e.group_idx]
    assert sorted(by_group) == list(range(len(kcc.kv_cache_groups)))  # every group, none twice
    resume = (PROMPT - 1) // CHUNK
    for group in engine.groups:
        chunks = list(window_chunks(group, resume, BPC))
        assert group.kind == FULL or 0 < len(chunks) < resume  # a window group: only its window
        got = by_group[group.index]
        assert len(got) == len(chunks)
        for c, e in zip(chunks, got):
            # the same hashes, parent and tokens for every group: vLLM hashes a block by content
            assert e.block_hashes == engine_hashes[c * BPC:(c + 1) * BPC]
            assert e.parent_block_hash == (engine_hashes[c * BPC - 1] if c else None)
            assert e.token_ids == tokens[c * CHUNK:(c + 1) * CHUNK] and e.block_size == BLOCK
    # the full group's events come first: a window chunk's parent is announced before it
    kinds = [e.group_idx in {g.index for g in engine.groups if g.kind == FULL} for e in events]
    assert kinds == sorted(kinds, reverse=True)


def test_removals_name_their_group(engine):
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata
    from kvtier.keys import group_key

    req, stored = _prefill_events(engine, _prompt(PROMPT, 2))
    state = engine.sched._request_state(req)
    windows = [g for g in engine.groups if g.kind != "full"]
    assert len(windows) > 1 and {g.pack_index for g in windows} == {windows[0].index}  # one pack
    last = len(state.keys) - 1
    # the window groups share one entry per chunk: its removal removes every member's blocks
    engine.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(
        [("removed", group_key(state.keys[last], windows[0].index), "CPU")])))
    removed = engine.sched.take_events()
    assert [e.group_idx for e in removed] == [g.index for g in windows]
    for e, window in zip(removed, windows):
        assert isinstance(e, BlockRemoved)
        twin = next(s for s in stored if s.group_idx == window.index and s.token_ids == stored[-1].token_ids)
        assert e.block_hashes == twin.block_hashes and e.medium == "CPU"


def _route_index(events_batches):
    """``kvtier route``'s index fed ``events_batches`` through vLLM's wire encoding."""
    import msgspec
    from vllm.distributed.kv_events import EventBatch

    from kvtier.route.events import apply_events, decode_batch
    from kvtier.route.index import PrefixIndex

    index = PrefixIndex(block_size=BLOCK)
    encoder = msgspec.msgpack.Encoder()
    for events in events_batches:
        counts = apply_events(index, "e", decode_batch(encoder.encode(EventBatch(ts=0.0, events=events))))
        assert "malformed" not in counts
    return index


@pytest.mark.parametrize("prefix_chunks", [8, 7, 5, 3, 1])
def test_the_router_counts_what_kvtier_itself_would_load(engine, prefix_chunks):
    """The route index fed the connector's events of one 8-chunk prompt, asked about a prompt that
    shares its first ``prefix_chunks`` chunks: the run it scores is the hit kvtier's own scheduler
    finds for that prompt (every group loadable at the same token count), never more."""
    from kvtier.route.index import chunk_keys
    from kvtier.route.score import prefix_matches

    tokens = _prompt(PROMPT, 3)
    _, events = _prefill_events(engine, tokens)
    index = _route_index([events])
    assert index.orphans == 0 and index.ignored == 0
    window_groups = {g.index: g.sliding_window for g in engine.groups if g.kind != "full"}
    assert index.windows("e") == window_groups
    probe = tokens[:prefix_chunks * CHUNK] + _prompt(CHUNK + 3, 99)
    keys = chunk_keys(probe, BLOCK)
    (weight, run), = prefix_matches(keys, ["e"], index, None, lambda m: 0.8, frozenset()).values()
    req = hashed_request(probe)
    hit, _ = engine.sched.get_num_new_matched_tokens(req, 0)
    assert run * BLOCK == hit, (prefix_chunks, run, hit)
    assert weight == pytest.approx(0.8 * run)
    # what names the prefix (the full group) is held whatever the windows say
    assert all(index.holders(k) == {"e": {"CPU"}} for k in keys[:prefix_chunks * BPC])


def test_a_window_groups_removal_leaves_the_full_groups_blocks(engine):
    """Regression: the index applied every group's ``BlockRemoved`` to the same content keys, so a
    window group dropping a block (vLLM frees blocks that leave the window) erased the full group's
    copy of the prefix from the router."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvtier.route.index import chunk_keys

    tokens = _prompt(PROMPT, 4)
    _, events = _prefill_events(engine, tokens)
    window = next(e for e in events if e.kv_cache_spec_kind == "sliding_window")
    removal = BlockRemoved(block_hashes=window.block_hashes, medium="CPU", group_idx=window.group_idx,
                           locality="LOCAL")
    index = _route_index([events, [removal]])
    keys = chunk_keys(tokens, BLOCK)
    assert all(index.holders(k) == {"e": {"CPU"}} for k in keys[:8 * BPC])


# --------------------------------------------------------------------------- a real engine


@pytest.mark.vllm
def test_an_engine_publishes_every_group_over_zmq(tmp_path):
    """A vLLM CPU engine on the random Gemma-3-like model (3 sliding-window groups, 1 full), kvtier
    in it, vLLM's ZMQ publisher on: kvtier's events name every group with the group index, kind
    and window the engine's own events give it, carry the engine's own block hashes, hold only a
    window group's window, and ``kvtier route``'s index built from the stream places the whole
    loadable prefix on the engine (in kvtier's RAM tier, and in the engine's pool)."""
    from kvtier.bench.models import make_family_model
    from tests.integration.test_connector import _engine_env

    model = make_family_model("gemma3-swa")
    out = tmp_path / "events.json"
    with open(tmp_path / "engine.log", "w") as log:
        proc = subprocess.run([sys.executable, str(HERE / "_hybrid_events_engine.py"), str(model), str(out)],
                              env=_engine_env(), stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = (tmp_path / "engine.log").read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    res = json.loads(out.read_text())
    assert "Turning off hybrid kv cache manager" not in text
    groups = res["groups"]  # the engine's own: group index -> [kind, window], from its GPU events
    assert sorted(groups.values()) == [["full_attention", None]] + [["sliding_window", 512]] * 3
    kvtier = res["kvtier"]  # group index -> [(chunk index, hashes match the engine's)]
    assert set(kvtier) == set(groups)
    for g, (kind, window) in groups.items():
        assert res["kvtier_kinds"][g] == [kind, window]
        chunks = [c for c, _ in kvtier[g]]
        # 2,000 tokens: a re-read resumes at 15 chunks of 128; a window of 512 keeps chunks 11..14
        assert chunks == (list(range(15)) if kind == "full_attention" else [11, 12, 13, 14]), (g, chunks)
        assert all(same for _, same in kvtier[g])
    assert res["kvtier_index"] == {"run": 15, "orphans": 0, "ignored": 0}
    assert res["engine_index"]["run"] == 15 and res["engine_index"]["ignored"] == 0

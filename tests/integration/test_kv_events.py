"""The connector's KV events are shaped as the engine's own (issue 11, part 1).

Real vLLM ``Request`` objects hashed by vLLM's own block hasher (as the engine core builds them)
go through the connector's scheduler side; the worker's store events come back as vLLM would
deliver them. What a router needs is checked field by field, then end to end through the
publisher's wire format (msgpack, as vLLM's ZMQ publisher encodes it) into ``kvtier route``'s
index, which must place the chunk under the engine, its medium and the same content keys as the
engine's own GPU blocks of the same prompt.
"""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("vllm")

from tests.integration._vllm_config import CHUNK, make_tiny_model, scheduler_connector, vllm_config  # noqa: E402

BLOCK = 16
PROMPT = 4 * CHUNK + 5  # 4 full chunks and a partial one


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ev") / "model")


@pytest.fixture
def connector(model):
    conn = scheduler_connector(vllm_config(model, events=True))
    yield conn
    conn.shutdown()


_ids = iter(range(10**6))


def hasher():
    """vLLM's block hasher, set up as the engine core sets it up (sha256, fixed seed)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK, fn)


def request(tokens, lora=None, salt=None, hashed=True):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    lora_req = LoRARequest(lora, 7, "/nonexistent/" + lora) if lora else None
    return Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, lora_request=lora_req, cache_salt=salt,
                   block_hasher=hasher() if hashed else None)


def saved_events(connector, req, media=("CPU",)):
    """Plan the saves of ``req``'s whole prompt, report them stored in ``media``, take the events."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierMetadata, KVTierWorkerMetadata

    state = connector._request_state(req)
    state.block_ids = list(range(len(req.prompt_token_ids) // BLOCK + 1))
    meta = KVTierMetadata()
    connector._plan(meta, req.request_id, state, len(req.prompt_token_ids))
    connector.take_events()
    stored = [("stored", s.key, m) for m in media for s in meta.saves]
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(stored)))
    return state, connector.take_events()


def test_stored_chunks_carry_the_engines_own_block_hashes_tokens_and_block_size(connector):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = [(i * 7) % 900 + 3 for i in range(PROMPT)]
    req = request(tokens)
    engine = [maybe_convert_block_hash(h) for h in req.block_hashes]
    assert engine and all(isinstance(h, int) for h in engine)  # vLLM's default: 64-bit ints
    _, events = saved_events(connector, req)
    assert len(events) == 4 and all(isinstance(e, BlockStored) for e in events)
    bpc = CHUNK // BLOCK
    for c, e in enumerate(events):
        assert e.block_hashes == engine[c * bpc:(c + 1) * bpc]
        assert e.parent_block_hash == (engine[c * bpc - 1] if c else None)
        assert e.block_size == BLOCK and e.token_ids == tokens[c * CHUNK:(c + 1) * CHUNK]
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size  # what vllm-router checks
        assert (e.medium, e.locality, e.ownership) == ("CPU", "LOCAL", None)
        assert e.lora_name is None and e.extra_keys is None and e.group_idx == 0


def test_media_locality_and_ownership_tell_ram_disk_and_shared_tiers_apart(connector):
    _, events = saved_events(connector, request(range(100, 100 + 2 * CHUNK)), media=("CPU", "DISK", "REDIS", "S3"))
    seen = {(e.medium, e.locality, e.ownership) for e in events}
    assert seen == {("CPU", "LOCAL", None), ("STORAGE", "LOCAL", None), ("STORAGE", "REMOTE", "kvtier:redis"),
                    ("STORAGE", "REMOTE", "kvtier:s3")}


def test_removals_carry_the_same_hashes_in_the_same_medium(connector):
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    state, stored = saved_events(connector, request(range(200, 200 + 2 * CHUNK)), media=("DISK",))
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(
        [("removed", k, "DISK") for k in state.keys])))
    removed = connector.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert [e.block_hashes for e in removed] == [e.block_hashes for e in stored]
    assert {(e.medium, e.locality) for e in removed} == {("STORAGE", "LOCAL")}


def test_lora_and_salt_ride_as_vllm_sets_them(connector):
    tokens = list(range(300, 300 + 2 * CHUNK))
    _, events = saved_events(connector, request(tokens, lora="adapter-a", salt="tenant-1"))
    assert all(e.lora_name == "adapter-a" and e.lora_id == 7 for e in events)
    # one entry per block: the LoRA name, and the salt on the prompt's first block only
    assert events[0].extra_keys == [("adapter-a", "tenant-1"), ("adapter-a",)]
    assert events[1].extra_keys == [("adapter-a",), ("adapter-a",)]


def test_without_engine_hashes_the_stand_ins_are_ints_and_chain(connector):
    """Prefix caching off: the engine keeps no hashes; kvtier derives stand-ins, in the same type,
    that still chain chunk to chunk."""
    _, events = saved_events(connector, request(range(400, 400 + 3 * CHUNK), hashed=False))
    assert all(isinstance(h, int) and 0 <= h < 2**64 for e in events for h in e.block_hashes)
    for prev, e in zip(events, events[1:]):
        assert e.parent_block_hash == prev.block_hashes[-1]


def test_a_chunk_loaded_then_promoted_is_published_with_its_tokens(connector):
    """A chunk found in a lower tier (stored by an earlier engine) and promoted into RAM on load:
    its store event must still carry tokens and hashes (this scheduler never planned its save)."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    tokens = list(range(500, 500 + 2 * CHUNK + 3))
    req = request(tokens)
    state = connector._request_state(req)
    state.hit_chunks, state.local_tokens = 2, 0
    state.block_ids = list(range(5))
    state.load = (0, 2, 0)
    connector.scheduler._take_load(req.request_id, state, background=False)
    connector.take_events()
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(
        [("stored", k, "CPU") for k in state.keys[:2]])))
    events = connector.take_events()
    assert [e.token_ids for e in events] == [tokens[:CHUNK], tokens[CHUNK:2 * CHUNK]]


def test_an_unknown_chunk_is_not_published_malformed(connector):
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    connector.take_events()
    before = connector.scheduler.chunk_events.dropped
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(
        [("stored", hashlib.sha256(b"never planned").digest(), "CPU")])))
    assert connector.take_events() == []
    assert connector.scheduler.chunk_events.dropped == before + 1


def test_no_events_are_kept_when_vllm_publishes_none(model):
    conn = scheduler_connector(vllm_config(model))
    try:
        assert conn.scheduler.chunk_events is None
        _, events = saved_events(conn, request(range(600, 600 + 2 * CHUNK)))
        assert events == []
    finally:
        conn.shutdown()


def test_the_router_index_places_kvtier_chunks_on_the_engines_own_prefix(connector):
    """Through the wire: the engine's GPU events for a prompt, then kvtier's for the same prompt,
    encoded as vLLM's publisher encodes them, decoded by ``kvtier route``: the kvtier chunks land
    on the same content keys as the GPU blocks, under the engine and kvtier's media, and stay
    there after the GPU blocks are removed."""
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier.route.events import apply_events, decode_batch
    from kvtier.route.index import PrefixIndex, chunk_keys

    tokens = [(i * 13) % 950 + 2 for i in range(4 * CHUNK)]
    req = request(tokens)
    engine = [maybe_convert_block_hash(h) for h in req.block_hashes]
    gpu = BlockStored(block_hashes=engine, parent_block_hash=None, token_ids=tokens, block_size=BLOCK, lora_id=None,
                      medium="GPU", lora_name=None)
    _, kvtier_events = saved_events(connector, req, media=("CPU", "DISK"))
    index = PrefixIndex()
    encoder = msgspec.msgpack.Encoder()
    for events in ([gpu], kvtier_events, [BlockRemoved(block_hashes=engine, medium="GPU")]):
        apply_events(index, "engine-a", decode_batch(encoder.encode(EventBatch(ts=0.0, events=events))))
    keys = chunk_keys(tokens, BLOCK)
    assert len(keys) == len(tokens) // BLOCK
    assert all(index.holders(k) == {"engine-a": {"CPU", "STORAGE"}} for k in keys)
    assert index.orphans == 0


def test_with_several_workers_events_follow_rank_0_stage_0s_keys(model):
    """With pipeline stages (or TP ranks) each worker stores its own share under its own key; the
    scheduler hears rank 0 / stage 0's events and must still find each chunk's fields."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierMetadata, KVTierWorkerMetadata
    from kvtier.keys import worker_key

    conn = scheduler_connector(vllm_config(model, pp=2, events=True))
    try:
        tokens = list(range(700, 700 + 2 * CHUNK))
        req = request(tokens)
        state = conn._request_state(req)
        state.block_ids = list(range(5))
        meta = KVTierMetadata()
        conn._plan(meta, req.request_id, state, len(tokens))
        shares = [worker_key(k, 0, 1, 0, 2) for k in state.keys]
        assert shares != state.keys
        conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(
            [("stored", k, "CPU") for k in shares])))
        events = conn.take_events()
        assert [e.token_ids for e in events] == [tokens[:CHUNK], tokens[CHUNK:]]
    finally:
        conn.shutdown()


def test_with_a_cache_server_every_medium_is_a_remote_pool_of_the_node():
    """A per-node cache server's tiers are loaded by every engine of the node: REMOTE with an
    ownership naming the server's pool (vllm-router admits REMOTE only with an ownership and
    LOCAL only without one); ``kvtier route`` reads them back as the server."""
    from kvtier.integrations.vllm.events import event_medium
    from kvtier.route.index import normalize_medium

    assert event_medium("CPU", server=True) == ("CPU", "REMOTE", "kvtier:server/cpu")
    assert event_medium("DISK", server=True) == ("STORAGE", "REMOTE", "kvtier:server/disk")
    for medium in ("CPU", "DISK", "REDIS"):
        assert normalize_medium(*event_medium(medium, server=True)) == "SERVER"
    for medium, expected in (("CPU", "CPU"), ("DISK", "STORAGE"), ("FS", "FS"), ("S3", "S3")):
        med, locality, ownership = event_medium(medium)
        assert (locality == "LOCAL") == (ownership is None)
        assert normalize_medium(med, locality, ownership) == expected

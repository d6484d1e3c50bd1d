"""Hostile producers, operators and clients against the per-group (hybrid model) KV events of
``kvtier route``: adversarial group fields, floods that grow memory or CPU per request, window
scoring against its own definition, a model whose only group is a sliding window, and the event
loop's error handler under distinct messages. One test runs a real ``kvtier route`` child with a
real ZMQ publisher of the test's own."""

from __future__ import annotations

import logging
import random
import threading
import time

import msgspec
import pytest
import requests

from kvtier.route.events import apply_events, decode_batch
from kvtier.route.index import GPU, MAX_GROUPS, MAX_MEDIA, PrefixIndex, chunk_keys
from kvtier.route.score import Speculative, prefix_matches
from tests.route.test_front_door import Router, _until, stub  # noqa: F401  (stub: the fixture)

BS = 4


def _stored(engine_hashes, parent, tokens, **fields):
    ev = {"type": "BlockStored", "block_hashes": engine_hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": BS, "medium": "GPU"}
    ev.update(fields)
    return ev


def _apply(index, *events, engine="A"):
    return apply_events(index, engine, decode_batch(msgspec.msgpack.encode([0.0, list(events), 0])))


def _window_run_reference(index, engine, keys, run, shared_media=frozenset(), also=None):
    """``PrefixIndex.window_run`` by its definition: the largest n <= run whose every window
    group's blocks [max(0, n*B - w + 1) // B, n) are all in the engine's pool or all in
    kvtier's tiers (the implementation before it was made linear, kept as the oracle)."""
    windows = index.windows(engine)
    if not windows or run <= 0 or index.block_size <= 0:
        return run
    bs = index.block_size

    def sources(group, i):
        entry = index._windows.get(keys[i], {})
        own = entry.get((engine, group), set())
        pool = GPU in own or (also is not None and also(i))
        tiers = bool(own - {GPU}) or any(g == group and media & shared_media for (_, g), media in entry.items())
        return pool, tiers

    for n in range(run, 0, -1):
        need = [(g, i) for g, w in windows.items() for i in range(max(0, n * bs - w + 1) // bs, n)]
        if all(sources(g, i)[0] for g, i in need) or all(sources(g, i)[1] for g, i in need):
            return n
    return 0


# --- CPU: one request's scoring must not be quadratic in its prompt ------------------------------

def test_window_scoring_of_a_long_prompt_is_linear_not_quadratic():
    """A window group holding only the prompt's last block, with a window longer than the prompt
    (2**40 tokens, as a hostile or buggy producer may claim): every cut n needs blocks 0..n-1, and
    the scan tried each n with a fresh list, O(blocks**2) on the event loop (8192 blocks: ~7 s
    here; the router keys up to 65536 blocks of a prompt by default)."""
    blocks = 8192
    index = PrefixIndex(max_keys=10 * blocks, block_size=16)
    toks = list(range(blocks * 16))
    hashes = list(range(1, blocks + 1))
    index.apply_stored("A", hashes, None, toks, 16, "GPU", group=1, kind="full_attention")
    index.apply_stored("A", hashes[-1:], hashes[-2], toks[-16:], 16, "GPU", group=0, kind="sliding_window",
                       window=2**40)
    keys = chunk_keys(toks, 16)
    t0 = time.perf_counter()
    result = prefix_matches(keys, ["A"], index, None, lambda m: 1.0, frozenset())
    took = time.perf_counter() - t0
    assert result["A"] == (0.0, 0)
    assert took < 2.0, f"{took:.1f} s to score one prompt of {blocks} blocks"


@pytest.mark.parametrize("seed", range(40))
def test_window_run_agrees_with_its_definition(seed):
    """Random holdings of two window groups over pool, a tier and a shared pool, with speculative
    blocks: the linear scan returns what the definition does."""
    rng = random.Random(seed)
    blocks = rng.randint(1, 24)
    index = PrefixIndex(max_keys=10_000, block_size=BS)
    toks = list(range(blocks * BS))
    hashes = list(range(100, 100 + blocks))
    index.apply_stored("A", hashes, None, toks, BS, "GPU", group=0, kind="full_attention")
    windows = {1: rng.choice([1, 3, 5, 8, 9, 13, 40]), 2: rng.choice([2, 4, 9, 17, 100])}
    for g, w in windows.items():
        for b in range(blocks):
            for medium in ("GPU", "CPU"):
                if rng.random() < 0.7:
                    index.apply_stored("A", [hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS],
                                       BS, medium, group=g, kind="sliding_window", window=w)
            if rng.random() < 0.2:
                index.apply_stored("B", [hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS],
                                   BS, "REDIS", group=g, kind="sliding_window", window=w)
    keys = chunk_keys(toks, BS)
    spec = {i for i in range(blocks) if rng.random() < 0.2}
    for run in range(blocks + 1):
        for shared in (frozenset(), frozenset({"REDIS"})):
            for also in (None, spec.__contains__):
                want = _window_run_reference(index, "A", keys, run, shared, also)
                assert index.window_run("A", keys, run, shared, also) == want, (run, shared, also)


# --- memory: a producer's group indices and media ----------------------------------------------

def test_distinct_group_indices_do_not_grow_an_engine_without_bound():
    """Every event a new ``group_idx`` (any kind): each was remembered per engine forever, and a
    key's holding kept a set of every naming group (memory O(events), not O(max_keys))."""
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = list(range(BS))
    kinds = ["full_attention", "sliding_window", "mamba", "chunked_local_attention"]
    events = [_stored([1], None, toks, group_idx=g, kv_cache_spec_kind=kinds[g % 4],
                      kv_cache_spec_sliding_window=8) for g in range(20_000)]
    _apply(index, *events)
    assert len(index._roles["A"]) <= MAX_GROUPS
    key = chunk_keys(toks, BS)[0]
    assert all(len(groups) <= MAX_GROUPS for groups in index._keys[key]["A"].values())
    assert index.ignored >= 20_000 - MAX_GROUPS  # past the bound: counted, not indexed
    # the groups it knew keep working; a new engine has its own bound
    _apply(index, _stored([1], None, toks, group_idx=0, kv_cache_spec_kind="full_attention"), engine="B")
    assert index.holders(key)["B"] == {"GPU"}


def test_distinct_media_do_not_grow_a_key_without_bound():
    """The same block re-stored under a new ``medium`` (or ``ownership`` ``kvtier:<anything>``)
    each time: a key's holding kept every medium string ever named."""
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = list(range(BS))
    _apply(index, _stored([1], None, toks))
    _apply(index, *[_stored([1], None, toks, medium=f"M{i}") for i in range(5_000)])
    _apply(index, *[_stored([1], None, [], medium="STORAGE", locality="REMOTE", ownership=f"kvtier:t{i}")
                    for i in range(5_000)])
    key = chunk_keys(toks, BS)[0]
    assert len(index._keys[key]["A"]) <= MAX_MEDIA
    assert "GPU" in index.holders(key)["A"]


def test_a_negative_group_index_is_malformed_counted_and_skipped():
    """vLLM's group indices are list positions (>= 0): -1 was indexed as a group of its own."""
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = list(range(BS))
    counts = _apply(index, _stored([1], None, toks, group_idx=-1, kv_cache_spec_kind="full_attention"),
                    {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": -5},
                    _stored([2], None, list(range(10, 14))))
    assert counts["malformed"] == 2
    assert -1 not in index._roles.get("A", {})
    assert len(index) == 1


# --- scoring: a model whose only KV cache group is a sliding window ------------------------------

def test_an_engine_whose_only_group_is_a_sliding_window_is_scored():
    """vLLM gives a model whose every layer has the same sliding window (Mistral-7B-v0.1's 4096)
    one ``sliding_window`` group 0. No group names the prefix, so no key was ever held: such an
    engine scored 0 for every prompt (a dense engine without kinds scored its blocks). vLLM's
    prefix cache hit there needs only the window before the boundary."""
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = list(range(10 * BS))
    hashes = list(range(1, 11))
    swa = dict(group_idx=0, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=9)  # 2 blocks
    _apply(index, *[_stored([hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS], **swa)
                    for b in range(10)])
    keys = chunk_keys(toks, BS)
    weights = {"GPU": 1.0, "CPU": 0.5}.get
    assert prefix_matches(keys, ["A"], index, None, lambda m: weights(m, 0.0), frozenset())["A"] == (10.0, 10)
    # the window slid: blocks 0..5 removed, 6..9 kept; a prompt of 10 blocks still hits at 10
    _apply(index, {"type": "BlockRemoved", "block_hashes": hashes[:6], "medium": "GPU", "group_idx": 0})
    assert prefix_matches(keys, ["A"], index, None, lambda m: weights(m, 0.0), frozenset())["A"] == (10.0, 10)
    # one of 7 blocks: its window (blocks 5, 6) is not whole: cut back to 0 (4 needs 2, 3; ...)
    assert prefix_matches(keys[:7], ["A"], index, None, lambda m: weights(m, 0.0), frozenset())["A"] == (0.0, 0)
    # the window in kvtier's RAM tier only: counted at the tier's weight
    _apply(index, _stored(hashes[8:10], hashes[7], toks[8 * BS:], medium="CPU", **swa))
    _apply(index, {"type": "BlockRemoved", "block_hashes": hashes[8:10], "medium": "GPU", "group_idx": 0})
    assert prefix_matches(keys, ["A"], index, None, lambda m: weights(m, 0.0), frozenset())["A"] == (5.0, 10)
    # a block just routed there counts as in its pool
    spec = Speculative(5.0, 100)
    spec.add("A", keys)
    assert prefix_matches(keys, ["A"], index, spec, lambda m: weights(m, 0.0), frozenset())["A"] == (10.0, 10)


# --- the event loop's error handler -------------------------------------------------------------

def test_distinct_loop_errors_are_bounded_in_memory_and_in_lines(caplog):
    """Each distinct message kept two dict entries forever (asyncio's "Exception in callback
    <handle ...>" names objects by address: every one differs), and distinct messages were
    never rate-limited: 20,000 of them were 20,000 lines."""
    from kvtier.cli.route import _LoopErrors

    handler = _LoopErrors(logging.getLogger("kvtier.route.attack"), interval_s=60.0)
    with caplog.at_level(logging.ERROR, logger="kvtier.route.attack"):
        for i in range(20_000):
            handler(None, {"message": f"Exception in callback <Handle at 0x{i:x}>"})
    cap = handler.max_messages
    assert len(handler._last) + len(handler._quiet) <= 2 * cap
    assert len(caplog.records) <= 2 * cap, len(caplog.records)


# --- a real router: one hostile producer must not stall /health -----------------------------------

def test_a_hostile_window_does_not_stall_the_router(stub, tmp_path):  # noqa: F811  (the fixture)
    """A real ``kvtier route`` and a ZMQ publisher of the test's: a full group naming 16,000
    blocks and a window group claiming a window of 2**40 tokens holding only the last one. One
    request with that prompt was seconds of scoring on the event loop, /health unanswered."""
    import zmq

    from kvtier.harness.services import free_port

    blocks, bs = 16_000, 16
    toks = list(range(blocks * bs))
    hashes = list(range(1, blocks + 1))
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    r = Router(tmp_path, "hostile", {"engines": [{"url": stub.url, "kv_events": f"tcp://127.0.0.1:{port}"}],
                                     "block_size": bs})
    events = [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": toks,
               "block_size": bs, "medium": "GPU", "group_idx": 1, "kv_cache_spec_kind": "full_attention"},
              {"type": "BlockStored", "block_hashes": hashes[-1:], "parent_block_hash": hashes[-2],
               "token_ids": toks[-bs:], "block_size": bs, "medium": "GPU", "group_idx": 0,
               "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 2**40}]
    stop = threading.Event()
    worst = [0.0]
    probes = [0]  # health probes answered (or failed) so far

    def watch():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                requests.get(r.base + "/health", timeout=60)
            except requests.RequestException:
                pass
            worst[0] = max(worst[0], time.monotonic() - t0)
            probes[0] += 1
            time.sleep(0.05)  # the probe's own pace, not a wait for anything

    try:
        seq = 0

        def indexed():
            nonlocal seq
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), events, 0])])
            seq += 1
            return r.health()["index_keys"] >= blocks

        _until(indexed, 30, "the publisher's blocks indexed")
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _until(lambda: probes[0] >= 1, 30, "the health watcher probing")
        resp = requests.post(r.base + "/v1/completions", json={"prompt": toks, "max_tokens": 1}, timeout=120)
        assert resp.status_code == 200
        after = probes[0]
        _until(lambda: probes[0] >= after + 2, 60, "a health probe after the request")
        stop.set()
        watcher.join(60)
        assert worst[0] < 3.0, f"/health waited {worst[0]:.1f} s behind one request's scoring"
        assert "Traceback" not in r.text()
    finally:
        stop.set()
        r.stop()
        pub.close(linger=0)
        ctx.term()


def test_a_group_that_changes_kind_leaves_no_stale_holding():
    """Group 1 stores a block as full attention, turns into a sliding-window group, removes the
    block, then is full attention again: the removal acted on the window role only, so the block
    came back as held by group 1 (the engine no longer has it)."""
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = list(range(BS))
    key = chunk_keys(toks, BS)[0]
    _apply(index, _stored([1], None, toks, group_idx=0, kv_cache_spec_kind="full_attention"),
           _stored([1], None, toks, group_idx=1, kv_cache_spec_kind="full_attention"))
    assert index.holders(key) == {"A": {"GPU"}}
    _apply(index, _stored([2], None, list(range(10, 14)), group_idx=1, kv_cache_spec_kind="sliding_window",
                          kv_cache_spec_sliding_window=8),
           {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1},
           _stored([2], None, list(range(10, 14)), group_idx=1, kv_cache_spec_kind="full_attention"))
    assert index.holders(key) is None

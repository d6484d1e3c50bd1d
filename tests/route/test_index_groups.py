"""The index on hybrid models (several KV cache groups): the full-attention groups name a prefix, a
sliding-window group must hold its window before the boundary, other groups are ignored (counted),
never indexed as something they are not. Events as vLLM's block pool and kvtier's connector
publish them (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``), decoded
from vLLM's wire encoding where the field types matter.
"""

from __future__ import annotations

import msgspec
import pytest

from kvtier.route.events import apply_events, decode_batch
from kvtier.route.index import PrefixIndex, chunk_keys
from kvtier.route.score import Speculative, prefix_matches

BS = 4
WINDOW = 9  # tokens: resuming at n blocks needs blocks [max(0, 4n - 8) // 4, n), i.e. the last 2
FULL = dict(group=1, kind="full_attention")
SWA = dict(group=0, kind="sliding_window", window=WINDOW)


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def _hashes(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def _run(index, tokens, engines=("A",), shared=frozenset(), speculative=None):
    keys = chunk_keys(tokens, BS)
    return {e: run for e, (_, run) in prefix_matches(keys, list(engines), index, speculative, lambda m: 1.0,
                                                     shared).items()}


def _hybrid(blocks: int = 10, window_blocks: range | None = None, medium: str = "GPU") -> tuple[PrefixIndex, list]:
    """An engine "A" whose full group (1) holds ``blocks`` blocks and whose window group (0)
    holds ``window_blocks`` of them (one event per block, chained as vLLM chains them)."""
    index = PrefixIndex(max_keys=1000, block_size=BS)
    toks = _tokens(blocks * BS)
    hashes = _hashes(blocks)
    for b in range(blocks):
        index.apply_stored("A", [hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS], BS, medium,
                           **FULL)
    for b in window_blocks if window_blocks is not None else range(blocks):
        index.apply_stored("A", [hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS], BS, medium,
                           **SWA)
    return index, toks


def test_a_dense_engine_is_unchanged_and_group_0_without_a_kind_names_the_prefix():
    index = PrefixIndex(max_keys=100)
    toks = _tokens(12)
    index.apply_stored("A", [1, 2, 3], None, toks, BS, "GPU")  # no group fields (an older producer)
    index.apply_stored("B", [1, 2, 3], None, toks, BS, "GPU", group=0, kind="full_attention")
    assert _run(index, toks, ("A", "B")) == {"A": 3, "B": 3}
    assert index.windows("A") == {} and index.windows("B") == {}
    assert index.apply_removed("B", [3], "GPU", group=0) == 1
    assert _run(index, toks, ("A", "B")) == {"A": 3, "B": 2}


def test_the_run_is_cut_back_to_where_every_window_group_holds_its_window():
    index, toks = _hybrid(10, window_blocks=range(4, 7))  # the window holds blocks 4..6 only
    assert index.windows("A") == {0: WINDOW}
    assert all(index.holders(k) == {"A": {"GPU"}} for k in chunk_keys(toks, BS))  # the full group names all 10
    # n = 10 needs window blocks 8, 9; ... n = 7 needs 5, 6 (held): the run is 7, not 10
    assert _run(index, toks) == {"A": 7}
    assert _run(index, toks[:6 * BS]) == {"A": 6}  # needs 4, 5
    assert _run(index, toks[:4 * BS]) == {"A": 0}  # needs 2, 3; so does every shorter one (1: needs 0)
    full, _ = _hybrid(10)
    assert _run(full, toks) == {"A": 10}


def test_a_window_groups_event_that_skips_null_blocks_names_the_trailing_blocks():
    """vLLM's block pool leaves a window group's null blocks (before the window) out of
    ``block_hashes`` while ``token_ids`` covers the whole range."""
    index, toks = _hybrid(8, window_blocks=range(0))
    hashes = _hashes(8)
    assert index.apply_stored("A", hashes[5:8], None, toks[:8 * BS], BS, "GPU", **SWA) == 3
    assert _run(index, toks) == {"A": 8}
    assert index.orphans == 0
    # the window group's removal of block 6 drops its copy only
    assert index.apply_removed("A", [hashes[6]], "GPU", group=0) == 1
    assert _run(index, toks) == {"A": 0}  # n = 8, 7 need block 6; n <= 6 need blocks before 5
    assert all(index.holders(k) == {"A": {"GPU"}} for k in chunk_keys(toks, BS))


def test_groups_it_does_not_index_are_ignored_and_counted():
    index, toks = _hybrid(4)
    before = len(index)
    others = [dict(group=2, kind="chunked_local_attention"), dict(group=3, kind="mamba"),
              dict(group=4, kind="something_new"), dict(group=5), dict(group=6, kind="sliding_window")]
    for fields in others:  # a window without its size is not a window it can check
        assert index.apply_stored("A", [1], None, toks[:BS], BS, "GPU", **fields) == 0
        assert index.apply_removed("A", _hashes(4), "GPU", group=fields["group"]) == 0
    assert index.ignored == 2 * len(others)
    assert len(index) == before and index.windows("A") == {0: WINDOW}
    assert _run(index, toks) == {"A": 4}
    # a removal of a group only ever seen ignored does not touch the naming group's blocks
    assert all(index.holders(k) == {"A": {"GPU"}} for k in chunk_keys(toks, BS))


def test_a_key_counts_once_every_naming_group_holds_it_in_that_medium():
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = _tokens(8)
    index.apply_stored("A", [1, 2], None, toks, BS, "GPU", group=0, kind="full_attention")
    index.apply_stored("A", [1, 2], None, toks, BS, "GPU", group=1, kind="mla_attention")
    index.apply_stored("A", [1, 2], None, [], BS, "CPU", group=0)  # offload report: group 0 only
    keys = chunk_keys(toks, BS)
    assert index.holders(keys[0]) == {"A": {"GPU"}}
    index.apply_stored("A", [1], None, [], BS, "CPU", group=1)
    assert index.holders(keys[0]) == {"A": {"GPU", "CPU"}} and index.holders(keys[1]) == {"A": {"GPU"}}
    index.apply_removed("A", [1, 2], "GPU", group=1)
    assert index.holders(keys[0]) == {"A": {"CPU"}} and index.holders(keys[1]) is None


def test_a_shared_pools_window_counts_for_every_engine_and_a_routed_block_for_its_engine():
    index, toks = _hybrid(6, window_blocks=range(1), medium="GPU")  # A's window group holds block 0 only
    hashes = _hashes(6)
    # engine B stored the window (and the prefix) in a pool every engine loads
    for b in range(6):
        for fields in (FULL, SWA):
            index.apply_stored("B", [hashes[b]], hashes[b - 1] if b else None, toks[b * BS:(b + 1) * BS], BS,
                               "REDIS", **fields)
    assert _run(index, toks, ("A", "B")) == {"A": 1, "B": 6}
    assert _run(index, toks, ("A", "B"), shared=frozenset({"REDIS"})) == {"A": 6, "B": 6}
    alone, _ = _hybrid(6, window_blocks=range(1))
    assert _run(alone, toks) == {"A": 1}
    spec = Speculative(ttl_s=60.0, max_keys=100)
    spec.add("A", chunk_keys(toks, BS))
    assert _run(alone, toks, speculative=spec) == {"A": 6}


def test_clear_engine_forgets_its_windows_and_roles():
    index, toks = _hybrid(4)
    index.clear_engine("A")
    assert index.windows("A") == {} and len(index) == 0 and _run(index, toks) == {"A": 0}


def _wire(*events: dict) -> list:
    """Events as vLLM's publisher puts them on the wire (tagged maps in an array-like batch)."""
    return decode_batch(msgspec.msgpack.encode([0.0, list(events), None]))


def _stored(hashes, parent, tokens, **fields) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **fields}


@pytest.mark.parametrize("bad", [{"group_idx": "1"}, {"group_idx": True}, {"kv_cache_spec_kind": 3},
                                 {"kv_cache_spec_sliding_window": "9"}])
def test_malformed_group_fields_are_counted_and_skipped(bad):
    index = PrefixIndex(max_keys=100, block_size=BS)
    counts = apply_events(index, "A", _wire(_stored([1], None, _tokens(4), **bad),
                                            _stored([2], 1, _tokens(4, 4))))
    assert counts == {"BlockStored": 2, "malformed": 1}


def test_group_fields_cross_the_wire():
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = _tokens(8)
    apply_events(index, "A", _wire(
        _stored([1, 2], None, toks, group_idx=1, kv_cache_spec_kind="full_attention"),
        _stored([1, 2], None, toks, group_idx=0, kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=WINDOW),
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0}))
    assert index.windows("A") == {0: WINDOW} and index.ignored == 0
    assert _run(index, toks) == {"A": 1}  # n = 2 needs window blocks 0, 1 (1 is gone); n = 1 needs 0
    assert all(index.holders(k) == {"A": {"GPU"}} for k in chunk_keys(toks, BS))


def test_a_window_split_between_the_pool_and_kvtiers_tiers_is_not_loadable():
    """vLLM resumes a window from its own pool, kvtier's lookup from its tiers: the window at the
    boundary must be whole in one of them."""
    index, toks = _hybrid(6, window_blocks=range(0))
    hashes = _hashes(6)

    def window(b, medium):
        index.apply_stored("A", [hashes[b]], hashes[b - 1], toks[b * BS:(b + 1) * BS], BS, medium, **SWA)

    window(4, "GPU")
    window(5, "CPU")
    assert _run(index, toks) == {"A": 0}  # n = 6 needs 4 and 5: one in each; shorter n need blocks not held
    window(4, "CPU")
    assert _run(index, toks) == {"A": 6}
    index.apply_removed("A", [hashes[4]], "CPU", group=0)
    window(5, "GPU")
    assert _run(index, toks) == {"A": 6}  # 4 and 5 both in the pool

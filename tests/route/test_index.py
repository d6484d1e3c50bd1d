"""The content-keyed index: keys from events equal keys from prompts, bounds, removals."""

from __future__ import annotations

from kvtier.route.index import PrefixIndex, chunk_keys, normalize_medium, root_key

BS = 4


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_event_keys_equal_prompt_keys_whatever_the_engine_hashes():
    index = PrefixIndex(max_keys=100)
    toks = _tokens(12)
    # engine A announces 3 blocks in one event; engine B in three events, with other hash values
    index.apply_stored("A", [11, 12, 13], None, toks, BS, "GPU")
    index.apply_stored("B", [b"x"], None, toks[:4], BS, "GPU")
    index.apply_stored("B", [b"y"], b"x", toks[4:8], BS, "GPU")
    index.apply_stored("B", [b"z"], b"y", toks[8:12], BS, "GPU")
    keys = chunk_keys(toks + [99, 98], BS)  # the trailing partial block has no key
    assert len(keys) == 3
    for key in keys:
        assert set(index.holders(key)) == {"A", "B"}
    assert index.block_size == BS


def test_orphan_event_adds_nothing_and_is_counted():
    index = PrefixIndex(max_keys=100)
    assert index.apply_stored("A", [2], 1, _tokens(4), BS, "GPU") == 0
    assert index.orphans == 1 and len(index) == 0


def test_partial_and_malformed_blocks_are_not_indexed():
    index = PrefixIndex(max_keys=100, block_size=BS)
    assert index.apply_stored("A", [1], None, _tokens(3), 3, "GPU") == 0  # partial block event
    assert index.apply_stored("A", [1, 2], None, _tokens(5), BS, "GPU") == 0  # token count mismatch
    assert len(index) == 0


def test_larger_event_blocks_split_into_index_blocks():
    index = PrefixIndex(max_keys=100, block_size=BS)
    toks = _tokens(16)
    assert index.apply_stored("A", [b"k1", b"k2"], None, toks, 2 * BS, "DISK") == 4
    for key in chunk_keys(toks, BS):
        assert index.holders(key) == {"A": {"DISK"}}
    assert index.apply_removed("A", [b"k2"], "DISK") == 2
    assert [index.holders(k) is not None for k in chunk_keys(toks, BS)] == [True, True, False, False]


def test_removal_is_per_medium_and_unknown_removals_are_ignored():
    index = PrefixIndex(max_keys=100)
    toks = _tokens(4)
    index.apply_stored("A", [1], None, toks, BS, "GPU")
    index.apply_stored("A", [1], None, [], BS, "CPU")  # offload report without tokens: known hash
    key = chunk_keys(toks, BS)[0]
    assert index.holders(key) == {"A": {"GPU", "CPU"}}
    assert index.apply_removed("A", [1], "GPU") == 1
    assert index.holders(key) == {"A": {"CPU"}}
    assert index.apply_removed("A", [777], "CPU") == 0
    assert index.apply_removed("Z", [1], "CPU") == 0
    assert index.apply_removed("A", [1], "CPU") == 1
    assert index.holders(key) is None and len(index) == 0


def test_clear_engine_drops_only_that_engine():
    index = PrefixIndex(max_keys=100)
    toks = _tokens(8)
    index.apply_stored("A", [1, 2], None, toks, BS, "GPU")
    index.apply_stored("B", [1], None, toks[:4], BS, "GPU")
    assert index.clear_engine("A") == 2
    keys = chunk_keys(toks, BS)
    assert index.holders(keys[0]) == {"B": {"GPU"}} and index.holders(keys[1]) is None
    # A's hash map is gone too: a child of its old block is now an orphan
    assert index.apply_stored("A", [3], 2, _tokens(4, 8), BS, "GPU") == 0


def test_index_is_bounded_lru():
    index = PrefixIndex(max_keys=5)
    for doc in range(4):
        index.apply_stored("A", [doc * 10 + i for i in range(3)], None, _tokens(12, doc * 100), BS, "GPU")
    assert len(index) == 5 and index.evicted == 7
    newest = chunk_keys(_tokens(12, 300), BS)
    assert all(index.holders(k) for k in newest)
    assert index.holders(chunk_keys(_tokens(12, 0), BS)[0]) is None


def test_namespace_separates_lora_prefixes():
    index = PrefixIndex(max_keys=100)
    index.apply_stored("A", [1], None, _tokens(4), BS, "GPU", namespace="adapter-x")
    assert index.holders(chunk_keys(_tokens(4), BS)[0]) is None
    assert index.holders(chunk_keys(_tokens(4), BS, namespace="adapter-x")[0]) is not None
    assert root_key("") != root_key("adapter-x")


def test_medium_names():
    assert normalize_medium(None) == "GPU"
    assert normalize_medium("disk") == "DISK"
    assert normalize_medium("STORAGE", "REMOTE") == "STORAGE_REMOTE"


def test_block_size_is_learned_from_the_engine_pool_not_a_tier_with_larger_chunks():
    index = PrefixIndex(max_keys=100)
    toks = _tokens(16)
    assert index.apply_stored("A", [b"c1"], None, toks[:8], 2 * BS, "DISK") == 0 and index.block_size == 0
    index.apply_stored("A", [1, 2], None, toks[:8], BS, "GPU")
    assert index.block_size == BS
    assert index.apply_stored("A", [b"c1", b"c2"], None, toks, 2 * BS, "DISK") == 4

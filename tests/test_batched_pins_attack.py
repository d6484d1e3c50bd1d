"""Hostile review of the batched pins and the cheaper lookups:

- ``RamTier.borrow_many`` (one lock hold to pin a batch, one to unpin it) against ``borrow``
  one key at a time: duplicates, deletes/replaces/evictions while pinned, exceptions in the
  block or while pinning, moves by a coded arena's coder, stats, leaked pages;
- ``TieredStore.borrow_top`` over it (hits, policy accesses, invalid keys);
- ``PageLayout._page_pairs`` / ``_pieces`` (cached page views, ``skip``) against the old
  per-piece generator, with multi-segment entries out of a fragmented small-page arena;
- ``chunk_keys``' packing of token ids (``array`` for lists and tuples) against the old numpy
  path, for every input kind that used to work and every one that used to be refused;
- the scheduler's namespace digest table and the worker's per-tier loaded-chunk counts.

Real tiers, stores and layouts throughout; internals are only read (readers counts) or, for the
coder's move, driven the way the coder drives them (``moving`` under the lock, then a notify).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from contextlib import ExitStack
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.pages import PageLayout
from kvtier.keys import ROOT, ChunkKey, Namespace, chunk_keys
from kvtier.policies.lru import LRUPolicy
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.ram import ArenaTier, RamConfig, RamTier

PAGE = 4096


def key(i: int) -> bytes:
    return hashlib.sha256(b"bp" + i.to_bytes(8, "little")).digest()


def payload(i: int, n: int = PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def joined(views) -> bytes | None:
    return None if views is None else b"".join(bytes(v) for v in views)


def ram(pages: int = 8, page: int = PAGE, **kw) -> RamTier:
    return RamTier(RamConfig(capacity=pages * page, page_size=page, pin_memory=False, **kw), name="ram")


def readers(tier: RamTier, k: bytes) -> int:
    with tier._lock:
        entry = tier._entries.get(k)
        return -1 if entry is None else entry.readers


def no_pages_lost(tier: RamTier) -> None:
    """Free pages = capacity less the pages of the entries held (no pin left, nothing leaked)."""
    held = sum(tier.footprint(tier.size_of(k)) for k in tier.keys())
    assert tier.free_bytes() == tier.arena_bytes - held


def fragmented(tier: RamTier, used: int, holes: list[int]) -> None:
    """Fill ``used`` single pages, then free ``holes``: later entries span non-adjacent pages."""
    for i in range(used):
        assert tier.put(key(10_000 + i), bytes([i % 251]) * tier._page)
    for i in holes:
        assert tier.delete(key(10_000 + i))


def counts(tier: RamTier) -> tuple[int, int, int]:
    s = tier.stats.as_dict()
    return s["hits"], s["misses"], s["bytes_read"]


# ----------------------------------------------------------------------------- RamTier.borrow_many


def test_duplicate_keys_pin_twice_and_unpin_twice():
    """A key twice in one batch: readers goes to 2 and back to 0; deleted meanwhile, its pages return only at the end."""
    tier = ram(4)
    tier.put(key(1), payload(1, 2 * PAGE))
    with tier._lock:
        entry = tier._entries[key(1)]
    with tier.borrow_many([key(1), key(1), key(2)]) as views:
        assert entry.readers == 2
        assert tier.delete(key(1))
        assert tier.free_bytes() == 2 * PAGE  # still pinned (twice)
        assert [joined(v) for v in views] == [payload(1, 2 * PAGE)] * 2 + [None]
    assert entry.readers == 0 and entry.pages == []
    assert tier.free_bytes() == 4 * PAGE


def test_stats_equal_n_single_borrows():
    """hits, misses and bytes_read after one batch equal those after one ``borrow`` per key (misses, duplicates, multi-page entries, empty batch)."""
    batch = [key(1), key(9), key(2), key(1), key(3), key(9), key(2)]
    tiers = [ram(16), ram(16)]
    for tier in tiers:
        fragmented(tier, 6, [1, 3, 5])
        tier.put(key(1), payload(1, PAGE + 5))
        tier.put(key(2), payload(2, 3 * PAGE - 1))
        tier.put(key(3), payload(3, 1))
    base = [counts(t) for t in tiers]
    with tiers[0].borrow_many(batch) as many:
        got_many = [joined(v) for v in many]
    with ExitStack() as stack:
        got_one = [joined(stack.enter_context(tiers[1].borrow(k))) for k in batch]
    assert got_many == got_one
    deltas = [tuple(a - b for a, b in zip(counts(t), base_t)) for t, base_t in zip(tiers, base)]
    assert deltas[0] == deltas[1] == (5, 2, 2 * (PAGE + 5) + 2 * (3 * PAGE - 1) + 1)
    with tiers[0].borrow_many([]) as nothing:
        assert nothing == []
    assert tuple(a - b for a, b in zip(counts(tiers[0]), base[0])) == deltas[0]


def test_batched_and_default_borrow_many_agree():
    """``RamTier.borrow_many`` yields what ``ArenaTier``'s default (one ``borrow`` per key) yields, on a fragmented arena."""
    tier = ram(32, page=512)
    fragmented(tier, 20, [2, 4, 5, 9, 13, 17, 18])
    for i in range(6):
        assert tier.put(key(i), payload(i, 400 + 300 * i))
    rng = np.random.default_rng(7)
    for _ in range(20):
        batch = [key(int(i)) for i in rng.integers(0, 9, int(rng.integers(0, 12)))]
        with tier.borrow_many(batch) as a, ArenaTier.borrow_many(tier, batch) as b:
            assert [joined(v) for v in a] == [joined(v) for v in b]
            assert all(v is None or len(v) >= 1 for v in a)
    assert all(readers(tier, key(i)) == 0 for i in range(6))
    no_pages_lost(tier)


def test_an_exception_in_the_block_releases_every_pin():
    """An exception raised inside the ``with`` block propagates and leaves no pin (duplicates included)."""
    tier = ram(6)
    for i in range(3):
        tier.put(key(i), payload(i, 2 * PAGE))
    with pytest.raises(RuntimeError, match="boom"):
        with tier.borrow_many([key(0), key(1), key(1), key(2), key(7)]):
            raise RuntimeError("boom")
    assert [readers(tier, key(i)) for i in range(3)] == [0, 0, 0]
    for i in range(3):
        tier.delete(key(i))
    assert tier.free_bytes() == 6 * PAGE


def test_delete_replace_and_evict_while_pinned_keep_the_bytes_of_multi_extent_entries():
    """Entries spanning non-adjacent pages, deleted, replaced and overwritten while pinned: the views keep the old bytes; afterwards no page is lost."""
    tier = ram(24, page=512)
    fragmented(tier, 20, [1, 3, 5, 7, 9, 11, 13, 15, 17])
    for i in range(3):
        assert tier.put(key(i), payload(i, 3 * 512 - 17))
    assert all(len(tier.views(key(i))) >= 2 for i in range(3))  # really split
    with tier.borrow_many([key(0), key(1), key(2), key(0)]) as views:
        before = [joined(v) for v in views]
        assert tier.delete(key(0))
        assert tier.put(key(1), payload(101, 512))  # replaced
        for i in range(16):  # churn through every free page
            tier.put(key(20_000 + i), payload(200 + i, 512))
            tier.delete(key(20_000 + i))
        assert [joined(v) for v in views] == before == [payload(0, 3 * 512 - 17), payload(1, 3 * 512 - 17),
                                                         payload(2, 3 * 512 - 17), payload(0, 3 * 512 - 17)]
        assert tier.get(key(1)) == payload(101, 512)
    no_pages_lost(tier)
    assert tier.get(key(0)) is None and tier.get(key(2)) == payload(2, 3 * 512 - 17)


@pytest.mark.parametrize("bad", [bytearray, lambda k: memoryview(k).cast("I"), lambda k: np.frombuffer(k, np.uint8)],
                         ids=["bytearray", "memoryview-I", "ndarray"])
def test_a_key_that_fails_lookup_mid_batch_leaks_no_pin(bad):
    """A key the arena cannot look up (unhashable) after good ones: the call raises, as ``borrow`` of it does, but the pins already taken are released (as ArenaTier's default does)."""
    tier = ram(4)
    tier.put(key(1), payload(1, 2 * PAGE))
    tier.put(key(2), payload(2, 2 * PAGE))
    with pytest.raises((TypeError, ValueError)):
        with tier.borrow(bad(key(2))):
            pass  # pragma: no cover
    assert readers(tier, key(1)) == 0
    with pytest.raises((TypeError, ValueError)):  # the default releases what it pinned
        with ArenaTier.borrow_many(tier, [key(1), bad(key(2))]):
            pass  # pragma: no cover
    assert readers(tier, key(1)) == 0
    with pytest.raises((TypeError, ValueError)):
        with tier.borrow_many([key(1), bad(key(2))]):
            pass  # pragma: no cover
    assert readers(tier, key(1)) == 0, "borrow_many left key 1 pinned after failing on a later key"
    tier.delete(key(1))
    tier.delete(key(2))
    assert tier.free_bytes() == 4 * PAGE, "the pinned entry's pages never come back"


# ----------------------------------------------------------------------------- moves (the coder)


def _start_move(tier: RamTier, k: bytes):
    """Mark ``k``'s entry moving, as the coder's ``_code`` does (no reader holds it)."""
    with tier._lock:
        entry = tier._entries[k]
        assert entry.readers == 0
        entry.moving = True
    return entry


def _end_move(tier: RamTier, entry) -> None:
    """End a move as ``_move``'s ``finally`` does (pages of a dead entry go back; notify)."""
    with tier._lock:
        entry.moving = False
        if entry.dead and entry.readers == 0:
            tier._free_pages(entry)
        tier._cond.notify_all()


def _run_batch(tier: RamTier, batch: list[bytes], box: dict) -> threading.Thread:
    def run():
        try:
            with tier.borrow_many(batch) as views:
                box["got"] = [joined(v) for v in views]
        except BaseException as exc:  # pragma: no cover - reported by the test
            box["error"] = repr(exc)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _wait(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_a_batch_waits_out_a_move_without_holding_the_lock():
    """A moving entry mid-batch: the batch waits (earlier keys pinned), the arena lock stays free for others (reads, deletes, puts); after the move it yields every key's bytes."""
    tier = ram(8)
    for i in range(3):
        tier.put(key(i), payload(i, PAGE))
    entry = _start_move(tier, key(1))
    box: dict = {}
    th = _run_batch(tier, [key(0), key(1), key(2)], box)
    assert _wait(lambda: readers(tier, key(0)) == 1)
    time.sleep(0.05)
    assert th.is_alive() and "got" not in box  # waiting for the move
    assert tier.get(key(2)) == payload(2, PAGE)  # the lock is not held while it waits
    assert tier.delete(key(0))  # a pinned entry deleted meanwhile keeps its page
    assert tier.put(key(5), payload(5, PAGE))
    _end_move(tier, entry)
    th.join(5)
    assert not th.is_alive() and "error" not in box
    assert box["got"] == [payload(0, PAGE), payload(1, PAGE), payload(2, PAGE)]
    no_pages_lost(tier)
    assert tier.free_bytes() == 5 * PAGE


def test_a_key_replaced_or_deleted_during_its_move_is_read_fresh():
    """While a batch waits for a move, the moving key is replaced (batch yields the new bytes) or deleted (a miss); no page is lost either way."""
    for replace in (True, False):
        tier = ram(8)
        for i in range(2):
            tier.put(key(i), payload(i, PAGE))
        entry = _start_move(tier, key(1))
        box: dict = {}
        th = _run_batch(tier, [key(0), key(1)], box)
        assert _wait(lambda: readers(tier, key(0)) == 1)
        if replace:
            assert tier.put(key(1), payload(11, 2 * PAGE))
        else:
            assert tier.delete(key(1))
        # a new entry under the key is not moving: the waiter may take it before the old move ends
        _end_move(tier, entry)
        th.join(5)
        assert not th.is_alive() and "error" not in box
        assert box["got"] == [payload(0, PAGE), payload(11, 2 * PAGE) if replace else None]
        no_pages_lost(tier)
        assert counts(tier)[:2] == ((2, 0) if replace else (1, 1))  # one hit or miss per key
        tier.close()


def test_two_moves_in_one_batch_and_a_concurrent_single_borrow():
    """Two keys of a batch move one after the other; a concurrent single ``borrow`` of a moving key waits too; all wake, nobody hangs."""
    tier = ram(8)
    for i in range(4):
        tier.put(key(i), payload(i, PAGE))
    m1, m3 = _start_move(tier, key(1)), _start_move(tier, key(3))
    box: dict = {}
    th = _run_batch(tier, [key(0), key(1), key(2), key(3)], box)
    single: dict = {}

    def one():
        with tier.borrow(key(3)) as v:
            single["got"] = joined(v)
    th2 = threading.Thread(target=one, daemon=True)
    th2.start()
    assert _wait(lambda: readers(tier, key(0)) == 1)
    _end_move(tier, m1)
    assert _wait(lambda: readers(tier, key(2)) == 1)
    time.sleep(0.02)
    assert th.is_alive() and th2.is_alive()
    _end_move(tier, m3)
    th.join(5)
    th2.join(5)
    assert not th.is_alive() and not th2.is_alive()
    assert box["got"] == [payload(i, PAGE) for i in range(4)] and single["got"] == payload(3, PAGE)
    assert all(readers(tier, key(i)) == 0 for i in range(4))
    no_pages_lost(tier)


def _kv(i: int, nbytes: int) -> np.ndarray:
    """bf16-like bytes that the lossless codec shrinks."""
    x = np.random.default_rng(i).normal(0, 1, nbytes // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def test_coded_arena_batches_race_the_coder_without_hang_or_wrong_bytes(tmp_path):
    """A real coder codes (moves) entries while threads re-put them and pin batches (with duplicates): every pinned entry decodes to one of its key's payloads, nobody hangs, and once all is deleted every page is free."""
    pytest.importorskip("blosc2")
    page, size = 16 * 1024, 128 * 1024
    tier = RamTier(RamConfig(capacity=64 * size, page_size=page, shm_path=str(tmp_path / "arena"),
                             codec="lossless"), name="ram")
    try:
        versions = {k: [_kv(100 * k + v, size).tobytes() for v in range(3)] for k in range(8)}
        for k in range(8):
            assert tier.put(key(k), versions[k][0])
        stop, errors, batches = threading.Event(), [], [0]

        def writer():
            n = 0
            while not stop.is_set():
                n += 1
                k = n % 8
                tier.put(key(k), versions[k][n % 3])
                if n % 5 == 0:
                    tier.delete(key(k))

        def reader(t):
            rng = np.random.default_rng(t)
            try:
                while not stop.is_set():
                    ks = [int(i) for i in rng.integers(0, 8, 5)]
                    with tier.borrow_many([key(k) for k in ks]) as views:
                        for k, v in zip(ks, views):
                            if v is not None:
                                assert joined(v) in versions[k], f"key {k}: bytes of no put"
                    batches[0] += 1
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=writer, daemon=True)] + [
            threading.Thread(target=reader, args=(t,), daemon=True) for t in range(3)]
        for th in threads:
            th.start()
        time.sleep(1.5)
        stop.set()
        for th in threads:
            th.join(20)
        assert not any(th.is_alive() for th in threads), "a thread hangs (deadlock)"
        assert not errors, errors
        assert batches[0] > 10
        assert tier.drain(30)
        assert tier.codec_state()["coded"] > 0  # the coder did move entries meanwhile
        for k in range(8):
            tier.delete(key(k))
        assert tier.drain(30)
        assert tier.free_bytes() == tier.arena_bytes
    finally:
        tier.close()


# ----------------------------------------------------------------------------- TieredStore.borrow_top


def _store(pages: int = 4) -> tuple[TieredStore, RamTier]:
    tier = ram(pages)
    return TieredStore([(tier, LRUPolicy())], StoreConfig(write_through=False)), tier


def test_borrow_top_counts_and_touches_each_held_key_as_before():
    """Store hits per held valid key (duplicates twice, bytearray/memoryview served), tier hits/misses as one borrow each; the touched keys are the last to be evicted."""
    store, tier = _store(4)
    try:
        for i in range(4):
            assert store.put(key(i), payload(i))
        before_store, before_tier = store.stats(), counts(tier)
        batch = [key(0), b"short", key(9), bytearray(key(2)), key(0), memoryview(key(0)), None]
        with store.borrow_top(batch) as out:
            assert [joined(v) for v in out] == [payload(0), None, None, payload(2), payload(0), payload(0), None]
        after = store.stats()
        assert after["hits"] - before_store["hits"] == 4
        assert after["misses"] == before_store["misses"]
        h, m, b = (a - c for a, c in zip(counts(tier), before_tier))
        assert (h, m, b) == (4, 0, 4 * PAGE)  # key 9 is not in the index: never asked of the tier
        assert store.put(key(4), payload(4)) and store.put(key(5), payload(5))  # evict two: 1 and 3
        assert sorted(k for k in (key(0), key(1), key(2), key(3)) if tier.contains(k)) == sorted([key(0), key(2)])
        no_pages_lost(tier)
    finally:
        store.close()


def test_borrow_top_pins_survive_delete_and_eviction_and_leave_no_page():
    """Everything the batch pinned deleted or evicted during the block: bytes unchanged, pages back afterwards."""
    store, tier = _store(4)
    try:
        for i in range(3):
            store.put(key(i), payload(i))
        with store.borrow_top([key(0), key(1), key(2), key(1)]) as out:
            store.delete(key(0))
            store.put(key(7), payload(7))
            store.put(key(8), payload(8))  # evicts: the pinned pages stay lent
            assert [joined(v) for v in out] == [payload(0), payload(1), payload(2), payload(1)]
        no_pages_lost(tier)
    finally:
        store.close()


# ----------------------------------------------------------------------------- pages


def _flash(num_blocks: int, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """FlashAttention-like layout [2, blocks, 4, 2, 8] bf16: two 128-byte pieces per block per layer."""
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-2**15, 2**15, (2, num_blocks, 4, 2, 8), generator=g, dtype=torch.int16)
            .view(torch.bfloat16) for i in range(layers)}


def _cpu(num_blocks: int, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """vLLM CPU backend layout [blocks, 2, 4, 16] bf16: one 256-byte piece per block per layer."""
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-2**15, 2**15, (num_blocks, 2, 4, 16), generator=g, dtype=torch.int16)
            .view(torch.bfloat16) for i in range(layers)}


def _old_page_pairs(layout: PageLayout, block_ids, arrays, first: int, to_entry: bool):
    """The per-piece generator ``_page_pairs`` was before the change."""
    size = layout.piece_bytes
    pieces = (a[off : off + size] for a in arrays for off in range(0, a.size, size))
    pairs = []
    for j, block in enumerate(block_ids):
        for layer in layout.layers:
            for p in range(layout.pieces):
                piece = next(pieces)
                if j < first:
                    continue
                page = layer.array[p, block]
                pairs.append((piece, page) if to_entry else (page, piece))
    return pairs


def _where(a: np.ndarray) -> tuple:
    return a.__array_interface__["data"][0], a.shape, a.strides


def _split(flat: np.ndarray, piece: int, rng) -> list[np.ndarray]:
    """``flat`` cut at random piece boundaries into segments of whole pieces."""
    n = flat.size // piece
    cuts = sorted({int(c) for c in rng.integers(1, n, int(rng.integers(0, 6)))}) if n > 1 else []
    bounds = [0, *cuts, n]
    return [flat[a * piece : b * piece] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("kind", [_flash, _cpu], ids=["flash", "cpu"])
def test_page_pairs_are_the_old_pairs_for_every_first_and_segmentation(kind):
    """New ``_page_pairs`` gives exactly the old (dst, src) pairs (same memory, same order) for first 0..bpc, both directions, 1 to 6 segments."""
    kv = kind(10, 3, 1)
    bpc = 4
    layout = PageLayout(kv, 10, blocks_per_chunk=bpc, engine="host", copy_threads=1)
    rng = np.random.default_rng(3)
    try:
        for trial in range(30):
            flat = rng.integers(0, 256, layout.chunk_bytes, dtype=np.uint8)
            arrays = _split(flat, layout.piece_bytes, rng) if trial else [flat]
            blocks = [int(b) for b in rng.choice(10, bpc, replace=False)]
            for first in range(bpc + 1):
                for to_entry in (True, False):
                    new = layout._page_pairs(blocks, arrays, first, to_entry)
                    old = _old_page_pairs(layout, blocks, arrays, first, to_entry)
                    assert len(new) == len(old) == (bpc - first) * len(layout.layers) * layout.pieces
                    assert [(_where(d), _where(s)) for d, s in new] == [(_where(d), _where(s)) for d, s in old]
    finally:
        layout.close()


@pytest.mark.parametrize("kind", [_flash, _cpu], ids=["flash", "cpu"])
def test_loads_from_a_fragmented_arena_write_the_reference_bytes(kind):
    """Chunks saved into a small-page fragmented arena (entries in several extents), loaded back with first 0..bpc by both engines: the pages hold exactly the reference bytes, skipped blocks untouched."""
    bpc, nblocks = 4, 16
    src_kv = kind(nblocks, 3, 5)
    src = PageLayout(src_kv, nblocks, blocks_per_chunk=bpc, engine="host", copy_threads=1)
    page = 2 * src.piece_bytes  # every extent holds whole pieces
    tier = ram(4 * (src.chunk_bytes // page) + 40, page=page)
    fragmented(tier, 60, [i for i in range(60) if i % 5 in (1, 2, 4)])  # 36 holes, none of 3 adjacent
    chunks = [[0, 5, 2, 7], [9, 1, 14, 3]]
    for c, blocks in enumerate(chunks):
        segs = tier.reserve(key(c), src.chunk_bytes)
        src.save(blocks, segs)
        assert tier.commit(key(c))
        assert len(tier.views(key(c))) >= 4  # multi-extent
    try:
        for engine in ("host", "torch"):
            for first in range(bpc + 1):
                dst_kv = kind(nblocks, 3, 99)
                ref = {n: t.clone() for n, t in dst_kv.items()}
                dst = PageLayout(dst_kv, nblocks, blocks_per_chunk=bpc, engine=engine, copy_threads=2)
                targets = [[3, 8, 11, 0], [15, 4, 6, 10]]
                with tier.borrow_many([key(0), key(1)]) as entries:
                    for c, segs in enumerate(entries):
                        if engine == "host":
                            dst.copy(dst.load_pairs(segs, targets[c], first))
                        else:
                            dst.load(segs, targets[c], first)
                        for j in range(first, bpc):  # the reference: source block into target block
                            for name in ref:
                                if kind is _flash:
                                    ref[name][:, targets[c][j]] = src_kv[name][:, chunks[c][j]]
                                else:
                                    ref[name][targets[c][j]] = src_kv[name][chunks[c][j]]
                for name in ref:
                    assert torch.equal(dst_kv[name].view(torch.int16), ref[name].view(torch.int16)), (engine, first, name)
                dst.close()
    finally:
        src.close()
    no_pages_lost(tier)


# ----------------------------------------------------------------------------- keys

NS = Namespace(model="m", revision="r")


def _old_chunk_keys(tokens, namespace, chunk_tokens, start=0, prev=ROOT):
    """``chunk_keys`` as it was before the change (numpy for every input; no mm, no auth)."""
    ns = namespace if isinstance(namespace, bytes) else namespace.digest()
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ConfigError("token ids must be in [0, 2**32)")
    data = arr.astype("<u4", copy=False).tobytes()
    width = chunk_tokens * 4
    keys = []
    for i in range(start, len(arr) // chunk_tokens):
        h = hashlib.sha256(prev)
        h.update(ns)
        h.update(data[i * width : (i + 1) * width])
        prev = ChunkKey(h.digest())
        keys.append(prev)
    return keys


_IDS = [0, 1, 7, 255, 256, 65535, 65536, 2**31, 2**32 - 1, 123456789, 42, 3]


def _inputs():
    ids = _IDS * 3
    small = [i % 120 for i in ids]
    yield "list", ids
    yield "tuple", tuple(ids)
    yield "empty-list", []
    yield "empty-tuple", ()
    yield "empty-array", np.array([], dtype=np.int64)
    yield "short", ids[:5]
    for dt in ("int64", "uint64", "uint32"):
        yield f"array-{dt}", np.array(ids, dtype=dt)
    yield "array-int32", np.array([i % 2**31 for i in ids], dtype=np.int32)
    for dt in ("int8", "uint8", "int16", "uint16"):
        yield f"array-{dt}", np.array(small, dtype=dt)
    yield "list-np-int64", [np.int64(t) for t in ids]
    yield "list-np-uint32", [np.uint32(t) for t in ids]
    yield "list-np-int8", [np.int8(t) for t in small]
    yield "list-bool", [bool(t % 2) for t in ids]
    yield "list-np-bool", [np.bool_(t % 2) for t in ids]
    yield "array-bool", np.array([bool(t % 2) for t in ids])
    yield "list-float-integral", [float(t) for t in small]
    yield "list-float-fraction", [t + 0.7 for t in small]
    yield "list-np-float64", [np.float64(t) for t in small]
    yield "array-float32", np.array(small, dtype=np.float32)
    yield "list-mixed-int-float", [t if t % 2 else float(t) for t in small]
    yield "list-mixed-int-npint", [t if t % 2 else np.int32(t) for t in small]
    yield "list-torch-scalars", [torch.tensor(t) for t in small]
    yield "torch-tensor", torch.tensor(small)
    yield "range", range(40)


@pytest.mark.parametrize("name,tokens", list(_inputs()), ids=[n for n, _ in _inputs()])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_keys_are_the_old_keys_for_every_input_that_worked(name, tokens, chunk):
    """Every 1-D token input kind (lists/tuples of ints, numpy/torch/bool/float scalars, arrays of each dtype, empty) keys exactly as the old numpy path did, also resumed at start=1."""
    old = _old_chunk_keys(tokens, NS, chunk)
    assert chunk_keys(tokens, NS, chunk) == old
    if len(old) > 1:
        assert chunk_keys(tokens, NS, chunk, start=1, prev=old[0]) == old[1:]


_BAD = [
    ("negative", [1, -1, 2, 3]),
    ("first-negative", [-1, 1, 2, 3]),
    ("2**32", [2**32, 0, 0, 0]),
    ("2**40", (5, 2**40, 0, 0)),
    ("2**64", [0, 2**64, 0, 0]),
    ("-2**70", [0, 0, -2**70, 0]),
    ("np-int64-negative", [np.int64(-5), 1, 2, 3]),
    ("np-uint64-huge", [np.uint64(2**63), 1, 2, 3]),
    ("float-negative", [1.0, -0.5, 2, 3]),
    ("float-huge", [1, 2, 3, 5e10]),
    ("array-negative", np.array([1, -1, 2, 3])),
    ("array-huge", np.array([1, 2**33, 2, 3])),
]


@pytest.mark.parametrize("name,tokens", _BAD, ids=[n for n, _ in _BAD])
def test_ids_outside_uint32_are_refused_as_before(name, tokens):
    """Negative or >= 2**32 ids, in any container or scalar type, raise ConfigError as the old path did (never wrap)."""
    with pytest.raises(ConfigError):
        _old_chunk_keys(tokens, NS, 2)
    with pytest.raises(ConfigError, match="token ids must be in"):
        chunk_keys(tokens, NS, 2)


def test_inputs_the_old_path_refused_are_still_refused():
    """Non-numeric ids (None, strings of non-digits) raise as before, not key silently."""
    for tokens in ([1, None, 2, 3], ["a", "b", "c", "d"]):
        with pytest.raises(Exception):
            _old_chunk_keys(tokens, NS, 2)
        with pytest.raises(Exception):
            chunk_keys(tokens, NS, 2)


# ----------------------------------------------------------------------------- scheduler digests


def _scheduler(namespace: Namespace):
    from kvtier.integrations.vllm.scheduler import KVTierScheduler

    sched = KVTierScheduler.__new__(KVTierScheduler)
    sched.namespace = namespace
    sched._digests = {}
    return sched


def test_digests_are_the_uncached_digests_none_and_empty_alike():
    """The cached digest of each (lora, salt) equals ``namespace.with_lora(lora).with_salt(salt).digest()``; None and "" name the same namespace, as before; distinct ones differ."""
    sched = _scheduler(NS)
    cases = [(None, None), (None, ""), ("", None), ("", ""), ("lora-a", None), ("lora-a", "s"), (None, "s"), ("s", None)]
    for _ in range(2):  # computed, then remembered
        for lora, salt in cases:
            assert sched._digest(lora, salt) == NS.with_lora(lora).with_salt(salt).digest()
    assert len({sched._digest(lo, sa) for lo, sa in cases[:4]}) == 1 and sched._digest(None, None) == NS.digest()
    assert len({sched._digest(lo, sa) for lo, sa in cases[3:]}) == 5


def test_digest_table_is_bounded_and_stays_right_past_the_bound():
    """Hostile clients send thousands of salts: the table never exceeds 1024 entries and every answer stays right after it is cleared."""
    from kvtier.integrations.vllm import scheduler as mod

    sched = _scheduler(NS)
    base = sched._digest(None, None)
    for i in range(3 * mod._DIGESTS_KEPT + 7):
        salt = f"salt-{i}"
        assert sched._digest(None, salt) == NS.with_salt(salt).digest()
        assert len(sched._digests) <= mod._DIGESTS_KEPT
        if i % 500 == 0:
            assert sched._digest(None, None) == base
    assert sched._digest(None, "salt-0") == NS.with_salt("salt-0").digest()


# ----------------------------------------------------------------------------- worker counts


def _settle(tiers: list, groups: int = 1, entry_bytes: int = 1000):
    from kvtier.integrations.vllm.metadata import LoadSpec
    from kvtier.integrations.vllm.metrics import KVTierConnectorStats
    from kvtier.integrations.vllm.worker import KVTierWorker

    stats = KVTierConnectorStats()
    fake = SimpleNamespace(_entry_bytes=lambda loads: entry_bytes, _stats=stats, groups=[0] * groups,
                           _failed_reqs=set(), _failed_blocks=set(),
                           geometry=SimpleNamespace(blocks_per_chunk=2))
    load = LoadSpec("r", [key(i) for i in range(len(tiers))], 0, list(range(2 * len(tiers))), 1)
    bad = KVTierWorker._settle(fake, [load], tiers)
    return bad, stats.data["tiers"], fake


def test_settle_counts_per_tier_as_one_count_per_chunk():
    """Interleaved tiers and a failure mid-load: loaded chunks/bytes per tier are those of the chunks before the failure, one per chunk, as before."""
    tiers = ["ram", "disk", "ram", "s3", "ram", None, "ram", "disk"]
    bad, got, fake = _settle(tiers)
    assert bad == 5
    expect = {t: {"loaded_chunks": n, "loaded_bytes": 1000 * n} for t, n in Counter(tiers[:5]).items()}
    assert got == expect
    assert fake._failed_blocks == set(range(10, 16))
    bad, got, _ = _settle(["ram"] * 3, entry_bytes=0)
    assert bad == 3 and got == {"ram": {"loaded_chunks": 3}}
    assert _settle([])[:2] == (0, {})

"""The connector's worker side without an engine: real stores (RAM, disk) and CPU tensors shaped
as vLLM's CPU backend registers them ([num_blocks, kv_heads, block_size, 2*head_size] per layer).

Saves then loads round-trip page bytes exactly, inline and in the background (async mode); a
chunk missing or of another size makes every block from it on a load error; a background load
is reported once, also when its reads fail.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import ROOT, WorkerShare, chunk_keys

BLOCK = 16
GEOMETRY = ChunkGeometry(block_size=BLOCK, chunk_tokens=2 * BLOCK)  # two blocks per chunk
NUM_BLOCKS = 32


def _kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randint(-1000, 1000, (NUM_BLOCKS, 2, BLOCK, 16), generator=g).to(torch.bfloat16)
            for i in range(3)}


def _worker(tmp: Path, mode: str = "sync", ram: str = "4MiB") -> tuple[KVTierWorker, dict[str, torch.Tensor]]:
    tiers = [{"type": "ram", "capacity": ram}, {"type": "disk", "path": str(tmp / "disk"), "capacity": "64MiB"}]
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": mode, "load_threads": 2})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    kv = _kv_caches(0)
    worker.register_kv_caches(kv)
    return worker, kv


def _keys(n: int) -> list[bytes]:
    return chunk_keys(list(range(n * GEOMETRY.chunk_tokens)), b"ns", GEOMETRY.chunk_tokens)


def _save(worker: KVTierWorker, keys: list[bytes], blocks: list[int]) -> None:
    saves = [SaveSpec("src", k, keys[c - 1] if c else None, c, blocks[2 * c : 2 * c + 2]) for c, k in enumerate(keys)]
    worker.wait_for_save(KVTierMetadata(saves=saves))
    assert worker.drain_saves()  # async mode: the store writes run in the background
    assert worker.store.flush()


def _pages(kv: dict[str, torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [t[blocks].clone() for t in kv.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def _wait_finished(worker: KVTierWorker, req_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = worker.finished_loads()
        if done:
            assert done == {req_id}
            return
        time.sleep(0.01)
    raise AssertionError("background load never reported")


def test_inline_save_then_load_round_trips_pages(tmp_path):
    worker, kv = _worker(tmp_path)
    try:
        keys = _keys(3)
        src, dst = list(range(0, 6)), list(range(10, 16))
        _save(worker, keys, src)
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src), _pages(kv, dst))
    finally:
        worker.close()


@pytest.mark.parametrize("batch", [1, 2 << 20])
def test_an_inline_load_copies_its_top_tier_chunks_in_pinned_batches(tmp_path, monkeypatch, batch):
    """The top-tier chunks of an inline load are pinned and copied in batches of up to
    ``TOP_BATCH_BYTES`` (one chunk each, or all at once): the same pages either way, skipped
    blocks untouched, one hit counted per chunk."""
    import kvtier.integrations.vllm.worker as worker_module

    monkeypatch.setattr(worker_module, "TOP_BATCH_BYTES", batch)
    worker, kv = _worker(tmp_path)
    try:
        keys = _keys(3)
        src, dst = list(range(0, 6)), list(range(10, 16))
        _save(worker, keys, src)
        before = _pages(kv, dst[:1])
        hits = worker.store.stats()["hits"]
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 1)]))  # block 10 is computed
        assert worker.failed_blocks() == set()
        assert _same(_pages(kv, src[1:]), _pages(kv, dst[1:])) and _same(_pages(kv, dst[:1]), before)
        assert worker.store.stats()["hits"] == hits + 3
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_background_load_round_trips_pages_and_reports_once(tmp_path, mode):
    """A background load (the scheduler plans it in async mode) from the disk tier of a new
    worker (its RAM tier empty, as after an engine restart) copies the bytes the first worker
    saved, and is reported by ``finished_loads`` exactly once."""
    keys = _keys(4)
    src, dst = list(range(0, 8)), list(range(12, 20))
    first, kv = _worker(tmp_path)
    try:
        _save(first, keys, src)
        saved = _pages(kv, src)
    finally:
        first.close()
    worker, kv = _worker(tmp_path, mode)
    try:
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 0, background=True)]))
        _wait_finished(worker, "r")
        assert worker.finished_loads() == set()
        assert worker.failed_blocks() == set()
        assert _same(saved, _pages(kv, dst))
        stats = worker.take_stats().data
        assert stats["counters"]["background_loads"] == 1
        loaded = {tier: c.get("loaded_chunks", 0) for tier, c in stats["tiers"].items()}
        assert sum(loaded.values()) == 4 and loaded.get("disk", 0) == 4, loaded
    finally:
        worker.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_missing_chunk_fails_every_block_from_it_on(tmp_path, background):
    """Chunk 1 of 3 is gone: chunk 0 loads, blocks of chunks 1 and 2 are load errors (vLLM
    recomputes from the first missing chunk); the skipped first block is never reported."""
    worker, kv = _worker(tmp_path, "async" if background else "sync")
    try:
        keys = _keys(3)
        _save(worker, keys, list(range(0, 6)))
        assert worker.store.delete(keys[1])
        dst = list(range(20, 26))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, dst, 1, background=background)]))
        if background:
            _wait_finished(worker, "r")
        assert worker.failed_blocks() == set(dst[2:])
        assert _same(_pages(kv, [1]), _pages(kv, [21]))
    finally:
        worker.close()


def test_an_entry_of_another_size_is_a_load_error_not_a_crash(tmp_path):
    """A stored entry that is not one chunk of this engine (CorruptEntry from PageLayout) is a
    miss: its blocks are reported, the load goes on."""
    worker, kv = _worker(tmp_path, "async")
    try:
        keys = _keys(2)
        _save(worker, keys[:1], [0, 1])
        assert worker.store.put(keys[1], b"\x01" * 100, parent=keys[0], chunk_index=1)
        for background in (False, True):
            worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", keys, 0, [8, 9, 10, 11], 0, background)]))
            if background:
                _wait_finished(worker, "r")
            assert worker.failed_blocks() == {10, 11}
            assert keys[1] not in worker.store  # refused and deleted: a save of the chunk can replace it
    finally:
        worker.close()


def test_the_share_key_of_one_worker_is_the_chunk_key():
    assert WorkerShare().key(ROOT) == ROOT
    two = WorkerShare(0, 2)
    assert two.key(ROOT) != ROOT and two.of(1, 0).key(ROOT) != two.key(ROOT)
    assert two.keys([ROOT, ROOT]) == [two.key(ROOT)] * 2

"""Background saves (``transfer_mode: async``) of the connector's worker, without an engine: real
stores (RAM, disk) and CPU tensors shaped as vLLM's CPU backend registers them.

Where a store write can wait (a cache server, a disk top tier; here a gated store) or the
``torch`` engine copies, the step reads each chunk's pages into a staging slot and returns
without waiting for the store; one background thread writes the staged chunks. A CPU engine over
an in-process RAM tier copies straight into the RAM tier within the step (one copy). Checked here: the bytes stored are the pages as
they were during the step (pages overwritten right after, as a preempted request's freed blocks
are, do not reach the store); saves that find every slot in use are dropped and counted (with the
rest of their request's chunks of that step), never queued; a store that refuses or raises
costs a counted drop and frees the slot; ``close`` writes what is queued; ``sync`` mode still
writes within the step. The only fake is a fault-injection wrapper around a real store (writes
held at a gate, or raising).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvtier.integrations.vllm import worker as worker_module
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.metrics import KVTierConnectorStats
from kvtier.integrations.vllm.pages import PageLayout, SaveStep
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import WorkerShare, chunk_keys
from kvtier.store import TieredStore

BLOCK = 16
GEOMETRY = ChunkGeometry(block_size=BLOCK, chunk_tokens=2 * BLOCK)  # two blocks per chunk
NUM_BLOCKS = 32


class GatedStore:
    """Fault injection around a real store: ``write`` waits at a gate (a slow store) or raises
    (``fail``); everything else is the real store's."""

    def __init__(self, store: TieredStore):
        self._store = store
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.writes_started = 0
        self.batches: list[int] = []  # the size of each write_many batch

    memcpy_writes = False  # a store whose writes can wait (as a cache server's): the background writer serves it

    def write_many(self, items) -> list[bool]:
        self.batches.append(len(items))
        return [self.write(i.key, i.nbytes, i.fill, i.parent, i.chunk_index) for i in items]

    def write(self, *args, **kwargs) -> bool:
        self.writes_started += 1
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        if self.fail:
            raise OSError("injected store fault")
        return self._store.write(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randint(-1000, 1000, (NUM_BLOCKS, 2, BLOCK, 16), generator=g).to(torch.bfloat16)
            for i in range(3)}


def _worker(tmp: Path, monkeypatch, mode: str = "async", slots: int | None = None, engine: str = "host"
            ) -> tuple[KVTierWorker, dict[str, torch.Tensor], GatedStore]:
    """A worker on a gated real store (RAM + disk); ``slots`` staging slots when given; its pages
    copied by the ``engine`` copy engine (``torch``: the CUDA code path, run on CPU tensors)."""
    if slots is not None:
        monkeypatch.setattr(worker_module, "SAVE_BACKLOG_CHUNKS", slots)
    gated: list[GatedStore] = []

    def open_store(cfg):
        gated.append(GatedStore(TieredStore.from_config(cfg.store)))
        return gated[-1]

    monkeypatch.setattr(KVTierWorker, "_open_store", staticmethod(open_store))
    tiers = [{"type": "ram", "capacity": "4MiB"}, {"type": "disk", "path": str(tmp / "disk"), "capacity": "64MiB"}]
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": mode, "load_threads": 2})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    kv = _kv_caches(0)
    worker.register_kv_caches(kv)
    if engine != worker._layout.engine:
        worker._layout.close()
        worker._layout = PageLayout(kv, NUM_BLOCKS, GEOMETRY.blocks_per_chunk, engine=engine)
    return worker, kv, gated[0]


def _keys(n: int, start: int = 0) -> list[bytes]:
    return chunk_keys(list(range(start, start + n * GEOMETRY.chunk_tokens)), b"ns", GEOMETRY.chunk_tokens)


def _saves(req_id: str, keys: list[bytes], blocks: list[int]) -> list[SaveSpec]:
    return [SaveSpec(req_id, k, keys[c - 1] if c else None, c, blocks[2 * c : 2 * c + 2]) for c, k in enumerate(keys)]


def _pages(kv: dict[str, torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [t[blocks].clone() for t in kv.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def _counters(worker: KVTierWorker) -> dict:
    stats = worker.take_stats()
    return stats.data["counters"] if stats is not None else {}


@pytest.mark.parametrize("engine", ["host", "torch"])
def test_the_step_returns_before_the_store_write_and_stores_the_pages_of_the_step(tmp_path, monkeypatch, engine):
    """The write waits at a closed gate, yet ``wait_for_save`` returns; the pages are then
    overwritten (a preempted request's freed blocks reused by the next forward pass). What
    reaches the store is the pages as they were in the step: a load gives them back. With the
    ``torch`` engine the writer lands the gather in the slots after the step."""
    worker, kv, store = _worker(tmp_path, monkeypatch, engine=engine)
    try:
        keys, src = _keys(3), list(range(0, 6))
        before = _pages(kv, src)
        store.gate.clear()
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, src)))
        assert store._store.lookup(keys) == 0  # nothing written yet: the step did not wait
        for t in kv.values():
            t[src] = 7  # the blocks are reused
        store.gate.set()
        assert worker.drain_saves()
        assert store.lookup(keys) == 3
        dst = list(range(10, 16))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set()
        assert _same(before, _pages(kv, dst))
        counters = _counters(worker)
        assert counters["saved_chunks"] == 3 and counters["saved_bytes"] == 3 * worker._layout.chunk_bytes
        assert not counters.get("save_backlog_dropped") and not counters.get("save_dropped")
    finally:
        worker.close()


def test_saves_that_find_no_free_slot_are_dropped_and_counted(tmp_path, monkeypatch):
    """Four slots, the store stuck: request a's three chunks and b's first take the slots; b's
    later chunks are dropped (worthless without its first), and so is every chunk of the next
    step. Nothing waits and nothing is queued beyond the slots; once the store moves, the four
    staged chunks are written and the engine's counters add up."""
    worker, kv, store = _worker(tmp_path, monkeypatch, slots=4)
    try:
        a, b, c = _keys(3), _keys(3, start=1000), _keys(2, start=2000)
        store.gate.clear()
        step = _saves("a", a, list(range(0, 6))) + _saves("b", b, list(range(6, 12)))
        worker.wait_for_save(KVTierMetadata(saves=step))
        worker.wait_for_save(KVTierMetadata(saves=_saves("c", c, list(range(12, 16)))))
        store.gate.set()
        assert worker.drain_saves()
        assert store.lookup(a) == 3 and store.lookup(b) == 1 and store.lookup(c) == 0
        assert store.writes_started == 4
        counters = _counters(worker)
        assert counters["saved_chunks"] == 4 and counters["save_backlog_dropped"] == 4
        # the freed slots take the next step's chunks again
        worker.wait_for_save(KVTierMetadata(saves=_saves("c", c, list(range(12, 16)))))
        assert worker.drain_saves() and store.lookup(c) == 2
        assert _counters(worker)["saved_chunks"] == 2
    finally:
        worker.close()


def test_a_request_whose_chunk_is_dropped_saves_none_of_its_later_chunks_that_step(tmp_path, monkeypatch):
    """A slot freed by the writer in the middle of a step (injected: the second slot request
    finds none, the third finds one) goes to another request's chunk, never to a chunk whose
    predecessor was just dropped."""
    worker, kv, store = _worker(tmp_path, monkeypatch)
    try:
        saves = worker._saves
        real_take, calls = saves.take, []

        def take():
            calls.append(1)
            return None if len(calls) == 2 else real_take()

        monkeypatch.setattr(saves, "take", take)
        a, b = _keys(3), _keys(1, start=1000)
        worker.wait_for_save(KVTierMetadata(saves=_saves("a", a, list(range(6))) + _saves("b", b, [6, 7])))
        assert worker.drain_saves()
        assert len(calls) == 3  # a0, a1 (none free), b0; a2 is dropped without asking
        assert store.lookup(a) == 1 and store.lookup(b) == 1
        counters = _counters(worker)
        assert counters["saved_chunks"] == 2 and counters["save_backlog_dropped"] == 2
    finally:
        worker.close()


def test_the_backlog_count_reaches_the_metrics_payload():
    stats = KVTierConnectorStats()
    stats.count(save_backlog_dropped=3, saved_chunks=2)
    other = KVTierConnectorStats(data={"counters": {"save_backlog_dropped": 1}})
    summary = stats.aggregate(other).reduce()
    assert summary["save_backlog_dropped"] == 4 and summary["saved_chunks"] == 2


def test_a_store_fault_is_a_counted_drop_and_frees_its_slot(tmp_path, monkeypatch):
    """The store raises on every write: each chunk is counted dropped, the writer goes on, and
    the single slot serves the next step's save once the store works again."""
    worker, kv, store = _worker(tmp_path, monkeypatch, slots=1)
    try:
        keys = _keys(2)
        store.fail = True
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys[:1], [0, 1])))
        assert worker.drain_saves()
        assert _counters(worker)["save_dropped"] == 1
        store.fail = False
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, [0, 1, 2, 3])[1:]))
        assert worker.drain_saves()
        counters = _counters(worker)
        assert counters["saved_chunks"] == 1 and not counters.get("save_dropped")
    finally:
        worker.close()


def test_the_writer_hands_a_store_what_is_queued_as_one_batch(tmp_path, monkeypatch):
    """A store whose write is more than a memcpy (a cache server's client) gets the chunks
    queued meanwhile as one ``write_many`` (one reserve and one commit round trip there), in
    order, each stored; a memcpy store would get them one at a time."""
    worker, kv, store = _worker(tmp_path, monkeypatch)
    try:
        keys = _keys(6)
        store.gate.clear()  # the writer takes the first step's batch, then waits at the gate
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys[:2], list(range(4)))))
        _wait_for(lambda: store.writes_started == 1)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(12)))[2:]))  # 4 queued meanwhile
        store.gate.set()
        assert worker.drain_saves() and store.lookup(keys) == 6
        assert store.batches == [2, 4]
        assert _counters(worker)["saved_chunks"] == 6
    finally:
        worker.close()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_close_writes_the_queued_saves(tmp_path, monkeypatch):
    worker, kv, store = _worker(tmp_path, monkeypatch)
    keys = _keys(3)
    store.gate.clear()
    worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(6)))))
    threading.Timer(0.2, store.gate.set).start()
    inner = store._store
    close_store = inner.close
    seen: list[int] = []
    inner.close = lambda: (seen.append(inner.lookup(keys)), close_store())  # what the store holds at close
    worker.close()
    assert seen == [3]


def test_sync_mode_still_writes_within_the_step(tmp_path, monkeypatch):
    """``sync`` (the default): the chunk is in the store when ``wait_for_save`` returns, with no
    background writer (a closed gate would block the step itself, so the gate stays open)."""
    worker, kv, store = _worker(tmp_path, monkeypatch, mode="sync")
    try:
        keys = _keys(2)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(4)))))
        assert worker._saves is None and store.lookup(keys) == 2
        assert _counters(worker)["saved_chunks"] == 2
    finally:
        worker.close()


def _plain_worker(tmp: Path, tiers: list[dict], engine: str = "host") -> tuple[KVTierWorker, dict[str, torch.Tensor]]:
    """An ``async`` worker on a real store of ``tiers`` (no gate), its pages copied by ``engine``."""
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": "async", "load_threads": 2})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    kv = _kv_caches(0)
    if engine == "host":
        worker.register_kv_caches(kv)
    else:  # the CUDA path's layout (run on CPU tensors) before the worker decides how it saves
        real = PageLayout

        class TorchLayout(real):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs, engine="torch")

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(worker_module, "PageLayout", TorchLayout)
            worker.register_kv_caches(kv)
    return worker, kv


def test_over_an_in_process_ram_tier_async_saves_copy_once_within_the_step(tmp_path):
    """A CPU engine (``host`` copies) over a RAM tier: no staging slots and no writer thread;
    the step's copy goes straight into the RAM tier, so the chunks are there when
    ``wait_for_save`` returns and the pages reused right after do not reach the store. The disk
    tier below still gets its copies from the store's own writers."""
    worker, kv = _plain_worker(tmp_path, [{"type": "ram", "capacity": "4MiB"},
                                          {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}])
    try:
        assert worker._saves is None
        keys, src = _keys(3), list(range(0, 6))
        before = _pages(kv, src)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, src)))
        assert worker.store.in_top_tier(keys) == [True] * 3  # in the RAM tier, within the step
        for t in kv.values():
            t[src] = 7
        dst = list(range(10, 16))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", keys, 0, dst, 0)]))
        assert worker.failed_blocks() == set() and _same(before, _pages(kv, dst))
        assert worker.store.flush()
        disk = worker.store.tiers[1]
        assert all(disk.contains(k) for k in keys)
        counters = _counters(worker)
        assert counters["saved_chunks"] == 3 and not counters.get("save_backlog_dropped")
    finally:
        worker.close()


@pytest.mark.parametrize("case", ["disk top tier", "torch engine"])
def test_async_saves_keep_the_background_writer_where_a_write_is_more_than_a_memcpy(tmp_path, case):
    """A store whose top tier is a disk (its write is file I/O), or the ``torch`` engine (the
    step only issues the device-to-host gather): staging slots and the writer thread stay."""
    disk = {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}
    if case == "disk top tier":
        worker, _ = _plain_worker(tmp_path, [disk])
    else:
        worker, _ = _plain_worker(tmp_path, [{"type": "ram", "capacity": "4MiB"}, disk], engine="torch")
    try:
        assert worker._saves is not None
        keys = _keys(2)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(4)))))
        assert worker.drain_saves() and worker.store.lookup(keys) == 2
    finally:
        worker.close()


@pytest.mark.parametrize("chunk_bytes, slots", [(0, 1), (10, 0)])
def test_background_saves_refuse_an_empty_backlog(chunk_bytes, slots):
    with pytest.raises(ValueError):
        worker_module.BackgroundSaves(None, chunk_bytes, slots)


def test_the_torch_engine_lands_the_gather_on_the_writer_thread_not_in_the_step(tmp_path, monkeypatch):
    """The CUDA path (``torch`` engine): the step issues the gather and returns; waiting for the
    copy to host and moving the bytes into the slots (``SaveStep.copy_to``) happens on the
    background writer's thread, never the engine's. With the ``host`` engine it is the step's."""
    threads: list[str] = []
    real_copy_to = SaveStep.copy_to

    def copy_to(self, i, segments, **kwargs):
        threads.append(threading.current_thread().name)
        return real_copy_to(self, i, segments, **kwargs)

    monkeypatch.setattr(SaveStep, "copy_to", copy_to)
    for engine, expected in (("torch", "kvtier-save"), ("host", threading.current_thread().name)):
        worker, kv, store = _worker(tmp_path / engine, monkeypatch, engine=engine)
        try:
            threads.clear()
            keys = _keys(2)
            worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(4)))))
            assert worker.drain_saves() and store.lookup(keys) == 2
            assert threads == [expected, expected], engine
        finally:
            worker.close()


def test_a_landing_that_fails_drops_its_chunks_and_frees_their_slots(tmp_path, monkeypatch):
    """The copy to host fails on the writer thread (injected): every chunk of that step is a
    counted drop, nothing reaches the store, the slots serve the next step."""
    worker, kv, store = _worker(tmp_path, monkeypatch, slots=2, engine="torch")
    try:
        real_copy_to, fail = SaveStep.copy_to, [True]

        def copy_to(self, i, segments, **kwargs):
            if fail[0]:
                raise RuntimeError("injected device-to-host failure")
            return real_copy_to(self, i, segments, **kwargs)

        monkeypatch.setattr(SaveStep, "copy_to", copy_to)
        keys = _keys(2)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(4)))))
        assert worker.drain_saves() and store.lookup(keys) == 0
        assert _counters(worker)["save_dropped"] == 2
        fail[0] = False
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(4)))))
        assert worker.drain_saves() and store.lookup(keys) == 2
        assert _counters(worker)["saved_chunks"] == 2
    finally:
        worker.close()

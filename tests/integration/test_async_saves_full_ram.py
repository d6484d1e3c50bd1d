"""``transfer_mode: async`` on a CPU engine over an in-process RAM tier runs ``store.write``
inside the step (one copy per page instead of two). A write into a full RAM tier evicts under
the store lock, and a victim whose write-through copy is still queued (lower-tier writers behind:
what ``writer_idle`` makes happen while the cores compute) was once copied twice on the step
thread (into scratch, then ``.tobytes()`` as an orphan). Now its pages stay pinned for that copy
(``kvtier.store.writeback.Orphan``) and a clean entry makes the room: the step copies nothing
but its own pages. Only when the next victim would stay pinned too, or none is left, does an
orphan get copied out (once), so that the write still fits."""

from __future__ import annotations

import threading

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import WorkerShare
from kvtier.store import TieredStore
from kvtier.store.writeback import Orphan
from kvtier.tiers.disk import DiskTier

from tests.integration.test_async_saves import GEOMETRY, _keys, _kv_caches, _saves

CHUNK = 6 * 1024  # 3 layers x 2 blocks x 1 KiB


def test_async_saves_over_a_full_ram_tier_copy_no_victims_in_the_step(tmp_path, monkeypatch):
    gate = threading.Event()
    gate.set()
    real_put = DiskTier.put

    def slow_put(self, *args, **kwargs):  # a lower-tier writer that does not get a core for now
        gate.wait(30)
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    step = threading.current_thread()
    step_copies = []
    real_snapshot, real_detach = TieredStore._snapshot_top, Orphan.detach

    def counting_snapshot(self, key):
        out = real_snapshot(self, key)
        if threading.current_thread() is step and out is not None:
            step_copies.append(("snapshot", out.nbytes))
        return out

    def counting_detach(self):
        done = real_detach(self)
        if threading.current_thread() is step and done:
            step_copies.append(("detach", CHUNK))
        return done

    monkeypatch.setattr(TieredStore, "_snapshot_top", counting_snapshot)
    monkeypatch.setattr(Orphan, "detach", counting_detach)
    tiers = [{"type": "ram", "capacity": 8 * CHUNK, "page_size": CHUNK},
             {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": "async", "load_threads": 2,
                                                "write_queue_depth": 64})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    worker.register_kv_caches(_kv_caches(0))
    try:
        assert worker._saves is None  # the step writes into the RAM tier itself
        first, second = _keys(4), _keys(6, start=10_000)
        worker.wait_for_save(KVTierMetadata(saves=_saves("a", first, list(range(8)))))
        assert worker.store.flush()  # the first request's chunks are on disk too: clean
        gate.clear()
        worker.wait_for_save(KVTierMetadata(saves=_saves("b", second, list(range(8, 20)))))
        assert step_copies == [], f"the step copied evicted chunks under the store lock: {step_copies}"
        assert worker.store._ledger.orphans()  # victims still waiting for their copies were evicted: pinned
        gate.set()
        assert worker.store.flush()
        disk = worker.store.tiers[1]
        assert all(disk.contains(k) for k in first + second)  # every pinned victim still reached the disk
    finally:
        gate.set()
        worker.close()

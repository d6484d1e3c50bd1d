"""A known cost, kept as a strict xfail: ``transfer_mode: async`` on a CPU engine over an in-process RAM tier now runs
``store.write`` inside the step (``_saves_copy_twice`` False). The claim is "one copy per page
instead of two". But a write into a full RAM tier evicts under the store lock, and a victim
whose write-through copy is still queued (lower-tier writers behind: exactly what ``writer_idle``
makes happen while the cores compute) is snapshotted twice (``_snapshot_top`` into scratch, then
``.tobytes()`` as an orphan) -- now on the engine's step thread, where before this commit the
background save writer paid it. So each chunk saved can cost the step 1 + 2 x victims copies,
all under the store lock."""

from __future__ import annotations

import threading

import pytest

from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import WorkerShare
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier

from tests.integration.test_async_saves import GEOMETRY, _keys, _kv_caches, _saves

CHUNK = 6 * 1024  # 3 layers x 2 blocks x 1 KiB


@pytest.mark.xfail(strict=True, reason="documented (docs/connector.md): under a full RAM tier whose victims still "
                   "wait for their lower-tier copies, the step copies each such victim aside, as in sync")
def test_async_saves_over_a_full_ram_tier_copy_no_victims_in_the_step(tmp_path, monkeypatch):
    gate = threading.Event()
    real_put = DiskTier.put

    def slow_put(self, *args, **kwargs):  # a lower-tier writer that does not get a core for now
        gate.wait(30)
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    step_snapshots = []
    real_snapshot = TieredStore._snapshot_top
    step = threading.current_thread()

    def counting_snapshot(self, key):
        out = real_snapshot(self, key)
        if threading.current_thread() is step and out is not None:
            step_snapshots.append(out.nbytes)
        return out

    monkeypatch.setattr(TieredStore, "_snapshot_top", counting_snapshot)
    tiers = [{"type": "ram", "capacity": 4 * CHUNK, "page_size": CHUNK},
             {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]
    config = ConnectorConfig.from_extra_config({"tiers": tiers, "transfer_mode": "async", "load_threads": 2,
                                                "write_queue_depth": 64})
    worker = KVTierWorker(config, GEOMETRY, WorkerShare())
    worker.register_kv_caches(_kv_caches(0))
    try:
        assert worker._saves is None  # the commit's path: the step writes into the RAM tier itself
        keys = _keys(12)
        worker.wait_for_save(KVTierMetadata(saves=_saves("r", keys, list(range(24)))))
        assert step_snapshots == [], (
            f"the step copied {len(step_snapshots)} evicted chunks ({sum(step_snapshots)} bytes, twice each: "
            "scratch + tobytes) under the store lock on top of its own copy")
    finally:
        gate.set()
        worker.close()

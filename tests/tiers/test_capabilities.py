"""Tier capabilities are declared by the tier classes and read through typed specs: how another
process sees a tier, each worker's share, the engine-page fit, the arena. No tier-type strings
outside the tiers, and a store-managed tier that declares nothing is refused at parse time."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.policies.lru import LRUPolicy
from kvtier.registry import Registry
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers import registry as tier_registry
from kvtier.tiers.base import RankShare, SchedulerView, Tier
from kvtier.tiers.disk import DiskConfig, DiskProbe, DiskTier
from kvtier.tiers.fs import FsTier
from kvtier.tiers.ram import ArenaTier, RamTier
from kvtier.tiers.registry import TierSpec, parse_tier_spec


def key(i: int) -> bytes:
    return hashlib.sha256(b"cap" + i.to_bytes(8, "little")).digest()


def test_each_tier_declares_how_another_process_sees_it(tmp_path):
    ram = parse_tier_spec({"type": "ram", "capacity": "1MiB"})
    disk = parse_tier_spec({"type": "disk", "path": str(tmp_path / "d")})
    fs = parse_tier_spec({"type": "fs", "path": str(tmp_path / "f")})
    assert ram.scheduler_view is SchedulerView.MIRRORED and ram.probe() is None
    assert disk.scheduler_view is SchedulerView.PROBED
    assert fs.scheduler_view is SchedulerView.SHARED
    with disk.build() as tier:
        assert tier.put(key(1), np.zeros(100, dtype=np.uint8))
        probe = disk.probe()
        assert isinstance(probe, DiskProbe) and probe.contains_many([key(1), key(2)]) == [True, False]
        probe.close()
    probe = fs.probe()
    try:
        assert isinstance(probe, FsTier) and probe.contains_many([key(1)]) == [False]
    finally:
        probe.close()


class _Undeclared(Tier):
    """A store-managed tier that does not say how other processes see it."""

    Config = DiskConfig


def test_a_store_managed_tier_that_declares_nothing_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="_Undeclared is store-managed but does not declare"):
        _Undeclared.scheduler_view()
    fake = Registry("tier", {"odd": f"{__name__}:_Undeclared"})
    monkeypatch.setattr(tier_registry, "TIERS", fake)
    with pytest.raises(ConfigError, match="does not declare how another process sees its keys"):
        parse_tier_spec({"type": "odd", "path": "/tmp/x"}, "store.tiers[0]")


def test_a_spec_is_typed_and_reads_as_the_mapping_it_came_from():
    spec = parse_tier_spec({"type": "ram", "capacity": "1MiB", "policy": "fifo", "name": "hot"})
    assert spec == {"type": "ram", "capacity": "1MiB", "policy": "fifo", "name": "hot"}
    assert spec.tier_class is RamTier and spec.config.capacity == 1024**2
    assert spec.name == "hot" and spec.policy == "fifo" and spec.medium == "CPU"
    with pytest.raises(ConfigError, match=r"^store\.tiers\[0\]\(ram\)\.capacity: cannot read 'lots'"):
        StoreConfig(tiers=[{"type": "ram", "capacity": "lots"}])
    with pytest.raises(ConfigError, match=r"^store\.tiers\[1\]\(disk\): unknown key 'pth'; valid keys: .*path"):
        TieredStore.from_config({"tiers": [{"type": "ram"}, {"type": "disk", "pth": "/x"}]})


def test_for_rank_is_each_tiers_own_split(tmp_path):
    share = RankShare(rank=1, world=2, stage=1, stages=2)
    assert share.workers == 4 and share.subdir == "pp2-stage1-tp2-rank1"
    assert RankShare(0, 4).subdir == "tp4-rank0"
    ram = parse_tier_spec({"type": "ram"}).for_rank(share)
    assert ram == {"type": "ram", "capacity": 1024**3 // 4}
    disk = parse_tier_spec({"type": "disk", "path": str(tmp_path), "capacity": "8GiB"}).for_rank(share)
    assert disk.config.path == os.path.join(str(tmp_path), share.subdir) and disk["capacity"] == 2 * 1024**3
    shared = {"type": "fs", "path": str(tmp_path / "shared")}
    assert parse_tier_spec(shared).for_rank(share) == shared


def test_engine_pages_fit_the_arena_but_keep_what_the_user_set():
    fitted = parse_tier_spec({"type": "ram", "capacity": "4MiB"}).for_engine_pages(8192)
    assert fitted.config.page_size == 8192 and fitted.config.prefault is True
    kept = parse_tier_spec({"type": "ram", "capacity": "4MiB", "page_size": 4096, "prefault": False})
    kept = kept.for_engine_pages(8192)
    assert kept.config.page_size == 4096 and kept.config.prefault is False


def test_the_arena_is_a_declared_base_and_a_top_tier_without_it_still_works(tmp_path):
    assert issubclass(RamTier, ArenaTier) and not issubclass(DiskTier, ArenaTier)
    disk = DiskTier(DiskConfig(path=str(tmp_path / "d"), capacity=1 << 20, drop_cache=False))
    with TieredStore([(disk, LRUPolicy())]) as store:  # read and written through Tier methods
        data = np.arange(10_000, dtype=np.uint8).tobytes()
        assert store.put(key(3), data) and store.get(key(3)) == data
        assert store.read(key(3), lambda segs: None) == "disk"


def test_tier_spec_passes_through_parsing_unchanged():
    spec = parse_tier_spec({"type": "ram"})
    assert parse_tier_spec(spec) is spec and isinstance(StoreConfig(tiers=[spec]).tiers[0], TierSpec)

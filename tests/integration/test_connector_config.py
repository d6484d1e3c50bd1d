"""``kv_connector_extra_config`` parsing and the per-rank split of process-local tiers (no engine)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402


def test_flat_store_keys_and_unknown_key():
    cfg = ConnectorConfig.from_extra_config({"tiers": [{"type": "ram", "capacity": "1GiB"}], "chunk_tokens": 256})
    assert cfg.chunk_tokens == 256 and cfg.store.tiers == [{"type": "ram", "capacity": "1GiB"}]
    with pytest.raises(ConfigError, match="unknown key 'tierz'; valid keys: .*tiers"):
        ConnectorConfig.from_extra_config({"tierz": []})


def test_for_rank_splits_local_capacity_and_disk_directories(tmp_path):
    tiers = [{"type": "ram", "capacity": "1GiB"}, {"type": "ram", "name": "small"},
             {"type": "disk", "path": str(tmp_path), "capacity": "10GiB"},
             {"type": "redis", "url": "redis://h:6379/0", "capacity": "4GiB"}]
    cfg = ConnectorConfig.from_extra_config({"tiers": tiers})
    assert cfg.for_rank(0, 1) is cfg
    r1 = cfg.for_rank(1, 4).store.tiers
    assert r1[0]["capacity"] == 1024**3 // 4
    assert r1[1]["capacity"] == 1024**3 // 4  # the RAM tier's default capacity, split too
    assert r1[2] == {"type": "disk", "path": os.path.join(str(tmp_path), "tp4-rank1"), "capacity": 10 * 1024**3 // 4}
    assert r1[3] == tiers[3]  # a shared tier: ranks write different keys into the same one
    assert cfg.store.tiers[2]["path"] == str(tmp_path)  # the original is unchanged


def test_bad_capacity_is_a_config_error_when_the_config_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\(ram\)\.capacity"):
        ConnectorConfig.from_extra_config({"tiers": [{"type": "ram", "capacity": "lots"}]})


def test_for_rank_with_pipeline_stages_splits_over_every_worker_and_has_per_stage_directories(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"tiers": [{"type": "disk", "path": str(tmp_path), "capacity": "8GiB"}]})
    dirs = set()
    for stage in range(2):
        for rank in range(2):
            tier = cfg.for_rank(rank, 2, stage, 2).store.tiers[0]
            assert tier["capacity"] == 8 * 1024**3 // 4
            dirs.add(tier["path"])
    assert dirs == {os.path.join(str(tmp_path), f"pp2-stage{s}-tp2-rank{r}") for s in range(2) for r in range(2)}
    only_pp = cfg.for_rank(0, 1, 1, 2).store.tiers[0]
    assert only_pp["path"] == os.path.join(str(tmp_path), "pp2-stage1-tp1-rank0")
    assert cfg.for_rank(1, 2).store.tiers[0]["path"] == os.path.join(str(tmp_path), "tp2-rank1")  # TP only: as before


@pytest.mark.parametrize("tiers, message", [
    ([{"type": "ramm"}], r"^kv_connector_extra_config\.tiers\[0\]: unknown tier type 'ramm'; valid types: disk, fs, ram, redis, s3$"),
    ([{"type": "ram"}, {"type": "disk", "pth": "/x"}], r"^kv_connector_extra_config\.tiers\[1\]\(disk\): unknown key 'pth'; valid keys: .*path"),
    ([{"type": "ram", "capacty": "1GiB"}], r"tiers\[0\]\(ram\): unknown key 'capacty'; valid keys: capacity"),
    ([{"capacity": "1GiB"}], r"tiers\[0\]: missing 'type'; valid types: disk"),
    ([{"type": "ram", "policy": "lfu"}], r"tiers\[0\]\(ram\): unknown policy 'lfu'; valid policies: fifo, lru"),
    (["ram"], r"tiers\[0\]: expected a mapping"),
])
def test_unknown_tier_types_keys_and_policies_are_one_config_error_line(tiers, message):
    for extra in ({"tiers": tiers}, {"store": {"tiers": tiers}}):
        with pytest.raises(ConfigError, match=message) as info:
            ConnectorConfig.from_extra_config(extra)
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_scheduler_side_connector_rejects_a_bad_tier_before_any_store_or_probe(tmp_path):
    """Today's scheduler skipped a tier it could not build with a warning (and a RAM tier's keys
    were never checked there): the bad spec surfaced only when the worker built its store, after
    the weights had loaded. Now constructing the scheduler side raises, as vLLM's frontend check
    (``requires_piecewise_for_cudagraph``, asked before any engine process on CUDA) does."""
    from kvtier.integrations.vllm.connector import KVTierConnector
    from tests.integration._vllm_config import make_tiny_model, scheduler_connector, vllm_config

    model = make_tiny_model(tmp_path / "m")
    good = vllm_config(model)
    bad = {"tiers": [{"type": "ram", "capacity": "16MiB"}, {"type": "dsk", "path": str(tmp_path / "d")}]}
    good.kv_transfer_config.kv_connector_extra_config = bad
    with pytest.raises(ConfigError, match=r"tiers\[1\]: unknown tier type 'dsk'; valid types"):
        scheduler_connector(good)
    assert not (tmp_path / "d").exists()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\(ram\): unknown key 'capcity'"):
        KVTierConnector.requires_piecewise_for_cudagraph({"tiers": [{"type": "ram", "capcity": "1GiB"}]})
    assert KVTierConnector.requires_piecewise_for_cudagraph({"tiers": [{"type": "ram"}]}) is False

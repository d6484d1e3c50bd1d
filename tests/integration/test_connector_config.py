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


def test_for_rank_bad_capacity_is_a_config_error(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"tiers": [{"type": "ram", "capacity": "lots"}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\].capacity"):
        cfg.for_rank(0, 2)

"""Out-of-range configuration values: each is one ConfigError line naming the key and the valid
range, never a bare ValueError/OverflowError from deep inside nor a silently empty tier."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kvtier.config import build, parse_size
from kvtier.errors import ConfigError
from kvtier.store import TieredStore


def ram(**kw) -> dict:
    return {"type": "ram", "capacity": "1MiB", "page_size": 4096, **kw}


def disk(tmp_path, **kw) -> dict:
    return {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB", **kw}


def fs(tmp_path, **kw) -> dict:
    return {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "1MiB", **kw}


CASES = {
    "ram capacity NaN": (lambda p: {"tiers": [ram(capacity=math.nan)]}, "capacity", "finite"),
    "ram capacity inf": (lambda p: {"tiers": [ram(capacity=math.inf)]}, "capacity", "finite"),
    "ram capacity 0": (lambda p: {"tiers": [ram(capacity=0)]}, "(ram).capacity", "[1, inf)"),
    "ram page_size negative": (lambda p: {"tiers": [ram(page_size=-1)]}, "(ram).page_size", "must not be negative"),
    "ram page_size over capacity": (lambda p: {"tiers": [ram(capacity=4096, page_size=8192)]},
                                    "(ram).page_size", "[1, capacity=4096]"),
    "disk capacity 0": (lambda p: {"tiers": [ram(), disk(p, capacity=0)]}, "(disk).capacity", "[1, inf)"),
    "disk capacity inf": (lambda p: {"tiers": [ram(), disk(p, capacity=math.inf)]}, "(disk).capacity", "finite"),
    "disk max_writes_in_flight 0": (lambda p: {"tiers": [ram(), disk(p, max_writes_in_flight=0)]},
                                    "(disk).max_writes_in_flight", "[1, 1024]"),
    "fs scan_interval_s negative": (lambda p: {"tiers": [ram(), fs(p, scan_interval_s=-1)]},
                                    "(fs).scan_interval_s", "[0, inf)"),
    "fs scan_interval_s NaN": (lambda p: {"tiers": [ram(), fs(p, scan_interval_s=math.nan)]},
                               "(fs).scan_interval_s", "finite"),
    "fs low_watermark 0": (lambda p: {"tiers": [ram(), fs(p, low_watermark=0)]}, "(fs).low_watermark", "(0, 1]"),
    "fs capacity NaN": (lambda p: {"tiers": [ram(), fs(p, capacity=math.nan)]}, "(fs).capacity", "finite"),
    "fs stale_tmp_s negative": (lambda p: {"tiers": [ram(), fs(p, stale_tmp_s=-5)]}, "(fs).stale_tmp_s", "[0, inf)"),
    "store write_queue_depth 0": (lambda p: {"write_queue_depth": 0}, "store.write_queue_depth", "[1, inf)"),
    "store max_entry_bytes 0": (lambda p: {"max_entry_bytes": 0}, "store.max_entry_bytes", "[1, inf)"),
    "store writer_nice 20": (lambda p: {"writer_nice": 20}, "store.writer_nice", "[0, 19]"),
    "store writer_nice -1": (lambda p: {"writer_nice": -1}, "store.writer_nice", "[0, 19]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_out_of_range_store_config_is_one_config_error_line(tmp_path, case):
    make, key, valid = CASES[case]
    with pytest.raises(ConfigError) as info:
        TieredStore.from_config(make(tmp_path)).close()
    msg = str(info.value)
    assert "\n" not in msg and key in msg and valid in msg, msg


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf"])
def test_parse_size_rejects_non_finite_sizes(value):
    with pytest.raises(ConfigError, match="capacity"):
        parse_size(value, "capacity")


def test_tiers_built_by_hand_are_checked_too(tmp_path):
    from kvtier.tiers.disk import DiskConfig, DiskTier
    from kvtier.tiers.ram import RamConfig, RamTier

    with pytest.raises(ConfigError, match=r"^mine\.page_size: must be in \[0, inf\), got -1$"):
        RamTier(RamConfig(capacity=4096, page_size=-1), name="mine")
    with pytest.raises(ConfigError, match=r"max_writes_in_flight: must be in \[1, 1024\], got 0"):
        DiskTier(DiskConfig(path=str(tmp_path), max_writes_in_flight=0))


def test_a_ram_page_size_of_0_is_the_default_for_the_codec():
    """0 (the default) is 256 KiB for a raw arena and 16 KiB for a coded one (whose entries'
    last pages are partly empty); a page size given stays, whatever the codec."""
    from kvtier.tiers.ram import RamConfig

    assert RamConfig().page_size == RamConfig(page_size=0).page_size == 256 << 10
    assert RamConfig(codec="lossless").page_size == 16 << 10
    assert RamConfig(codec="lossless", page_size=256 << 10).page_size == 256 << 10


def test_ranged_fields_are_a_general_mechanism():
    from kvtier.config import Range, ranged

    @dataclass(frozen=True)
    class Example:
        ratio: float = ranged(0.5, gt=0, lt=1)
        count: int = ranged(1, ge=1, le=8)

    assert build(Example, {"ratio": 0.25, "count": 8}) == Example(0.25, 8)
    for mapping, needle in (({"ratio": 1}, "Example.ratio: must be in (0, 1), got 1.0"),
                            ({"count": 9}, "Example.count: must be in [1, 8], got 9")):
        with pytest.raises(ConfigError) as info:
            build(Example, mapping)
        assert str(info.value) == needle
    assert math.nan not in Range(lo=0) and 5 in Range(lo=0) and 0 not in Range(lo=0, lo_open=True)

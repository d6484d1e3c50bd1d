"""Tier factories for the shared contract suite (``test_contract.py``).

To run the suite against another tier, add one line to ``FACTORIES``: a name and a function
``(request, tmp_path, capacity) -> Tier``. A factory may ask for other fixtures with
``request.getfixturevalue("redis_url")``; a fixture that skips (server binary missing) skips
that tier's tests only.
"""

from __future__ import annotations

from typing import Callable

import pytest

from kvtier.tiers.base import Tier


def _ram(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.ram import RamTier

    return RamTier(RamTier.Config(capacity=capacity, page_size=4096), name="ram")


def _ram_lossless(request, tmp_path, capacity: int) -> Tier:
    """A coded arena (``kvtier serve``'s, shared through a file), its coder running."""
    from kvtier.tiers.ram import RamTier

    path = tmp_path / f"arena-{len(list(tmp_path.glob('arena-*')))}"
    return RamTier(RamTier.Config(capacity=capacity, page_size=4096, shm_path=str(path), codec="lossless"),
                   name="ram")


def _disk(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.disk import DiskTier

    return DiskTier(DiskTier.Config(path=str(tmp_path / "disk"), capacity=capacity), name="disk")


def _disk_direct(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.disk import DiskTier

    config = DiskTier.Config(path=str(tmp_path / "disk"), capacity=capacity, o_direct=True)
    return DiskTier(config, name="disk")


def _redis(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.redis import RedisTier

    config = RedisTier.Config(url=request.getfixturevalue("redis_url"), capacity=capacity,
                              prefix=request.getfixturevalue("key_prefix"))
    return RedisTier(config, name="redis")


def _s3(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.s3 import S3Tier

    server = request.getfixturevalue("s3_server")
    config = S3Tier.Config(bucket=request.getfixturevalue("s3_bucket"), endpoint_url=server.endpoint_url,
                           access_key=server.access_key, secret_key=server.secret_key, capacity=capacity)
    return S3Tier(config, name="s3")


def _fs(request, tmp_path, capacity: int) -> Tier:
    from kvtier.tiers.fs import FsTier

    return FsTier(FsTier.Config(path=str(tmp_path / "fs"), capacity=capacity), name="fs")


FACTORIES: dict[str, Callable[..., Tier]] = {
    "ram": _ram,
    "ram-lossless": _ram_lossless,
    "disk": _disk,
    "disk-odirect": _disk_direct,
    "redis": _redis,
    "s3": _s3,
    "fs": _fs,
}


@pytest.fixture(params=list(FACTORIES))
def tier_factory(request, tmp_path):
    """A function ``make(capacity=64 MiB) -> Tier`` for one registered tier; closes what it made."""
    made: list[Tier] = []

    def make(capacity: int = 64 * 1024 * 1024) -> Tier:
        tier = FACTORIES[request.param](request, tmp_path, capacity)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def tier(tier_factory) -> Tier:
    """One fresh tier of each registered kind (64 MiB)."""
    return tier_factory()

"""The tier registry: ``{"type": NAME, ...config}`` -> a Tier."""

from __future__ import annotations

from typing import Any, Mapping

from kvtier.config import build
from kvtier.errors import ConfigError
from kvtier.registry import Registry
from kvtier.tiers.base import Tier

TIERS: Registry[Tier] = Registry(
    "tier",
    {
        "ram": "kvtier.tiers.ram:RamTier",
        "disk": "kvtier.tiers.disk:DiskTier",
        "redis": ("kvtier.tiers.redis:RedisTier", "install kvtier[redis]"),
        "s3": ("kvtier.tiers.s3:S3Tier", "install kvtier[s3]"),
        "fs": "kvtier.tiers.fs:FsTier",
    },
)


def make_tier(spec: Mapping[str, Any], where: str = "tier") -> Tier:
    """Build a tier from ``{"type": NAME, "name": optional, **config}``.

    Each tier class has a ``Config`` dataclass; unknown keys raise ConfigError listing valid ones.
    """
    spec = dict(spec)
    kind = spec.pop("type", None)
    if kind is None:
        raise ConfigError(f"{where}: missing 'type'; valid types: {', '.join(TIERS.names())}")
    cls = TIERS.get(kind)
    name = spec.pop("name", kind)
    config = build(cls.Config, spec, f"{where}({kind})")
    return cls(config, name=name)

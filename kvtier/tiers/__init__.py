"""Storage tiers: one protocol (``base.Tier``), one backend per file, one registry."""

from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.registry import TIERS, make_tier

__all__ = ["Tier", "TierStats", "TIERS", "make_tier"]

"""Storage tiers: one protocol (``base.Tier``), one backend per file, one registry.

- ``base.py``: ``Tier`` (the protocol, its counters) and the capabilities a tier declares
  (``SchedulerView``, ``RankShare``, ``Probe``).
- ``ram.py`` (``ArenaTier``, ``RamTier``), ``disk.py``, ``fs.py``, ``redis.py``, ``s3.py``: one
  backend each; ``breaker.py``: the circuit breaker of the network tiers.
- ``registry.py``: ``TIERS`` (lazy imports), ``TierSpec`` and ``parse_tier_spec`` (a tier's
  configuration, typed and checked when a configuration is read), ``make_tier``.

Imports: ``kvtier.keys``, ``kvtier.entry``, ``kvtier.config``, ``kvtier.errors``,
``kvtier.registry`` (and the policy registry's names, to check a spec); never the store, the
server, integrations or the CLI.
"""

from kvtier.tiers.base import Probe, RankShare, SchedulerView, Tier, TierStats
from kvtier.tiers.registry import TIERS, TierSpec, make_tier, parse_tier_spec

__all__ = ["Probe", "RankShare", "SchedulerView", "Tier", "TierStats", "TIERS", "TierSpec", "make_tier",
           "parse_tier_spec"]

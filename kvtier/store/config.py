"""StoreConfig: the typed configuration of a TieredStore.

Imports: ``kvtier.config``, ``kvtier.errors``, ``kvtier.policies.admission``,
``kvtier.tiers.registry`` (tier specs are parsed through it when the config is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.config import Size, ranged
from kvtier.errors import ConfigError
from kvtier.policies.admission import AdmissionConfig
from kvtier.tiers.registry import TierSpec, parse_tier_spec

DEFAULT_TIERS = ({"type": "ram", "capacity": "2GiB"},)


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of a TieredStore.

    ``tiers`` is an ordered list of tier specs, fastest first, each given as
    ``{"type": NAME, "policy": POLICY, ...tier config}`` and parsed into a ``TierSpec`` when
    the config is built (an unknown type, key or value is a ConfigError then, before anything
    is opened). ``policy`` is ignored for self-managed (shared) tiers. ``max_entry_bytes``: the
    largest entry the store reads (a chunk's bytes; the connector can set its exact chunk
    size); a stored header announcing more is a corrupt entry, so a forged length never sizes
    an allocation.
    """

    tiers: list[TierSpec] = field(default_factory=lambda: [dict(t) for t in DEFAULT_TIERS])
    write_queue_depth: int = ranged(64, ge=1)
    write_through: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_entry_bytes: Size = ranged(Size(1024**3), ge=1)

    def __post_init__(self):
        if not self.tiers:
            raise ConfigError("store.tiers: at least one tier is needed")
        if self.write_queue_depth < 1:
            raise ConfigError(f"store.write_queue_depth: must be in [1, inf), got {self.write_queue_depth!r}")
        # specs given as mappings (a config built by hand) are parsed here; built ones pass through
        specs = [parse_tier_spec(spec, f"store.tiers[{i}]") for i, spec in enumerate(self.tiers)]
        object.__setattr__(self, "tiers", specs)

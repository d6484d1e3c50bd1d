"""Break-even admission: do not store what will not pay for its write (off by default).

Storing a chunk costs a write on every miss; it pays only if the chunk is read again often
enough (the break-even hit rate, ``kvtier breakeven``). Two cheap predictors of "not again":

* a prefix shorter than ``min_prefix_chunks`` chunks saves too little recompute to be worth
  a store round trip;
* a key seen for the first time is usually a one-off: the *doorkeeper* admits a key only on
  its second sighting within a bounded memory of recent keys (TinyLFU's doorkeeper idea, kept
  exact with two generations of sets instead of a Bloom filter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from kvtier.errors import ConfigError
from kvtier.policies.base import Key


@dataclass(frozen=True)
class AdmissionConfig:
    """``enabled=False`` admits everything. ``doorkeeper_keys`` bounds the sighting memory."""

    enabled: bool = False
    min_prefix_chunks: int = 0
    doorkeeper: bool = False
    doorkeeper_keys: int = 100_000

    def __post_init__(self) -> None:
        if self.min_prefix_chunks < 0:
            raise ConfigError(f"admission.min_prefix_chunks must be >= 0, got {self.min_prefix_chunks}")
        if self.doorkeeper_keys <= 0:
            raise ConfigError(f"admission.doorkeeper_keys must be > 0, got {self.doorkeeper_keys}")


class Admission:
    """Decides whether a missed key is stored. Not thread-safe: the owner serialises calls."""

    def __init__(self, config: AdmissionConfig = AdmissionConfig()):
        self.config = config
        self._current: set[Hashable] = set()
        self._previous: set[Hashable] = set()
        self.rejected = 0

    def admit(self, key: Hashable, prefix_chunks: int | None = None) -> bool:
        """True if ``key`` (the last chunk of a ``prefix_chunks``-chunk prefix) should be stored.

        Every call counts as a sighting of ``key`` for the doorkeeper.
        """
        cfg = self.config
        if not cfg.enabled:
            return True
        if prefix_chunks is not None and prefix_chunks < cfg.min_prefix_chunks:
            self.rejected += 1
            return False
        if cfg.doorkeeper and not self._seen_before(key):
            self.rejected += 1
            return False
        return True

    def _seen_before(self, key: Hashable) -> bool:
        """Record a sighting; True if ``key`` was sighted within the last generation or two."""
        if key in self._current:
            return True
        seen = key in self._previous
        self._current.add(key)
        if len(self._current) >= self.config.doorkeeper_keys:
            # Forget the older generation: memory stays bounded, recent sightings survive.
            self._previous, self._current = self._current, set()
        return seen


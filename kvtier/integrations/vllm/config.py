"""Configuration of the vLLM KV connector, read from ``kv_connector_extra_config``.

Keys (all optional)::

    chunk_tokens       tokens per stored chunk, a multiple of the engine's block size (default:
                       128 rounded up to the block size; the tail of a prompt short of a whole
                       chunk is recomputed, so smaller chunks lose less of each prompt)
    tiers              ordered tier list, fastest first (default: one 4 GiB RAM tier)
    load_threads       chunks of one request read at once, overlapping lower tiers' I/O (4)
    write_queue_depth  bounded queue per lower tier (64); a full queue drops the write
    write_through      copy every new chunk to the lower tiers too (true)
    admission          {"min_prefix_chunks": N, "doorkeeper": bool} (off)
    config_file        a YAML/JSON file with these same keys; keys given inline win
    server             use a per-node kvtier cache server instead of in-process tiers
                       ("unix:///path.sock" or "tcp://host:port")
    server_token       the token a TCP server requires

With tensor parallelism the ``capacity`` of a ``ram`` or ``disk`` tier is the total over all
ranks, as vLLM's own ``kv_offloading_size`` is: each rank's store gets 1/TP of it, and each
rank's disk tier its own subdirectory ``tp{TP}-rank{r}`` of ``path`` (see ``for_rank``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvtier.config import build, load_mapping, parse_size
from kvtier.errors import ConfigError
from kvtier.store import StoreConfig

DEFAULT_CONNECTOR_TIERS = ({"type": "ram", "capacity": "4GiB"},)


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from ``kv_connector_extra_config``."""

    chunk_tokens: int | None = None
    load_threads: int = 4
    store: StoreConfig = field(default_factory=lambda: StoreConfig(tiers=[dict(t) for t in DEFAULT_CONNECTOR_TIERS]))
    server: str | None = None
    server_token: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ConfigError(f"kv_connector_extra_config.chunk_tokens: must be positive, got {self.chunk_tokens}")
        if self.load_threads < 1:
            raise ConfigError(f"kv_connector_extra_config.load_threads: must be at least 1, got {self.load_threads}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Build from vLLM's ``kv_connector_extra_config`` dict (flat store keys allowed)."""
        extra = dict(extra or {})
        path = extra.pop("config_file", None)
        merged = {**(load_mapping(path) if path else {}), **extra}
        own = {f.name for f in dataclasses.fields(cls)} - {"store"}
        store_keys = {f.name for f in dataclasses.fields(StoreConfig)}
        unknown = sorted(set(merged) - own - store_keys - {"store"})
        if unknown:
            valid = sorted(own | store_keys | {"config_file"})
            raise ConfigError(f"kv_connector_extra_config: unknown key {unknown[0]!r}; valid keys: {', '.join(valid)}")
        store = dict(merged.pop("store", {}) or {})
        for key in store_keys & set(merged):
            store[key] = merged.pop(key)
        store.setdefault("tiers", [dict(t) for t in DEFAULT_CONNECTOR_TIERS])
        merged["store"] = build(StoreConfig, store, "kv_connector_extra_config")
        return build(cls, merged, "kv_connector_extra_config")

    def with_page_size(self, page_bytes: int) -> "ConnectorConfig":
        """The same config with RAM tiers sized for the engine: page size = the engine's page
        size, and the arena touched at start.

        One arena page per engine (layer, block) page makes every page copy a single memcpy.
        Touching the arena at start moves its page faults out of the first requests (measured:
        +6% TTFT on a first pass with an untouched arena, +1% with it touched). Explicit
        ``page_size``/``prefault`` settings are kept.
        """
        tiers = []
        for spec in self.store.tiers:
            spec = dict(spec)
            if spec.get("type") == "ram":
                spec.setdefault("page_size", page_bytes)
                spec.setdefault("prefault", True)
            tiers.append(spec)
        return dataclasses.replace(self, store=dataclasses.replace(self.store, tiers=tiers))

    def for_rank(self, rank: int, world: int) -> "ConnectorConfig":
        """The config of tensor-parallel rank ``rank`` of ``world`` (itself when ``world`` is 1).

        Each rank's worker owns a store of its own, holding its share of every chunk. A ``ram``
        or ``disk`` tier's ``capacity`` (given, or the tier's default) is split evenly, and a
        disk tier moves to ``path/tp{world}-rank{rank}``, so no two stores manage one directory.
        Shared tiers (redis, s3, fs) are shared anyway: ranks use different keys there.
        """
        if world == 1:
            return self
        from kvtier.tiers.registry import TIERS

        tiers = []
        for i, spec in enumerate(self.store.tiers):
            spec = dict(spec)
            kind = spec.get("type")
            if kind in ("ram", "disk"):
                default = {f.name: f.default for f in dataclasses.fields(TIERS.get(kind).Config)}.get("capacity")
                total = parse_size(spec.get("capacity", default), f"tiers[{i}].capacity")
                spec["capacity"] = total // world
            if kind == "disk" and spec.get("path"):
                spec["path"] = os.path.join(spec["path"], f"tp{world}-rank{rank}")
            tiers.append(spec)
        return dataclasses.replace(self, store=dataclasses.replace(self.store, tiers=tiers))

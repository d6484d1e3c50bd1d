"""The tier registry: ``{"type": NAME, ...config}`` -> a typed ``TierSpec`` -> a Tier.

A configuration names its tiers as plain mappings; ``parse_tier_spec`` turns one into a
``TierSpec`` when the configuration is read (the tier type exists, every key is one of that
tier's keys, every value has the right type and range, the tier declares its capabilities), so
a mistake fails at parse time, with one line naming it and the valid choices, before anything
is opened. ``TierSpec.build`` then makes the tier.

Tiers from outside the project: a distribution declares an entry point in the group
``kvtier.tiers`` (``mytier = "mypkg.tier:MyTier"``), and ``{"type": "mytier", ...}`` reaches it.
Entry points are read only when a type is not built in, and a plugin is imported only when its
type is asked for. A built-in name always means the built-in tier: a plugin under one of those
names is never loaded (a warning names it). A plugin that fails to import, is not a ``Tier``
subclass, or declares no ``Config`` dataclass or a bad ``locality`` is one ConfigError line
naming the plugin and the problem.

Imports: ``kvtier.registry``, ``kvtier.config``, ``kvtier.errors``, ``kvtier.tiers.base``;
tier backends only lazily, through ``TIERS``, plugins through ``importlib.metadata``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Mapping
from typing import Any, Iterator

from kvtier.config import build
from kvtier.errors import ConfigError
from kvtier.registry import Registry
from kvtier.tiers.base import LOCAL, REMOTE, Probe, RankShare, SchedulerView, Tier

log = logging.getLogger(__name__)

#: The entry-point group of tiers from other distributions (``name = "module:Class"``).
ENTRY_POINT_GROUP = "kvtier.tiers"

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

_SPEC_KEYS = frozenset({"type", "name", "policy"})  # keys of a spec beside the tier's own


class TierSpec(Mapping):
    """One tier of a store configuration, parsed and typed (immutable).

    ``type``, ``name``, ``policy`` (None: the store's default), ``tier_class`` and ``config``
    (the tier's own typed Config) are attributes. As a read-only mapping it is the options as
    given (``spec["capacity"]`` is ``"1GiB"`` if that is what was written), so it prints,
    compares and round-trips like the dict it came from.
    """

    __slots__ = ("type", "name", "policy", "tier_class", "config", "_options")

    def __init__(self, kind: str, tier_class: type[Tier], config: Any, options: Mapping[str, Any]):
        self.type = kind
        self.tier_class = tier_class
        self.config = config
        self.name: str = options.get("name", kind)
        self.policy: str | None = options.get("policy")
        self._options = dict(options)

    # the mapping view: the options as given
    def __getitem__(self, key: str) -> Any:
        return self._options[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def __repr__(self) -> str:
        return f"TierSpec({self._options!r})"

    # capabilities
    @property
    def self_managed(self) -> bool:
        """Whether the tier enforces its own capacity (a shared tier)."""
        return self.tier_class.self_managed

    @property
    def scheduler_view(self) -> SchedulerView:
        """How another process learns this tier's keys (``Tier.scheduler_view``)."""
        return self.tier_class.scheduler_view()

    @property
    def medium(self) -> str:
        """What KV events call this tier's medium."""
        return self.tier_class.medium

    def build(self) -> Tier:
        """Open the tier. TierUnavailable when it cannot start now."""
        return self.tier_class(self.config, name=self.name)

    def probe(self) -> Probe | None:
        """A lookup-only view for a process that does not own the tier (None: mirrored)."""
        return self.tier_class.scheduler_probe(self.config, self.name)

    # derived specs
    def with_config(self, config: Any) -> "TierSpec":
        """The same spec with the tier's config replaced; options that changed are written
        out (as values, not as given)."""
        if config == self.config:
            return self
        options = dict(self._options)
        for f in dataclasses.fields(config):
            new = getattr(config, f.name)
            if f.init and new != getattr(self.config, f.name):
                options[f.name] = new
        return TierSpec(self.type, self.tier_class, config, options)

    def for_rank(self, share: RankShare) -> "TierSpec":
        """This tier as one worker of ``share`` configures it (``Tier.for_rank``)."""
        return self.with_config(self.tier_class.for_rank(self.config, share))

    def for_engine_pages(self, page_bytes: int) -> "TierSpec":
        """This tier fitted to an engine's page size (``Tier.for_engine_pages``)."""
        given = frozenset(self._options) - _SPEC_KEYS
        return self.with_config(self.tier_class.for_engine_pages(self.config, page_bytes, given))

    @classmethod
    def from_config_value(cls, value: Any, where: str) -> "TierSpec":
        """The hook ``kvtier.config.build`` calls for a field typed ``TierSpec``."""
        return parse_tier_spec(value, where)


def parse_tier_spec(spec: Any, where: str = "tier") -> TierSpec:
    """Parse ``{"type": NAME, "name": optional, "policy": optional, **tier config}``.

    ConfigError, one line naming ``where``, the problem and the valid choices: not a mapping,
    missing or unknown type, a missing package, an unknown key or policy, a bad value, or a
    tier class that does not declare how other processes see it. Opens nothing.
    """
    if isinstance(spec, TierSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected a mapping with a 'type'; valid types: {', '.join(tier_types())}")
    kind = spec.get("type")
    if kind is None:
        raise ConfigError(f"{where}: missing 'type'; valid types: {', '.join(tier_types())}")
    cls = tier_class(kind, where)
    keys = {f.name for f in dataclasses.fields(cls.Config) if f.init}
    unknown = sorted(set(spec) - keys - _SPEC_KEYS, key=str)
    if unknown:
        valid = sorted(keys | _SPEC_KEYS)
        raise ConfigError(f"{where}({kind}): unknown key {unknown[0]!r}; valid keys: {', '.join(valid)}")
    _check_policy(spec.get("policy"), f"{where}({kind})")
    config = build(cls.Config, {k: v for k, v in spec.items() if k not in _SPEC_KEYS}, f"{where}({kind})")
    cls.scheduler_view()  # a store-managed tier that declares nothing is refused here
    if getattr(config, "codec", "none") != "none":  # a missing codec library fails here, in one line
        from kvtier.codecs import get_codec

        get_codec(config.codec, f"{where}({kind}).codec")
    return TierSpec(kind, cls, config, spec)


def tier_types() -> list[str]:
    """Every tier type a spec may name: the built-in ones, then those of installed plugins."""
    builtin = TIERS.names()
    return builtin + sorted(set(_plugin_entry_points()) - set(builtin))


def builtin_tier_classes() -> dict[str, type[Tier]]:
    """The built-in tier classes by type name (their modules import no optional package)."""
    return {kind: TIERS.get(kind) for kind in TIERS.names()}


def tier_class(kind: Any, where: str = "tier") -> type[Tier]:
    """The class of tier type ``kind``: a built-in one, else the plugin of that name in the
    ``kvtier.tiers`` entry-point group, imported and checked now. ConfigError, one line naming
    ``where``: an unknown type (listing the valid ones), a built-in tier's missing package, or a
    broken plugin (naming it and what is wrong)."""
    if isinstance(kind, str) and kind in TIERS.names():
        try:
            return TIERS.get(kind)
        except ConfigError as exc:  # the tier's package is missing
            raise ConfigError(f"{where}: {exc}") from exc
    found = _plugin_entry_points().get(kind) if isinstance(kind, str) else None
    if not found:
        raise ConfigError(f"{where}: unknown tier type {kind!r}; valid types: {', '.join(tier_types())}")
    if len(found) > 1:
        raise ConfigError(f"{where}: tier type {kind!r} is declared by several plugins "
                          f"({', '.join(_plugin_label(ep) for ep in found)}); uninstall all but one")
    return _load_plugin(found[0], f"{where}: tier plugin {_plugin_label(found[0])}")


def _plugin_entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """The ``kvtier.tiers`` entry points by name, built-in names left out (with a warning).
    Read from the installed distributions on each call (a configuration is parsed rarely)."""
    out: dict[str, list[importlib.metadata.EntryPoint]] = {}
    builtin = set(TIERS.names())
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in builtin:
            if (ep.name, ep.value) in _WARNED:
                continue
            _WARNED.add((ep.name, ep.value))
            log.warning("tier plugin %s ignored: %r is a built-in tier type, which a plugin cannot replace",
                        _plugin_label(ep), ep.name)
            continue
        if not any(ep.value == seen.value for seen in out.get(ep.name, ())):  # one dist seen twice on sys.path
            out.setdefault(ep.name, []).append(ep)
    return out


_WARNED: set[tuple[str, str]] = set()  # plugins under a built-in name, warned about once


def _plugin_label(ep: importlib.metadata.EntryPoint) -> str:
    """``'name' (module:Class, from dist 1.0)`` for messages."""
    dist = getattr(ep, "dist", None)
    origin = f", from {dist.name} {dist.version}" if dist is not None else ""
    return f"{ep.name!r} ({ep.value}{origin})"


def _load_plugin(ep: importlib.metadata.EntryPoint, where: str) -> type[Tier]:
    """Import a plugin's class and check what it declares; ConfigError naming ``where``."""
    try:
        cls = ep.load()
    except Exception as exc:  # a plugin's import runs foreign code: any failure is its own
        raise ConfigError(f"{where} failed to import: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"{where} is not a kvtier.tiers.base.Tier subclass (got {cls!r})")
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise ConfigError(f"{where} declares no Config dataclass (class attribute 'Config', got {config!r})")
    if cls.locality not in (LOCAL, REMOTE):
        raise ConfigError(f"{where}: locality must be {LOCAL!r} or {REMOTE!r}, got {cls.locality!r}")
    for attr in ("medium", "kv_event_medium"):
        value = getattr(cls, attr)
        if not (isinstance(value, str) and value and value == value.upper()):
            raise ConfigError(f"{where}: {attr} must be a non-empty upper-case name, got {value!r}")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"{where} does not implement the abstract methods: {missing}")
    return cls


def _check_policy(policy: Any, where: str) -> None:
    from kvtier.policies.registry import POLICIES  # policies sit beside tiers; imported when used

    if policy is not None and policy not in POLICIES.names():
        raise ConfigError(f"{where}: unknown policy {policy!r}; valid policies: {', '.join(POLICIES.names())}")


def make_tier(spec: Mapping[str, Any], where: str = "tier") -> Tier:
    """Build a tier from ``{"type": NAME, "name": optional, **config}`` (see ``parse_tier_spec``)."""
    return parse_tier_spec(spec, where).build()

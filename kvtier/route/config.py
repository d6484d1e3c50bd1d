"""Configuration of ``kvtier route``: one frozen dataclass built once at the edge.

``RouteConfig.from_dict`` takes the YAML/JSON form through ``kvtier.config.build`` (unknown keys
rejected listing the valid ones, types coerced, declared ranges checked: the one error format of
every kvtier config); ``merge_flags`` lays command-line values over it. Every mistake raises
``ConfigError`` with a one-line message. Nothing here does I/O except ``load_file``.

Engine URLs may carry credentials (``http://user:pass@host:8000``): they are sent to that engine
as HTTP Basic auth and never shown. ``EngineSpec.name`` (the URL without them) is what the
router's health JSON, metric labels, logs and error messages use.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from kvtier.config import Size, build, load_mapping, ranged, validate
from kvtier.errors import ConfigError
from kvtier.tiers.base import REMOTE
from kvtier.tiers.registry import builtin_tier_classes

#: Where a block lives -> how much a prefix block there is worth (engine pool > kvtier RAM > disk
#: > a shared tier every engine loads). A medium not listed gets the lowest weight listed.
DEFAULT_TIER_WEIGHTS: tuple[tuple[str, float], ...] = (
    ("GPU", 1.0), ("CPU", 0.8), ("DISK", 0.5), ("STORAGE", 0.5),
    ("SERVER", 0.4), ("FS", 0.3), ("REDIS", 0.3), ("STORAGE_REMOTE", 0.3), ("S3", 0.25),
)
#: Media that every engine can load from: a block held there counts for all engines. The tiers
#: that say so (``Tier.locality`` REMOTE: fs, redis, s3), a per-node cache server, and any other
#: remote STORAGE (``kvtier.route.index.normalize_medium``).
DEFAULT_SHARED_MEDIA: tuple[str, ...] = (
    *sorted(cls.medium for cls in builtin_tier_classes().values() if cls.locality == REMOTE),
    "SERVER", "STORAGE_REMOTE",
)
_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def redact_url(url: str) -> str:
    """``url`` without its userinfo (``http://u:p@h:1/x`` -> ``http://h:1/x``), trailing ``/``
    dropped; a URL that does not parse is shown as ``<unparseable URL>`` (never echoed)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparseable URL>"
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)).rstrip("/")


@dataclass(frozen=True)
class EngineSpec:
    """One upstream vLLM server: its HTTP base URL and, optionally, its KV event endpoints.

    ``url`` may hold ``user:password@`` (kept out of ``repr``); ``name`` is the URL without it."""

    url: str = field(repr=False)
    kv_events: str | None = None
    kv_replay: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            shown = redact_url(self.url) if isinstance(self.url, str) else type(self.url).__name__
            raise ConfigError(f"route: engine URL must start with http:// or https://, got {shown!r}")
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018  (raises on a bad port)
        except ValueError as exc:
            raise ConfigError(f"route: engine URL {redact_url(self.url)!r} does not parse: {exc}") from exc
        if not parts.hostname:
            raise ConfigError(f"route: engine URL {redact_url(self.url)!r} has no host")
        if "@" in parts.path + parts.query + parts.fragment:  # credentials with an unescaped / ? or #
            raise ConfigError("route: an engine URL has '@' after its host (credentials holding '/', '?' or '#'?); "
                              "percent-encode them (%2F, %3F, %23); the URL is not shown")
        for ep in (self.kv_events, self.kv_replay):
            if ep is not None and not (isinstance(ep, str) and ep.startswith(_EVENT_SCHEMES)):
                raise ConfigError(f"route: KV event endpoint must be tcp://, ipc:// or inproc://, got {ep!r}")

    @property
    def name(self) -> str:
        """The URL without credentials: the engine's identity in health, metrics and logs."""
        return redact_url(self.url)

    @property
    def authorization(self) -> str | None:
        """``Basic ...`` from the URL's userinfo (percent-decoded), or None without one."""
        parts = urlsplit(self.url)
        if parts.username is None and parts.password is None:
            return None
        pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        return "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")

    @classmethod
    def from_config_value(cls, value: Any, where: str) -> "EngineSpec":
        """From a URL string or a mapping (url, kv_events, kv_replay, topic)."""
        if isinstance(value, EngineSpec):
            return value
        if isinstance(value, str):
            return cls(url=value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            if not value.get("url") and set(value) <= known:
                raise ConfigError(f"{where}: 'url' is required")
            return build(cls, {k: v for k, v in value.items() if v is not None or k == "url"}, where)
        raise ConfigError(f"{where}: expected a URL or a mapping, got {type(value).__name__}")


class TierWeights(tuple):
    """``((MEDIUM, weight), ...)``: from a non-empty mapping medium -> weight (upper-cased)."""

    @classmethod
    def from_config_value(cls, value: Any, where: str) -> "TierWeights":
        if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            value = dict(value)
        if not isinstance(value, Mapping) or not value:
            raise ConfigError(f"{where}: must be a non-empty mapping medium -> weight")
        out = []
        for medium, weight in value.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ConfigError(f"{where}[{medium}]: must be a number, got {type(weight).__name__}")
            w = float(weight)
            if not (math.isfinite(w) and w >= 0):
                raise ConfigError(f"{where}[{medium}]: must be a finite number >= 0, got {w}")
            out.append((str(medium).upper(), w))
        return cls(out)


class Media(tuple):
    """Upper-cased medium names, from a list of strings."""

    @classmethod
    def from_config_value(cls, value: Any, where: str) -> "Media":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of media, got {type(value).__name__}")
        return cls(str(m).upper() for m in value)


@dataclass(frozen=True)
class RouteConfig:
    """Everything the router needs; defaults follow the document's scheduler (prefix 2.0, load 1.0).

    The front door's bounds (each configurable): a request line and headers must arrive within
    ``header_timeout_s`` of their first byte, a body within ``body_timeout_s`` of its headers
    (else 408), a connection idle between requests is closed after ``keepalive_timeout_s``; a
    body over ``max_body_bytes`` is a 413 (told by Content-Length before a byte is read), and
    all bodies being held at once share ``max_body_bytes_total`` (over it: 503). At most
    ``max_connections`` client connections (lowered to fit the file-descriptor limit); over it
    the longest-idle connection is closed, or the new one refused with a 503 when none is idle.
    An engine must send its first byte within ``first_byte_timeout_s`` (else 504) and then no
    gap longer than ``stream_idle_timeout_s`` (else the client's response is cut). Only the first
    ``max_route_tokens`` tokens of a prompt are keyed for routing (the engine gets it whole)."""

    engines: tuple[EngineSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = ranged(8000, ge=0, le=65535)
    tokenizer: str | None = None
    block_size: int = ranged(0, ge=0)  # 0: learn from the first full BlockStored event
    prefix_weight: float = ranged(2.0, ge=0)
    load_weight: float = ranged(1.0, ge=0)
    tier_weights: TierWeights = TierWeights(DEFAULT_TIER_WEIGHTS)
    shared_media: Media = Media(DEFAULT_SHARED_MEDIA)
    max_index_keys: int = ranged(1_000_000, ge=1)
    speculative_ttl_s: float = ranged(5.0, ge=0)
    prefill_norm_tokens: int = ranged(1024, ge=1)
    balance_ratio: float = ranged(1.5, ge=0)  # 0 disables the request-share guard and placement by working set
    balance_window: int = ranged(32, ge=1)
    balance_slack: int = ranged(2, ge=0)  # the guard ignores differences of this many requests or fewer
    health_interval_s: float = ranged(1.0, gt=0)
    health_timeout_s: float = ranged(1.0, gt=0)
    unhealthy_after: int = ranged(2, ge=1)
    healthy_after: int = ranged(2, ge=1)
    retries: int = ranged(1, ge=0)
    connect_timeout_s: float = ranged(2.0, gt=0)
    replay_timeout_s: float = ranged(2.0, gt=0)
    first_byte_timeout_s: float = ranged(300.0, gt=0)
    stream_idle_timeout_s: float = ranged(60.0, gt=0)
    header_timeout_s: float = ranged(10.0, gt=0)
    body_timeout_s: float = ranged(30.0, gt=0)
    keepalive_timeout_s: float = ranged(15.0, gt=0)
    max_body_bytes: Size = ranged(32 * 1024**2, ge=1024)
    max_body_bytes_total: Size = ranged(512 * 1024**2, ge=1024)
    max_connections: int = ranged(1024, ge=1)
    max_route_tokens: int = ranged(262_144, ge=1)
    log_decisions: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", tuple(self.engines))
        object.__setattr__(self, "tier_weights", TierWeights.from_config_value(self.tier_weights, "route.tier_weights"))
        object.__setattr__(self, "shared_media", Media.from_config_value(self.shared_media, "route.shared_media"))
        validate(self, "route")

    def check(self, where: str) -> None:
        """Checks across fields (called by ``kvtier.config.validate`` after the ranges)."""
        if not self.engines:
            raise ConfigError(f"{where}: at least one --engine URL is required")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: the same engine URL is given twice")
        if 0 < self.balance_ratio < 1:
            raise ConfigError(f"{where}.balance_ratio: must be 0 (off) or >= 1, got {self.balance_ratio}")
        if self.max_body_bytes_total < self.max_body_bytes:
            raise ConfigError(f"{where}.max_body_bytes_total: must be >= max_body_bytes "
                              f"({self.max_body_bytes}), got {self.max_body_bytes_total}")

    def weight_of(self, medium: str) -> float:
        """The tier weight of ``medium`` (upper-cased; unknown media get the lowest weight)."""
        table = dict(self.tier_weights)
        return table.get(medium.upper(), min(table.values()) if table else 0.0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RouteConfig":
        """Build from the YAML/JSON form; ``engines`` is a list of URLs or of mappings
        (url, kv_events, kv_replay, topic); ``tier_weights`` a mapping medium -> weight."""
        if not isinstance(data, Mapping):
            raise ConfigError("route: expected a mapping at the top level")
        return build(cls, data, "route")

    def replace(self, **changes: Any) -> "RouteConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (``kvtier.config.load_mapping``: ConfigError
    on a missing or malformed file)."""
    return load_mapping(str(path))


def pair_endpoints(urls: Sequence[str], values: Sequence[str], flag: str) -> dict[str, str]:
    """Pair ``--kv-events``/``--kv-replay`` values with engines: ``URL=ENDPOINT`` names the
    engine (with or without its credentials); a bare endpoint goes to the engine in the same
    position. One-line errors."""
    out: dict[str, str] = {}
    bare = [v for v in values if "=" not in v]
    named = [v for v in values if "=" in v]
    if bare and named:
        raise ConfigError(f"route: {flag}: give every value as URL=ENDPOINT or none of them")
    if len(bare) > len(urls):
        raise ConfigError(f"route: {flag}: {len(bare)} endpoints for {len(urls)} engines")
    for url, ep in zip(urls, bare):
        out[url] = ep
    by_name = {redact_url(u): u for u in urls}
    for item in named:
        url, _, ep = item.partition("=")
        full = url if url in urls else by_name.get(redact_url(url))
        if full is None:
            raise ConfigError(f"route: {flag}: {redact_url(url)} is not one of the --engine URLs")
        out[full] = ep
    return out


def merge_flags(base: Mapping[str, Any], engines: Sequence[str], kv_events: Sequence[str],
                kv_replay: Sequence[str], overrides: Mapping[str, Any]) -> RouteConfig:
    """The file's dict with command-line engines and non-None ``overrides`` laid over it."""
    data = dict(base)
    if engines:
        ev = pair_endpoints(engines, kv_events, "--kv-events")
        rp = pair_endpoints(engines, kv_replay, "--kv-replay")
        data["engines"] = [{"url": u, "kv_events": ev.get(u), "kv_replay": rp.get(u)} for u in engines]
    elif kv_events or kv_replay:
        raise ConfigError("route: --kv-events/--kv-replay need --engine URLs on the command line")
    for name, value in overrides.items():
        if value is not None:
            data[name] = value
    return RouteConfig.from_dict(data)


__all__ = ["EngineSpec", "RouteConfig", "DEFAULT_TIER_WEIGHTS", "DEFAULT_SHARED_MEDIA", "TierWeights", "Media",
           "redact_url", "load_file", "pair_endpoints", "merge_flags"]

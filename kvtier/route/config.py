"""Configuration of ``kvtier route``: one frozen dataclass built once at the edge.

``RouteConfig.from_dict`` takes the YAML/JSON form (unknown keys rejected, listing the valid
ones); ``merge_flags`` lays command-line values over it. Every mistake raises ``ConfigError``
with a one-line message. Nothing here does I/O except ``load_file``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvtier.errors import ConfigError

#: Where a block lives -> how much a prefix block there is worth (engine pool > kvtier RAM > disk
#: > a shared tier every engine loads). A medium not listed gets the lowest weight listed.
DEFAULT_TIER_WEIGHTS: tuple[tuple[str, float], ...] = (
    ("GPU", 1.0), ("CPU", 0.8), ("DISK", 0.5), ("STORAGE", 0.5),
    ("SERVER", 0.4), ("FS", 0.3), ("REDIS", 0.3), ("STORAGE_REMOTE", 0.3), ("S3", 0.25),
)
#: Media that every engine can load from: a block held there counts for all engines.
DEFAULT_SHARED_MEDIA: tuple[str, ...] = ("REDIS", "S3", "FS", "SERVER", "STORAGE_REMOTE")


@dataclass(frozen=True)
class EngineSpec:
    """One upstream vLLM server: its HTTP base URL and, optionally, its KV event endpoints."""

    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    topic: str = ""


@dataclass(frozen=True)
class RouteConfig:
    """Everything the router needs; defaults follow the document's scheduler (prefix 2.0, load 1.0)."""

    engines: tuple[EngineSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str | None = None
    block_size: int = 0  # 0: learn from the first full BlockStored event
    prefix_weight: float = 2.0
    load_weight: float = 1.0
    tier_weights: tuple[tuple[str, float], ...] = DEFAULT_TIER_WEIGHTS
    shared_media: tuple[str, ...] = DEFAULT_SHARED_MEDIA
    max_index_keys: int = 1_000_000
    speculative_ttl_s: float = 5.0
    prefill_norm_tokens: int = 1024
    balance_ratio: float = 1.5  # 0 disables the request-share guard and placement by working set
    balance_window: int = 32
    balance_slack: int = 2  # the guard ignores differences of this many requests or fewer (see score.py)
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 2
    retries: int = 1
    connect_timeout_s: float = 2.0
    replay_timeout_s: float = 2.0
    log_decisions: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    def weight_of(self, medium: str) -> float:
        """The tier weight of ``medium`` (upper-cased; unknown media get the lowest weight)."""
        table = dict(self.tier_weights)
        return table.get(medium.upper(), min(table.values()) if table else 0.0)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RouteConfig":
        """Build from the YAML/JSON form; ``engines`` is a list of URLs or of mappings
        (url, kv_events, kv_replay, topic); ``tier_weights`` a mapping medium -> weight."""
        if not isinstance(data, Mapping):
            raise ConfigError("route config: expected a mapping at the top level")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConfigError(f"route config: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        kwargs: dict[str, Any] = dict(data)
        kwargs["engines"] = tuple(_engine(e) for e in (data.get("engines") or ()))
        if "tier_weights" in data:
            kwargs["tier_weights"] = _tier_weights(data["tier_weights"])
        if "shared_media" in data:
            kwargs["shared_media"] = tuple(str(m).upper() for m in (data["shared_media"] or ()))
        for name, value in list(kwargs.items()):
            kwargs[name] = _coerce(name, value)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "RouteConfig":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


_ENGINE_KEYS = ("url", "kv_events", "kv_replay", "topic")


def _engine(item: Any) -> EngineSpec:
    if isinstance(item, str):
        return EngineSpec(url=item)
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - set(_ENGINE_KEYS))
        if unknown:
            raise ConfigError(f"route config: engine: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_ENGINE_KEYS)}")
        if not item.get("url"):
            raise ConfigError("route config: engine: 'url' is required")
        return EngineSpec(url=str(item["url"]), kv_events=item.get("kv_events"),
                          kv_replay=item.get("kv_replay"), topic=str(item.get("topic") or ""))
    raise ConfigError(f"route config: engine: expected a URL or a mapping, got {type(item).__name__}")


def _tier_weights(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError("route config: tier_weights must be a non-empty mapping medium -> weight")
    out = []
    for medium, weight in value.items():
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise ConfigError(f"route config: tier_weights[{medium}] must be a number, got {weight!r}") from None
        out.append((str(medium).upper(), w))
    return tuple(out)


_FLOATS = {f.name for f in fields(RouteConfig) if f.type in ("float", float)}
_INTS = {f.name for f in fields(RouteConfig) if f.type in ("int", int)}


def _coerce(name: str, value: Any) -> Any:
    try:
        if name in _FLOATS:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if name in _INTS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"route config: {name} must be a number, got {value!r}") from None
    if name == "log_decisions" and not isinstance(value, bool):
        raise ConfigError(f"route config: log_decisions must be true or false, got {value!r}")
    return value


def _validate(cfg: RouteConfig) -> None:
    if not cfg.engines:
        raise ConfigError("route: at least one --engine URL is required")
    urls = [e.url for e in cfg.engines]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"route: engine URL must start with http:// or https://, got {url!r}")
    if len(set(urls)) != len(urls):
        raise ConfigError("route: the same engine URL is given twice")
    for e in cfg.engines:
        for ep in (e.kv_events, e.kv_replay):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"route: KV event endpoint must be tcp://, ipc:// or inproc://, got {ep!r}")
    positive = ("health_interval_s", "health_timeout_s", "connect_timeout_s", "replay_timeout_s")
    for name in positive:
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"route: {name} must be a positive number, got {v}")
    for name in ("prefix_weight", "load_weight", "speculative_ttl_s", "balance_ratio"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"route: {name} must be a finite number >= 0, got {v}")
    if 0 < cfg.balance_ratio < 1:
        raise ConfigError(f"route: balance_ratio must be 0 (off) or >= 1, got {cfg.balance_ratio}")
    for name, low in (("max_index_keys", 1), ("prefill_norm_tokens", 1), ("balance_window", 1), ("balance_slack", 0),
                      ("unhealthy_after", 1), ("healthy_after", 1), ("retries", 0), ("block_size", 0)):
        if getattr(cfg, name) < low:
            raise ConfigError(f"route: {name} must be >= {low}, got {getattr(cfg, name)}")
    if not (0 <= cfg.port <= 65535):
        raise ConfigError(f"route: port must be 0..65535, got {cfg.port}")
    for medium, w in cfg.tier_weights:
        if not (math.isfinite(w) and w >= 0):
            raise ConfigError(f"route: tier weight of {medium} must be a finite number >= 0, got {w}")


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (ConfigError on a missing or malformed file)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"route: cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "parse error"
        raise ConfigError(f"route: config {path} is not valid YAML: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"route: config {path} must be a mapping at the top level")
    return data


def pair_endpoints(urls: Sequence[str], values: Sequence[str], flag: str) -> dict[str, str]:
    """Pair ``--kv-events``/``--kv-replay`` values with engines: ``URL=ENDPOINT`` names the
    engine; a bare endpoint goes to the engine in the same position. One-line errors."""
    out: dict[str, str] = {}
    bare = [v for v in values if "=" not in v]
    named = [v for v in values if "=" in v]
    if bare and named:
        raise ConfigError(f"route: {flag}: give every value as URL=ENDPOINT or none of them")
    if len(bare) > len(urls):
        raise ConfigError(f"route: {flag}: {len(bare)} endpoints for {len(urls)} engines")
    for url, ep in zip(urls, bare):
        out[url] = ep
    for item in named:
        url, _, ep = item.partition("=")
        if url not in urls:
            raise ConfigError(f"route: {flag}: {url} is not one of the --engine URLs")
        out[url] = ep
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


__all__ = ["EngineSpec", "RouteConfig", "DEFAULT_TIER_WEIGHTS", "DEFAULT_SHARED_MEDIA",
           "load_file", "pair_endpoints", "merge_flags"]

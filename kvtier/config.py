"""Typed configuration helpers: sizes, and dataclasses built from plain dicts at the edge.

Every component has a frozen dataclass config. ``build(cls, mapping)`` turns a dict (from YAML,
JSON or the CLI) into one, rejecting unknown keys with a message that lists the valid ones and
checking each value against the field's type.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Mapping, TypeVar

from kvtier.errors import ConfigError

T = TypeVar("T")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte size such as ``4096``, ``"2GiB"``, ``"2 GiB"``, ``"1.5GB"``, ``"16m"``.

    Decimal units (k, KB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB)
    powers of 1024, following the SI/IEC convention. Raises ConfigError naming ``what``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}: size must not be negative, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a byte size, got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if not match:
        raise ConfigError(f"{what}: cannot read {value!r} as a size (e.g. 4096, 512MiB, 2GiB, 1.5GB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        valid = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ConfigError(f"{what}: unknown unit {unit!r} in {value!r}; valid units: {valid}")
    return int(float(number) * factor)


def parse_bandwidth(value: int | float | str, what: str = "bandwidth") -> float:
    """Parse bytes per second such as ``"10GB/s"`` or ``"1.6 GiB/s"`` (``/s`` optional)."""
    if isinstance(value, str):
        value = value.strip()
        if value.lower().endswith("/s"):
            value = value[:-2]
    return float(parse_size(value, what))


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Size(int):
    """Marker type for config fields that accept a byte size (int or a string like ``2GiB``)."""


def build(cls: type[T], mapping: Mapping[str, Any] | None, where: str = "") -> T:
    """Build the dataclass ``cls`` from ``mapping``, validating keys and value types.

    Unknown keys raise ConfigError listing the valid ones. Fields annotated ``Size`` accept
    size strings. Nested dataclass fields accept dicts. Missing keys take field defaults.
    """
    mapping = dict(mapping or {})
    label = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(
            f"{label}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in mapping.items():
        values[name] = _coerce(hints[name], value, f"{label}.{name}")
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{label}: {exc}") from None


def _coerce(hint: Any, value: Any, what: str) -> Any:
    """Check/convert ``value`` to the annotated type ``hint``; raise ConfigError on mismatch."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, what)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{what}: bad value {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{what}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if hint is Size:
        return parse_size(value, what)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{what}: expected a mapping, got {type(value).__name__}")
        return build(hint, value, what)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{what}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        items = [_coerce(item, v, f"{what}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{what}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{what}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{what}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{what}: expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{what}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{what}: expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{what}: expected a string, got {value!r}")
        return value
    return value


def load_mapping(path: str) -> dict:
    """Read a YAML or JSON file into a dict; ConfigError with the path on any problem."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data

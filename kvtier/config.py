"""Typed configuration helpers: sizes, and dataclasses built from plain dicts at the edge.

Every component has a frozen dataclass config. ``build(cls, mapping)`` turns a dict (from YAML,
JSON or the CLI) into one, rejecting unknown keys with a message that lists the valid ones and
checking each value against the field's type and range. A field type with a classmethod
``from_config_value(value, where)`` parses its own values (so a layer above, e.g. the tier
registry, can type a field without this module importing it).

Ranges are declared on the field (``ranged(default, ge=1)``) and checked by ``validate`` (which
``build`` calls, and components call on configs built by hand): one ``ConfigError`` line naming
the key and the valid range. A config class may add checks across fields in a method
``check(self, where: str) -> None`` that ``validate`` calls after the ranges.
"""

from __future__ import annotations

import dataclasses
import math
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
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{what}: expected a finite byte size, got {value!r}")
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


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: ``lo``/``hi`` bounds (None: unbounded), each
    inclusive unless its ``*_open`` flag is set. NaN is never in a range."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return False
        return True

    def __str__(self) -> str:
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{left}{lo}, {hi}{right}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def ranged(default: Any = dataclasses.MISSING, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field whose value must lie in the given bounds (checked by ``validate``).

    ``ge``/``gt``: lower bound, inclusive/exclusive; ``le``/``lt``: upper bound. Infinite and
    NaN values are outside every range that has a finite bound on that side.
    """
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("give at most one lower bound (ge/gt) and one upper bound (le/lt)")
    rng = Range(lo=gt if gt is not None else ge, hi=lt if lt is not None else le,
                lo_open=gt is not None, hi_open=lt is not None)
    return dataclasses.field(default=default, metadata={"range": rng})


def range_of(cls_or_obj: Any, name: str) -> Range | None:
    """The declared range of field ``name`` of a config class or instance, or None."""
    for f in dataclasses.fields(cls_or_obj):
        if f.name == name:
            return f.metadata.get("range")
    return None


def out_of_range(what: str, value: Any, valid: Range | str) -> ConfigError:
    """The one-line error for a value outside its valid range."""
    return ConfigError(f"{what}: must be in {valid}, got {value!r}")


def validate(config: Any, where: str = "") -> None:
    """Check every ranged field of the dataclass ``config`` (None values pass), then its own
    cross-field ``check(where)`` if it has one; ConfigError naming the key and the valid range."""
    label = where or type(config).__name__
    for f in dataclasses.fields(config):
        rng = f.metadata.get("range")
        if rng is None:
            continue
        value = getattr(config, f.name)
        if value is None or isinstance(value, bool):
            continue
        if value not in rng:
            raise out_of_range(f"{label}.{f.name}", value, rng)
    check = getattr(config, "check", None)
    if callable(check):
        check(label)


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
        config = cls(**values)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{label}: {exc}") from None
    validate(config, label)
    return config


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
    if isinstance(hint, type) and hasattr(hint, "from_config_value"):
        # a type that parses itself (e.g. a tier spec, checked through its registry)
        return hint.from_config_value(value, what)
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
            number = float(value)
        except ValueError:
            raise ConfigError(f"{what}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{what}: expected a finite number, got {value!r}")
        return number
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

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
import functools
import math
import numbers
import os
import re
import reprlib
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


MAX_SIZE = 2**60
"""The largest byte size a config may name (1 EiB): a larger one is refused as absurd."""


def parse_size(value: int | float | str, what: str = "size") -> int:
    """Parse a byte size such as ``4096``, ``"2GiB"``, ``"2 GiB"``, ``"1.5GB"``, ``"16m"``.

    Decimal units (k, KB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB)
    powers of 1024, following the SI/IEC convention. The result lies in ``[0, MAX_SIZE]``
    (1 EiB); anything else (negative, NaN, infinite, larger, not a size) raises one ConfigError
    line naming ``what``, with the value shown at most ~80 characters long.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte size, got {show(value)}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{what}: expected a finite byte size, got {show(value)}")
        if value < 0:
            raise ConfigError(f"{what}: size must not be negative, got {show(value)}")
        return _bounded_size(value, what, value)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a byte size, got {type(value).__name__}")
    match = _SIZE_RE.match(value) if len(value) <= _MAX_SIZE_TEXT else None
    if not match:
        raise ConfigError(f"{what}: cannot read {show(value)} as a size (e.g. 4096, 512MiB, 2GiB, 1.5GB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        valid = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        raise ConfigError(f"{what}: unknown unit {show(unit)} in {show(value)}; valid units: {valid}")
    whole, _, frac = number.partition(".")
    # exact arithmetic: a float of 1e310 would be inf, and int(inf) an OverflowError
    scaled = int(whole) * factor
    if frac:
        scaled += int(frac) * factor // 10 ** len(frac)
    return _bounded_size(scaled, what, value)


_MAX_SIZE_TEXT = 1000  # characters: far beyond any real size, well under int()'s 4,300-digit limit


def _bounded_size(number: int | float, what: str, shown: Any) -> int:
    """``int(number)`` when it is at most MAX_SIZE, else ConfigError naming the bound."""
    if number > MAX_SIZE:
        raise ConfigError(f"{what}: {show(shown)} is larger than the largest size kvtier accepts "
                          f"({MAX_SIZE} bytes = 1 EiB)")
    return int(number)


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


SHOW_CHARS = 80
"""The most characters of a value an error message shows."""

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict, _SHOW.maxset = 2, 4, 4, 4, 4
_SHOW.maxstring, _SHOW.maxother = SHOW_CHARS, SHOW_CHARS
_SECRET_NAME = re.compile(r"(?:^|_)(?:token|secret|password|passwd|auth_key|api_key|credentials?)(?:_|$)", re.I)


def show(value: Any) -> str:
    """A repr of ``value`` for an error message: at most ``SHOW_CHARS`` characters, nested
    containers cut after a few items and two levels, so a huge or deeply shared value (a YAML
    alias bomb) costs nothing to show. Integers too long to print are described by their size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = _SHOW.repr(value)
    except Exception:  # a value whose repr fails still gets a one-line message
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 3] + "..."


def is_secret(field: dataclasses.Field) -> bool:
    """Whether a config field holds a secret: its metadata says ``secret=True`` or a ``_``-separated
    part of its name is token, secret, password, passwd, auth_key, api_key or credential(s)
    (``server_token``, ``secret_key``; not ``chunk_tokens``). Error messages about a secret field
    name the field and what is wrong, never its value."""
    return bool(field.metadata.get("secret")) or bool(_SECRET_NAME.search(field.name))


def secret(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field holding a secret (not in repr, never shown in an error message)."""
    return dataclasses.field(default=default, repr=False, metadata={"secret": True}, **kwargs)


def _val(value: Any, hidden: bool) -> str:
    """``show(value)``, or for a secret only its type: ``<hidden int>``."""
    return f"<hidden {type(value).__name__}>" if hidden else show(value)


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


def out_of_range(what: str, value: Any, valid: Range | str, hidden: bool = False) -> ConfigError:
    """The one-line error for a value outside its valid range (a secret's value is not shown)."""
    return ConfigError(f"{what}: must be in {valid}, got {_val(value, hidden)}")


def validate(config: Any, where: str = "") -> None:
    """Check every ranged field of the dataclass ``config`` and every field declared a
    ``Literal`` (None values pass), then its own cross-field ``check(where)`` if it has one;
    ConfigError naming the key and the valid range or choices. So a config built by hand (its
    ``__post_init__`` calling ``validate``) is held to what ``build`` checks: a ranged field
    holds a real number, never a bool or a string."""
    label = where or type(config).__name__
    choices = _literal_fields(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        if "range" in f.metadata and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise ConfigError(f"{label}.{f.name}: expected a number, got {_val(value, is_secret(f))}")
        if isinstance(value, bool):
            continue
        if f.name in choices and value not in choices[f.name]:
            raise ConfigError(f"{label}.{f.name}: must be one of {', '.join(map(str, choices[f.name]))}, "
                              f"got {_val(value, is_secret(f))}")
        rng = f.metadata.get("range")
        if rng is not None and value not in rng:
            raise out_of_range(f"{label}.{f.name}", value, rng, is_secret(f))
    check = getattr(config, "check", None)
    if callable(check):
        check(label)


@functools.lru_cache(maxsize=None)
def _literal_fields(cls: type) -> dict[str, tuple]:
    """Field name -> its choices, for the fields of ``cls`` annotated ``Literal[...]`` (or
    ``Literal[...] | None``)."""
    out = {}
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # annotations that cannot be resolved here: no Literal to check
        return out
    for name, hint in hints.items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        if literals:
            out[name] = tuple(c for lit in literals for c in typing.get_args(lit))
    return out


def build(cls: type[T], mapping: Mapping[str, Any] | None, where: str = "") -> T:
    """Build the dataclass ``cls`` from ``mapping``, validating keys and value types.

    Unknown keys raise ConfigError listing the valid ones. Fields annotated ``Size`` accept
    size strings, ``Literal[...]`` fields one of their choices. Nested dataclass fields accept
    dicts. Missing keys take field defaults. Every error is one line: ``KEY: what is wrong, got
    VALUE`` with VALUE shown at most ``SHOW_CHARS`` long, and never shown for a secret field
    (``is_secret``).
    """
    if not isinstance(mapping, (Mapping, type(None))):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(mapping).__name__}")
    mapping = dict(mapping or {})
    label = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted((k for k in mapping if k not in fields), key=str)
    if unknown:
        raise ConfigError(
            f"{label}: unknown key {show(unknown[0])}; valid keys: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in mapping.items():
        values[name] = _coerce(hints[name], value, f"{label}.{name}", is_secret(fields[name]))
    try:
        config = cls(**values)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{label}: {exc}") from exc
    validate(config, label)
    return config


def _coerce(hint: Any, value: Any, what: str, hidden: bool = False) -> Any:
    """Check/convert ``value`` to the annotated type ``hint``; raise ConfigError on mismatch
    (``hidden``: the value is a secret, and no message shows it)."""
    origin = typing.get_origin(hint)
    got = _val(value, hidden)
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
                return _coerce(arg, value, what, hidden)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{what}: bad value {got}")
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{what}: must be one of {', '.join(map(str, choices))}, got {got}")
        return value
    if hint is Size:
        return parse_size(value, what) if not hidden else _coerce_hidden(parse_size, value, what)
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
        items = [_coerce(item, v, f"{what}[{i}]", hidden) for i, v in enumerate(value)]
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
        raise ConfigError(f"{what}: expected true or false, got {got}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{what}: expected an integer, got {got}")
        try:
            return int(value)
        except ValueError as exc:  # not a number, or more digits than int() reads
            raise ConfigError(f"{what}: expected an integer, got {got}") from exc
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{what}: expected a number, got {got}")
        try:
            number = float(value)
        except (ValueError, OverflowError) as exc:  # an int too large for a float overflows
            raise ConfigError(f"{what}: expected a finite number, got {got}") from exc
        if not math.isfinite(number):
            raise ConfigError(f"{what}: expected a finite number, got {got}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{what}: expected a string, got {got}")
        return value
    return value


def _coerce_hidden(parse: Any, value: Any, what: str) -> Any:
    """``parse(value, what)`` for a secret: its error says the field is wrong, not the value."""
    try:
        return parse(value, what)
    except ConfigError:
        raise ConfigError(f"{what}: not a valid value (a secret: the value is not shown)") from None


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file ``load_mapping`` reads (1 MiB)."""
MAX_CONFIG_NODES = 20_000
"""The most YAML values (scalars, lists, mappings, each alias counted as the whole value it
names) a config may hold: real configs have under 1,000, and composing 20,000 costs well
under a second."""
MAX_CONFIG_DEPTH = 64
"""The deepest nesting of mappings and lists a config may have."""
MAX_INT_CHARS = 1000
"""The longest integer a config may write (YAML 1.1's base-60 ``1:59:59`` form costs time
quadratic in its length: 1 MiB of it ran for minutes)."""


def load_mapping(path: str, where: str | None = None) -> dict:
    """Read a YAML or JSON file into a dict; ConfigError (one line, the path or ``where``) on
    any problem.

    Hostile files are refused before they cost memory or time: larger than MAX_CONFIG_BYTES,
    nested deeper than MAX_CONFIG_DEPTH, more than MAX_CONFIG_NODES nodes once aliases are
    expanded (a "billion laughs" file of nested aliases), an alias that refers to itself, or
    a number too long to read.
    """
    label = where or path
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{where or 'config_file'}: expected a file path, got {show(path)}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read config file ({exc.strerror or exc})") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{label}: config file is larger than {MAX_CONFIG_BYTES} bytes (1 MiB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: config file is not UTF-8 text (byte {exc.start})") from exc
    data = parse_yaml(text, label)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse_yaml(text: str, where: str) -> Any:
    """The value of one YAML/JSON document, under the bounds of ``load_mapping`` (whose
    docstring lists them); ConfigError (one line naming ``where``) otherwise."""
    import yaml

    loader = _bounded_loader_class()(text)
    loader.where = where
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        first = (str(exc).splitlines() or ["parse error"])[0]
        # from None: the parser's own message quotes the file's text, which may hold a secret
        raise ConfigError(f"{where}: not valid YAML/JSON ({show_text(first)})") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of more digits than int() reads
        raise ConfigError(f"{where}: a value cannot be read ({show_text(str(exc))})") from exc
    except RecursionError as exc:
        raise ConfigError(f"{where}: nested too deeply (at most {MAX_CONFIG_DEPTH} levels)") from exc
    finally:
        loader.dispose()


def show_text(text: str) -> str:
    """``text`` cut to ``SHOW_CHARS`` characters (for messages that quote a library's error)."""
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 3] + "..."


_LOADER: Any = None


def _bounded_loader_class() -> Any:
    """yaml.SafeLoader whose composer refuses nesting deeper than MAX_CONFIG_DEPTH (so the
    recursive composer never runs out of stack). Made once, on first use (yaml imported late)."""
    global _LOADER
    if _LOADER is None:
        import yaml

        class BoundedLoader(yaml.SafeLoader):
            """SafeLoader with bounds on nesting and on the nodes composed (each alias use
            counted once here; ``_check_expanded_size`` then counts what aliases expand to)."""

            where = "config"  # what the errors name (set per load)
            _depth = 0
            _nodes = 0

            def compose_node(self, parent, index):  # noqa: D102 (yaml's hook)
                self._depth += 1
                self._nodes += 1
                try:
                    if self._depth > MAX_CONFIG_DEPTH:
                        raise ConfigError(f"{self.where}: nested deeper than {MAX_CONFIG_DEPTH} levels; refused")
                    if self._nodes > MAX_CONFIG_NODES:
                        raise ConfigError(f"{self.where}: more than {MAX_CONFIG_NODES} values; refused")
                    return super().compose_node(parent, index)
                finally:
                    self._depth -= 1

            def construct_yaml_int(self, node):  # noqa: D102 (yaml's hook)
                if len(node.value) > MAX_INT_CHARS:
                    raise ConfigError(f"{self.where}: an integer written with {len(node.value):,} characters (at "
                                      f"most {MAX_INT_CHARS}); refused")
                return super().construct_yaml_int(node)

        BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
        _LOADER = BoundedLoader
    return _LOADER


def _check_expanded_size(root: Any, where: str) -> None:
    """ConfigError unless the node graph under ``root``, with every alias expanded, has at most
    MAX_CONFIG_NODES nodes and no alias inside its own anchor (a cycle).

    Aliases make the composed graph a DAG whose expanded size can be exponential in the file's
    length; this counts it in time linear in the distinct nodes (each node's expanded size is
    memoized), so the bound is checked before anything walks the expansion.
    """
    import yaml

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        ident = id(node)
        if done:
            on_path.discard(ident)
            total = 1 + sum(size[id(child)] for child in _children(node, yaml))
            if total > MAX_CONFIG_NODES:
                raise ConfigError(f"{where}: more than {MAX_CONFIG_NODES} values once its aliases are expanded "
                                  f"(nested YAML aliases?); refused")
            size[ident] = total
            continue
        if ident in size:
            continue
        if ident in on_path:
            raise ConfigError(f"{where}: a YAML alias refers to a node that contains it (a cycle); refused")
        on_path.add(ident)
        stack.append((node, True))
        for child in _children(node, yaml):
            if id(child) in on_path:
                raise ConfigError(f"{where}: a YAML alias refers to a node that contains it (a cycle); refused")
            if id(child) not in size:
                stack.append((child, False))


def _children(node: Any, yaml: Any) -> list:
    """The child nodes of a composed YAML node (keys and values of a mapping)."""
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []

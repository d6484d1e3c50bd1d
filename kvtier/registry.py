"""One generic registry for every extension point (tiers, policies, loader sources).

Entries are import paths resolved on first use, so a backend's dependencies are only imported
when that backend is asked for; a missing dependency gets a message saying what to install.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    target: str  # "module:attribute"
    install_hint: str


class Registry(Generic[T]):
    """Maps names to classes given as ``"module:Class"`` strings, imported lazily."""

    def __init__(self, kind: str, entries: dict[str, str | tuple[str, str]]):
        self.kind = kind
        self._entries: dict[str, _Entry] = {}
        for name, spec in entries.items():
            target, hint = (spec, "") if isinstance(spec, str) else spec
            self._entries[name] = _Entry(target, hint)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """Return the class registered as ``name``; ConfigError listing valid names otherwise."""
        entry = self._entries.get(name)
        if entry is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}")
        module_name, _, attr = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; {entry.install_hint}" if entry.install_hint else ""
            raise ConfigError(f"{self.kind} {name!r} needs a missing package ({exc.name}){hint}") from exc
        return getattr(module, attr)

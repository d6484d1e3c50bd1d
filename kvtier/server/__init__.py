"""Per-node cache server: one TieredStore shared by every engine on a node.

- ``server.py``: ``CacheServer`` and ``ServeConfig`` (``kvtier serve``), which own the tiers.
- ``client.py``: ``ServerStore``, a ``KVStore`` a vLLM connector uses instead of an in-process
  TieredStore (``UntrustedServer`` when the other end is not a kvtier server it can trust).
- ``protocol.py``: the versioned binary control protocol (payloads travel through shared
  memory, control messages through a unix, or token-protected TCP, socket); no pickle.
- ``metrics.py``: Prometheus exposition over a stats callable (it does not import the server).

Importing this package imports none of them: each name below is loaded on first access, so a
client process does not pay for the server, nor ``protocol`` for either.

Imports: ``kvtier.store``, ``kvtier.tiers``, ``kvtier.buffers``, ``kvtier.keys``,
``kvtier.config``, ``kvtier.errors``; never integrations, route, bench or the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_LAZY = {
    "CacheServer": "kvtier.server.server",
    "ServeConfig": "kvtier.server.server",
    "ServerStore": "kvtier.server.client",
    "UntrustedServer": "kvtier.server.client",
    "ServerRejected": "kvtier.server.protocol",
    "VERSION": "kvtier.server.protocol",
}

__all__ = ["CacheServer", "ServeConfig", "ServerStore", "ServerRejected", "UntrustedServer", "VERSION"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

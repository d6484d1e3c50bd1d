"""Chunking of token ids and prefix-chained chunk keys.

Chunk ``i``'s key is ``sha256(key[i-1] || namespace digest || token ids of chunk i)`` with the
token ids as little-endian uint32. It depends on nothing but its inputs: two processes or two
machines that see the same prefix under the same namespace compute the same keys (unlike
Python's ``hash``, which PYTHONHASHSEED changes per process). A trailing partial chunk has no key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NewType, Sequence

import numpy as np

from kvtier.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
KEY_BYTES = 32
ROOT = ChunkKey(b"\x00" * KEY_BYTES)  # the "previous key" of chunk 0
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class Namespace:
    """Everything that makes the KV bytes of the same tokens differ.

    Same namespace -> entries are shared; any field different -> never a hit.
    """

    model: str
    config_digest: str = ""
    kv_dtype: str = ""
    kv_layout: str = ""
    tp_world_size: int = 1
    tp_rank: int = 0
    lora: str = ""
    cache_salt: str = ""

    def digest(self) -> bytes:
        """A 32-byte digest of all fields (canonical JSON, sorted keys)."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()

    def with_salt(self, cache_salt: str | None) -> "Namespace":
        """The same namespace with a per-request cache salt (``None`` keeps it unsalted)."""
        return replace(self, cache_salt=cache_salt or "")

    def with_lora(self, lora: str | None) -> "Namespace":
        """The same namespace for a LoRA adapter (``None`` is the base model)."""
        return replace(self, lora=lora or "")


def config_digest(config: str | Path | dict) -> str:
    """Hex sha256 of a model's config.json content (canonicalised), or of a dict.

    A directory is taken to contain ``config.json``. ConfigError if it cannot be read.
    """
    if isinstance(config, dict):
        data = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read model config ({exc})") from None
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def num_full_chunks(num_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many complete chunks ``num_tokens`` tokens make."""
    return num_tokens // chunk_tokens


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: Namespace | bytes,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    start: int = 0,
    prev: ChunkKey = ROOT,
) -> list[ChunkKey]:
    """Keys of the full chunks of ``tokens``; the trailing partial chunk is not keyed.

    ``start``/``prev`` resume a chain: keys for chunks ``start, start+1, ...`` given the key of
    chunk ``start-1`` (ROOT when ``start == 0``), so a growing sequence is hashed once.
    """
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    ns = namespace if isinstance(namespace, bytes) else namespace.digest()
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ConfigError("token ids must be in [0, 2**32)")
    data = arr.astype("<u4", copy=False).tobytes()
    width = chunk_tokens * 4
    keys: list[ChunkKey] = []
    for i in range(start, len(arr) // chunk_tokens):
        h = hashlib.sha256(prev)
        h.update(ns)
        h.update(data[i * width : (i + 1) * width])
        prev = ChunkKey(h.digest())
        keys.append(prev)
    return keys

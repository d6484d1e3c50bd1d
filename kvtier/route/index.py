"""Content-keyed prefix index: which engine holds which prefix block, in which medium.

Keys are computed from token ids, never from an engine's block hashes, so no hash seed has to
match: block i's key is ``blake2b-128(key of block i-1 || little-endian uint32 token ids)``,
starting from a root that carries the namespace (LoRA name). Events map engine hashes to these
keys through each ``BlockStored``'s ``token_ids`` and ``parent_block_hash``; the router computes
the same keys from a tokenized prompt (``chunk_keys``).

Contracts
---------
* Bounded: at most ``max_keys`` content keys (LRU; a lookup refreshes a key) and at most
  ``max_keys`` engine hashes remembered per engine (LRU).
* ``apply_stored`` with a parent hash the index never saw (a missed event) adds nothing for that
  event and counts it in ``orphans``; removals of unknown hashes are ignored.
* A block whose event ``block_size`` is a multiple k of the index block size becomes k keys;
  partial blocks and non-multiples are not indexed. Unless configured, the index block size is
  the first full ``BlockStored`` of the engine's own pool (medium GPU); other media's events
  before it are not indexed.
* ``clear_engine`` drops every entry of one engine (``AllBlocksCleared``, an engine leaving).
* Single-threaded: the router calls it from one event loop.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from typing import Hashable, Iterable, Mapping, Sequence

KEY_BYTES = 16
_ROOT_TAG = b"kvtier-route/1"
GPU = "GPU"


def root_key(namespace: str = "") -> bytes:
    """The key the first block of a prefix chains from (namespace: LoRA name or "")."""
    return hashlib.blake2b(_ROOT_TAG + namespace.encode(), digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of one block: hash of its parent's key and its token ids."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("I", tokens).tobytes() if _LITTLE else struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


_LITTLE = array("I", [1]).tobytes() == b"\x01\x00\x00\x00" and array("I").itemsize == 4


def chunk_keys(tokens: Sequence[int], block_size: int, namespace: str = "", parent: bytes | None = None) -> list[bytes]:
    """Keys of every full ``block_size`` block of ``tokens`` (the trailing partial one is left out)."""
    if block_size <= 0:
        return []
    key = root_key(namespace) if parent is None else parent
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = block_key(key, tokens[start:start + block_size])
        out.append(key)
    return out


def normalize_medium(medium: str | None, locality: str | None = None, ownership: str | None = None) -> str:
    """Upper-case medium name; None is the engine's own pool (GPU). A kvtier pool named by
    ``ownership`` is reported by its tier: ``kvtier:redis`` -> ``REDIS``, ``kvtier:server/...`` ->
    ``SERVER``; any other ``STORAGE`` with locality ``REMOTE`` as ``STORAGE_REMOTE``."""
    if isinstance(ownership, str) and ownership.startswith("kvtier:"):
        return ownership[len("kvtier:"):].split("/", 1)[0].upper() or "STORAGE_REMOTE"
    m = (medium or GPU).upper()
    if m == "STORAGE" and (locality or "").upper() == "REMOTE":
        return "STORAGE_REMOTE"
    return m


class PrefixIndex:
    """content key -> {engine: set of media}; plus, per engine, engine hash -> content keys."""

    def __init__(self, max_keys: int = 1_000_000, block_size: int = 0) -> None:
        self.max_keys = max_keys
        self.block_size = block_size
        self._keys: OrderedDict[bytes, dict[str, set[str]]] = OrderedDict()
        self._hashes: dict[str, OrderedDict[Hashable, tuple[bytes, ...]]] = {}
        self.orphans = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    # --- queries ---------------------------------------------------------------------------
    def holders(self, key: bytes) -> Mapping[str, set[str]] | None:
        """Who holds ``key`` (engine -> media), refreshing it in the LRU; None when nobody."""
        entry = self._keys.get(key)
        if entry is not None:
            self._keys.move_to_end(key)
        return entry

    def engines(self) -> set[str]:
        """Engines with at least one remembered hash."""
        return set(self._hashes)

    # --- updates ---------------------------------------------------------------------------
    def apply_stored(self, engine: str, block_hashes: Sequence[Hashable], parent_hash: Hashable | None,
                     token_ids: Sequence[int] | None, block_size: int, medium: str,
                     namespace: str = "") -> int:
        """Record a ``BlockStored``; returns how many content keys it added or refreshed."""
        hashes = self._hashes.setdefault(engine, OrderedDict())
        if not token_ids:  # an offload report of blocks the engine announced before (no tokens)
            return self._add_known(engine, hashes, block_hashes, medium)
        n = len(block_hashes)
        if n == 0 or block_size <= 0 or len(token_ids) != n * block_size:
            return 0  # partial block (or malformed): not indexed
        if self.block_size <= 0:
            if medium != GPU:
                return 0  # the engine's own pool sets the granularity, not a tier's larger chunks
            self.block_size = block_size
        if block_size % self.block_size:
            return 0
        if parent_hash is None:
            parent = root_key(namespace)
        else:
            known = hashes.get(parent_hash)
            if not known:
                self.orphans += 1
                return 0
            parent = known[-1]
        added = 0
        for i, engine_hash in enumerate(block_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            keys = tuple(chunk_keys(tokens, self.block_size, parent=parent))
            parent = keys[-1]
            self._remember(hashes, engine_hash, keys)
            for key in keys:
                self._hold(key, engine, medium)
            added += len(keys)
        return added

    def apply_removed(self, engine: str, block_hashes: Iterable[Hashable], medium: str) -> int:
        """Record a ``BlockRemoved``; returns how many (key, medium) holdings it dropped."""
        hashes = self._hashes.get(engine)
        if hashes is None:
            return 0
        dropped = 0
        for engine_hash in block_hashes:
            for key in hashes.get(engine_hash, ()):
                dropped += self._release(key, engine, medium)
        return dropped

    def clear_engine(self, engine: str) -> int:
        """Drop every holding of ``engine`` and its hash map; returns how many keys it held."""
        self._hashes.pop(engine, None)
        gone = 0
        for key in list(self._keys):
            entry = self._keys[key]
            if entry.pop(engine, None) is not None:
                gone += 1
                if not entry:
                    del self._keys[key]
        return gone

    # --- internals -------------------------------------------------------------------------
    def _add_known(self, engine: str, hashes: OrderedDict, block_hashes: Sequence[Hashable], medium: str) -> int:
        added = 0
        for engine_hash in block_hashes:
            for key in hashes.get(engine_hash, ()):
                self._hold(key, engine, medium)
                added += 1
        return added

    def _remember(self, hashes: OrderedDict, engine_hash: Hashable, keys: tuple[bytes, ...]) -> None:
        hashes[engine_hash] = keys
        hashes.move_to_end(engine_hash)
        while len(hashes) > self.max_keys:
            hashes.popitem(last=False)

    def _hold(self, key: bytes, engine: str, medium: str) -> None:
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = {}
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
                self.evicted += 1
        else:
            self._keys.move_to_end(key)
        entry.setdefault(engine, set()).add(medium)

    def _release(self, key: bytes, engine: str, medium: str) -> int:
        entry = self._keys.get(key)
        if entry is None or medium not in entry.get(engine, ()):
            return 0
        media = entry[engine]
        media.discard(medium)
        if not media:
            del entry[engine]
            if not entry:
                del self._keys[key]
        return 1

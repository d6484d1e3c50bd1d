"""Content-keyed prefix index: which engine holds which prefix block, in which medium.

Keys are computed from token ids, never from an engine's block hashes, so no hash seed has to
match: block i's key is ``blake2b-128(key of block i-1 || little-endian uint32 token ids)``,
starting from a root that carries the namespace (LoRA name). Events map engine hashes to these
keys through each ``BlockStored``'s ``token_ids`` and ``parent_block_hash``; the router computes
the same keys from a tokenized prompt (``chunk_keys``).

Contracts
---------
* Bounded: at most ``max_keys`` content keys (LRU; a lookup refreshes a key) and at most
  ``max_keys`` engine hashes remembered per engine (LRU); per engine at most ``MAX_GROUPS`` KV
  cache groups and ``MAX_MEDIA`` media (events of others are counted in ``ignored``, not
  indexed), so one key's holding is at most engines x ``MAX_MEDIA`` x ``MAX_GROUPS`` entries
  whatever a producer sends. A negative ``group_idx`` is ignored (counted).
* ``window_run`` is linear in the prompt's blocks (each window block of each window group is
  looked up at most once per request), whatever the windows a producer claims.
* ``apply_stored`` with a parent hash the index never saw (a missed event) adds nothing for that
  event and counts it in ``orphans``; removals of unknown hashes are ignored.
* A block whose event ``block_size`` is a multiple k of the index block size becomes k keys;
  partial blocks and non-multiples are not indexed. Unless configured, the index block size is
  the first full ``BlockStored`` of the engine's own pool (medium GPU); other media's events
  before it are not indexed.
* ``clear_engine`` drops every entry of one engine (``AllBlocksCleared``, an engine leaving).
* Single-threaded: the router calls it from one event loop.

KV cache groups (vLLM's hybrid KV cache manager: full attention beside sliding-window layers)
------------------------------------------------------------------------------------------
vLLM publishes each group's blocks as events of their own (``group_idx``, with
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` on ``BlockStored``; kvtier's connector
publishes its tiers' entries the same way). A prefix of ``n`` blocks is loadable by an engine only
when every group can load it at the same token count: every full-attention group holds blocks
``0..n-1`` (those name the prefix), and every sliding-window group of window ``w`` holds the
blocks vLLM keeps to resume at ``n * block_size`` tokens, ``[max(0, n*B - w + 1) // B, n)``
(vLLM's ``SlidingWindowManager``). So:

* a group's role is learned from its ``BlockStored`` events: ``full_attention``,
  ``mla_attention`` and ``sink_full_attention`` *name* the prefix (``holders``: a medium counts
  for an engine once every naming group of that engine holds the key in it); ``sliding_window``
  and ``sliding_window_mla`` with a window are *window* groups (``window_run`` cuts a prefix to
  where every window group holds its window, all in the engine's pool or all in kvtier's
  tiers). An event without a kind counts as naming for ``group_idx`` None or 0 (dense engines
  and producers that predate the kinds) and, for any other group, takes the role the group's
  earlier events gave it;
* events of any other group (chunked local attention, whose chunk size events do not carry;
  Mamba state; a kind this index does not know; a kind-less group it never saw) are ignored and
  counted in ``ignored``: never indexed as something they are not. A removal names its group by
  index only; it drops that group's holdings of the blocks (under any role its stores had).
* roles are learned per engine, from its own events: until an engine's window group has
  published once, that engine counts as dense (vLLM publishes every group's blocks of a prefill
  in one batch, so this lasts no longer than its first batch);
* an engine with window groups and no naming group (a model whose every layer has a sliding
  window: vLLM makes it one ``sliding_window`` group 0) is scored by its windows alone: a prefix
  of ``n`` blocks is loadable where every window group holds its window before block ``n``
  (``naming_free``, ``window_hit``), as vLLM's ``SlidingWindowManager`` finds its hit;
* engine hashes are shared by all groups (vLLM hashes a block by content), so one map per engine
  turns any group's hashes into content keys. A window group's ``BlockStored`` may name fewer
  blocks than its tokens cover (vLLM skips the null blocks before the window): its hashes are the
  trailing blocks of the range.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence

KEY_BYTES = 16
_ROOT_TAG = b"kvtier-route/1"
GPU = "GPU"

#: ``kv_cache_spec_kind`` values (vLLM's ``KVCacheSpecKind``) whose blocks name a prefix
NAMING_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
#: kinds that hold only a window of ``kv_cache_spec_sliding_window`` tokens before the boundary
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
NAME = "name"
WINDOW = "window"
IGNORE = "ignore"
#: KV cache groups remembered per engine (vLLM's hybrid models have a handful); others ignored
MAX_GROUPS = 256
#: distinct media indexed per engine (vLLM's and kvtier's are a few); others ignored
MAX_MEDIA = 32


@dataclass(frozen=True)
class GroupRole:
    """What one KV cache group of an engine counts for: ``NAME`` (its blocks name the prefix),
    ``WINDOW`` (it must hold ``window`` tokens before the boundary) or ``IGNORE`` (not indexed)."""

    role: str
    window: int = 0


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
        # content key -> engine -> medium -> the engine's naming groups holding it there
        self._keys: OrderedDict[bytes, dict[str, dict[str, set[int]]]] = OrderedDict()
        # content key -> (engine, window group) -> media holding it (bounded like ``_keys``)
        self._windows: OrderedDict[bytes, dict[tuple[str, int], set[str]]] = OrderedDict()
        self._hashes: dict[str, OrderedDict[Hashable, tuple[bytes, ...]]] = {}
        self._roles: dict[str, dict[int, GroupRole]] = {}  # engine -> group index -> role
        self._named: dict[str, set[int]] = {}  # engine -> its naming groups (cache of ``_roles``)
        self._media: dict[str, set[str]] = {}  # engine -> media its events named (at most MAX_MEDIA)
        self.orphans = 0
        self.evicted = 0
        self.ignored = 0  # events of groups not indexed (see the module docstring)

    def __len__(self) -> int:
        return len(self._keys)

    # --- queries ---------------------------------------------------------------------------
    def holders(self, key: bytes) -> Mapping[str, set[str]] | None:
        """Who holds ``key`` (engine -> media where every naming group of the engine holds it),
        refreshing it in the LRU; None when nobody."""
        entry = self._keys.get(key)
        if entry is None:
            return None
        self._keys.move_to_end(key)
        out = {}
        for engine, media in entry.items():
            need = self._naming(engine)
            held = {m for m, groups in media.items() if groups >= need}
            if held:
                out[engine] = held
        return out or None

    def engines(self) -> set[str]:
        """Engines with at least one remembered hash."""
        return set(self._hashes)

    def windows(self, engine: str) -> dict[int, int]:
        """``engine``'s window groups: group index -> window (tokens); {} for a dense engine."""
        return {g: r.window for g, r in self._roles.get(engine, {}).items() if r.role == WINDOW}

    def naming_free(self, engine: str) -> bool:
        """Whether ``engine`` has window groups and no group naming the prefix (every layer of
        its model has a sliding window): its prefix is whatever its windows can load."""
        roles = self._roles.get(engine, {})
        return (any(r.role == WINDOW for r in roles.values())
                and not any(r.role == NAME for r in roles.values()))

    def window_run(self, engine: str, keys: Sequence[bytes], run: int, shared_media: frozenset[str] = frozenset(),
                   also: Callable[[int], bool] | None = None) -> int:
        """The largest ``n <= run`` at which every window group of ``engine`` holds its window
        before block ``n`` of ``keys`` (``run``: how many leading ``keys`` the naming groups
        hold), from one source: the engine's own pool (``GPU``, or ``also(i)``: a block just
        routed there), or kvtier's tiers (any other medium of the engine, or one of
        ``shared_media`` held by any engine's group of the same index). A window split between
        the two is not loadable: vLLM resumes from its own pool, kvtier's lookup from its tiers."""
        return self.window_hit(engine, keys, run, shared_media, also)[0]

    def window_hit(self, engine: str, keys: Sequence[bytes], run: int, shared_media: frozenset[str] = frozenset(),
                   also: Callable[[int], bool] | None = None) -> tuple[int, str | None]:
        """``(window_run, source)``: source ``"pool"`` or ``"tiers"`` (where the windows are
        whole), None when ``engine`` has no window group (then ``run`` is returned as is) or
        the run is 0. Linear in ``run``: scanning down from ``run``, a block missing at ``i``
        rules out every ``n`` in ``(i, run]`` at once (their windows all contain ``i``: a
        window's start never decreases with ``n``), and a block found held is never looked at
        again for that group."""
        windows = self.windows(engine)
        if not windows or run <= 0 or self.block_size <= 0:
            return run, None
        run = min(run, len(keys))
        bs = self.block_size
        held: dict[tuple[int, int], tuple[bool, bool]] = {}

        def sources(group: int, i: int) -> tuple[bool, bool]:
            """(in the engine's pool, in kvtier's tiers) for window block ``i`` of ``group``."""
            if (group, i) not in held:
                entry = self._windows.get(keys[i], {})
                own = entry.get((engine, group), set())
                pool = GPU in own or (also is not None and also(i))
                tiers = bool(own - {GPU}) or any(g == group and media & shared_media
                                                  for (_, g), media in entry.items())
                held[(group, i)] = (pool, tiers)
            return held[(group, i)]

        best: tuple[int, str | None] = (0, None)
        for which, name in ((0, "pool"), (1, "tiers")):
            n = run
            verified = {g: run for g in windows}  # blocks [verified[g], n) of group g are held
            while n > 0:
                for g, w in windows.items():
                    lo = max(0, n * bs - w + 1) // bs
                    i = min(verified[g], n) - 1
                    while i >= lo and sources(g, i)[which]:
                        i -= 1
                    if i >= lo:  # block i missing: no n' in (i, n] has its window whole
                        verified[g] = n = i
                        break
                    verified[g] = min(verified[g], lo)
                else:
                    break
            if n > best[0]:
                best = (n, name)
        return best

    def window_media(self, engine: str, group: int, key: bytes, shared_media: frozenset[str] = frozenset()) -> set[str]:
        """Media of kvtier's tiers where ``engine``'s window group ``group`` holds ``key``: its
        own media other than the pool, and ``shared_media`` any engine's group ``group`` holds."""
        entry = self._windows.get(key, {})
        out = set(entry.get((engine, group), set())) - {GPU}
        for (_, g), media in entry.items():
            if g == group:
                out |= media & shared_media
        return out

    # --- updates ---------------------------------------------------------------------------
    def apply_stored(self, engine: str, block_hashes: Sequence[Hashable], parent_hash: Hashable | None,
                     token_ids: Sequence[int] | None, block_size: int, medium: str,
                     namespace: str = "", group: int | None = None, kind: str | None = None,
                     window: int | None = None) -> int:
        """Record a ``BlockStored`` of KV cache group ``group`` (``kind``/``window``: its
        ``kv_cache_spec_kind``/``kv_cache_spec_sliding_window``); returns how many content keys
        it added or refreshed (0 for a group not indexed, counted in ``ignored``)."""
        gid, role = self._role(engine, group, kind, window)
        if role is None or not self._medium_ok(engine, medium):
            self.ignored += 1
            return 0
        hashes = self._hashes.setdefault(engine, OrderedDict())
        if not token_ids:  # an offload report of blocks the engine announced before (no tokens)
            return self._add_known(engine, hashes, block_hashes, medium, gid, role)
        n = len(block_hashes)
        if n == 0 or block_size <= 0 or len(token_ids) % block_size:
            return 0  # partial block (or malformed): not indexed
        m = len(token_ids) // block_size  # blocks the tokens cover; a window group may skip leading ones
        if m < n or (m > n and role.role != WINDOW):
            return 0
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
        for i in range(m):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            keys = tuple(chunk_keys(tokens, self.block_size, parent=parent))
            parent = keys[-1]
            if i < m - n:
                continue  # a block the group does not hold (vLLM's null block before the window)
            self._remember(hashes, block_hashes[i - (m - n)], keys)
            for key in keys:
                self._hold(key, engine, medium, gid, role)
            added += len(keys)
        return added

    def apply_removed(self, engine: str, block_hashes: Iterable[Hashable], medium: str,
                      group: int | None = None) -> int:
        """Record a ``BlockRemoved`` of group ``group``; returns how many (key, medium) holdings
        it dropped (a group not indexed now is counted in ``ignored``). The group's holdings go
        whatever role they were recorded under: a group whose kind changed between events (no
        vLLM engine does that within a run) leaves nothing behind that a later role would count."""
        gid = 0 if group is None else group
        role = self._roles.get(engine, {}).get(gid, GroupRole(NAME) if gid == 0 else None)
        if role is None or role.role == IGNORE or gid < 0:
            self.ignored += 1
        hashes = self._hashes.get(engine)
        if hashes is None or role is None or gid < 0:
            return 0
        dropped = 0
        for engine_hash in block_hashes:
            for key in hashes.get(engine_hash, ()):
                dropped += self._release(key, engine, medium, gid, GroupRole(NAME))
                dropped += self._release(key, engine, medium, gid, GroupRole(WINDOW))
        return dropped

    def clear_engine(self, engine: str) -> int:
        """Drop every holding of ``engine``, its hash map and its groups' roles; returns how
        many (naming) keys it held."""
        self._hashes.pop(engine, None)
        self._roles.pop(engine, None)
        self._named.pop(engine, None)
        self._media.pop(engine, None)
        gone = 0
        for key in list(self._keys):
            entry = self._keys[key]
            if entry.pop(engine, None) is not None:
                gone += 1
                if not entry:
                    del self._keys[key]
        for key in list(self._windows):
            entry = self._windows[key]
            for holder in [h for h in entry if h[0] == engine]:
                del entry[holder]
            if not entry:
                del self._windows[key]
        return gone

    # --- internals -------------------------------------------------------------------------
    def _naming(self, engine: str) -> set[int]:
        """The engine's naming groups ({0} until its events say otherwise)."""
        named = self._named.get(engine)
        if named is None:
            named = self._named[engine] = {g for g, r in self._roles.get(engine, {}).items() if r.role == NAME} or {0}
        return named

    def _medium_ok(self, engine: str, medium: str) -> bool:
        """Whether ``medium`` is one of the (at most ``MAX_MEDIA``) media indexed for ``engine``."""
        media = self._media.setdefault(engine, set())
        if medium in media:
            return True
        if len(media) >= MAX_MEDIA:
            return False
        media.add(medium)
        return True

    def _role(self, engine: str, group: int | None, kind: str | None,
              window: int | None) -> tuple[int, GroupRole | None]:
        """(group index, its role; None: not indexed) for a ``BlockStored``, learning the role
        from the event's kind (see the module docstring)."""
        gid = 0 if group is None else group
        roles = self._roles.setdefault(engine, {})
        if gid < 0 or (gid not in roles and len(roles) >= MAX_GROUPS):
            return gid, None  # not a group vLLM has, or one past the bound: not indexed
        if kind is None:
            role = roles.get(gid)
            if role is None and gid == 0:
                role = GroupRole(NAME)
        elif kind in NAMING_KINDS:
            role = GroupRole(NAME)
        elif kind in WINDOW_KINDS and type(window) is int and window > 0:
            role = GroupRole(WINDOW, window)
        else:
            role = GroupRole(IGNORE)
        if role is not None and roles.get(gid) != role:
            roles[gid] = role
            self._named.pop(engine, None)
        return gid, role if role is not None and role.role != IGNORE else None

    def _add_known(self, engine: str, hashes: OrderedDict, block_hashes: Sequence[Hashable], medium: str,
                   group: int, role: GroupRole) -> int:
        added = 0
        for engine_hash in block_hashes:
            for key in hashes.get(engine_hash, ()):
                self._hold(key, engine, medium, group, role)
                added += 1
        return added

    def _remember(self, hashes: OrderedDict, engine_hash: Hashable, keys: tuple[bytes, ...]) -> None:
        hashes[engine_hash] = keys
        hashes.move_to_end(engine_hash)
        while len(hashes) > self.max_keys:
            hashes.popitem(last=False)

    def _hold(self, key: bytes, engine: str, medium: str, group: int = 0, role: GroupRole = GroupRole(NAME)) -> None:
        if role.role == WINDOW:
            self._touch(self._windows, key).setdefault((engine, group), set()).add(medium)
            return
        self._touch(self._keys, key).setdefault(engine, {}).setdefault(medium, set()).add(group)

    def _touch(self, table: OrderedDict, key: bytes) -> dict:
        """``table[key]`` (a new dict when absent) as the most recent; the least recent keys past
        ``max_keys`` are dropped (counted in ``evicted``)."""
        entry = table.get(key)
        if entry is None:
            entry = table[key] = {}
            while len(table) > self.max_keys:
                table.popitem(last=False)
                self.evicted += 1
        else:
            table.move_to_end(key)
        return entry

    def _release(self, key: bytes, engine: str, medium: str, group: int = 0,
                 role: GroupRole = GroupRole(NAME)) -> int:
        if role.role == WINDOW:
            wentry = self._windows.get(key)
            media = wentry.get((engine, group)) if wentry is not None else None
            if not media or medium not in media:
                return 0
            media.discard(medium)
            if not media:
                del wentry[(engine, group)]
                if not wentry:
                    del self._windows[key]
            return 1
        entry = self._keys.get(key)
        groups = entry.get(engine, {}).get(medium) if entry is not None else None
        if not groups or group not in groups:
            return 0
        groups.discard(group)
        if not groups:
            media = entry[engine]
            del media[medium]
            if not media:
                del entry[engine]
                if not entry:
                    del self._keys[key]
        return 1

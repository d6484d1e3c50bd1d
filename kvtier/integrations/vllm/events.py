"""KV events for routers: kvtier's chunks as vLLM ``BlockStored``/``BlockRemoved`` events.

A router (vllm-router ``kv_aware``, llm-d's KV cache indexer, ``kvtier route``) builds its index
from the engines' events; it relates blocks to prompts through each event's ``token_ids`` chained
by ``parent_block_hash``, and relates a tier's copy of a block to the engine's own copy through
the block hash. So kvtier publishes each stored chunk exactly as the engine publishes the blocks
it is made of:

* ``block_hashes``: the engine's own hashes of the chunk's blocks (``request.block_hashes``, in
  the type vLLM publishes: 64-bit ints by default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``),
  ``parent_block_hash`` the engine's hash of the block before the chunk. Where the engine keeps
  no hashes (prefix caching off) they are derived from kvtier's chunk key, in the same type;
* ``token_ids``: every token of the chunk, on every store; ``block_size``: the engine's;
* ``extra_keys``: one entry per block, built by vLLM's own functions (LoRA name, multimodal
  ``(identifier, offset)``, cache salt), ``lora_name``/``lora_id`` as vLLM sets them;
* ``medium``/``locality``/``ownership`` in vLLM's vocabulary: kvtier's RAM tier is ``CPU``
  ``LOCAL``; its disk tier ``STORAGE`` ``LOCAL``; a tier every engine can load (fs, Redis, S3)
  ``STORAGE`` ``REMOTE`` with ``ownership`` ``kvtier:<tier>`` naming the shared pool; with a
  per-node cache server (a pool every engine of the node loads) every medium is ``REMOTE`` with
  ``ownership`` ``kvtier:server/<medium>`` (RAM ``CPU``, anything else ``STORAGE``). Routers
  require exactly this pairing: vllm-router's ``kv_aware`` admits an event whose ``locality``
  is ``LOCAL`` only without ``ownership`` and ``REMOTE`` only with one, and drops the rest.

KV cache groups (vLLM's hybrid KV cache manager): kvtier stores the groups of a chunk that share a
storage rule as one entry (a pack, keyed by its first group: ``kvtier.keys.group_key``), and
publishes each member group's part as vLLM's block pool publishes that group's blocks (one store
event of a pack's entry, one vLLM event per member group): the same block hashes, parent and
tokens for every group (vLLM hashes a block by content, not by group), ``group_idx`` the group's
index, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` as vLLM's
``KVCacheManager.take_events`` annotates them (``full_attention``, ``mla_attention``,
``sliding_window`` with its window, ...); ``BlockRemoved`` carries ``group_idx`` too. A window
group publishes only the chunks kvtier keeps of it (its window before the prompt's last chunk
boundary, and later chunks), so a router learns exactly what each group can load. Within one batch
the full-attention groups' events come first (the worker writes full packs first, and a window
chunk's parent is named by the full group's event of the chunk before it): a consumer that chains
by parent hash never sees a window event before the block it chains from.

What each chunk needs is remembered when its save or load is planned (``ChunkEvents.record``), in
a bounded LRU; an event for a chunk no longer remembered is not published (counted in
``dropped``), since a store event without its tokens would be rejected by routers anyway.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from kvtier.integrations.vllm.groups import FULL, GroupSpec, packs, with_packs
from kvtier.keys import group_key

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: chunks whose event fields are remembered (LRU); ~0.6 KB each for 128-token chunks
MAX_CHUNKS = 32768


@functools.cache
def _builtin_media() -> dict[str, tuple[str, str]]:
    """kvtier medium -> (vLLM medium, locality), as each built-in tier class declares them."""
    from kvtier.tiers.registry import builtin_tier_classes

    return _declared(builtin_tier_classes().values())


def _declared(classes: Iterable[type]) -> dict[str, tuple[str, str]]:
    """kvtier medium -> (``kv_event_medium``, ``locality``) of each of the tier classes."""
    return {cls.medium.upper(): (cls.kv_event_medium, cls.locality) for cls in classes}


@dataclass(frozen=True)
class ChunkInfo:
    """What a router needs to place one chunk: engine-typed block hashes, tokens, extra keys."""

    block_hashes: tuple
    parent: Any
    token_ids: array
    extra_keys: list | None
    lora_name: str | None
    lora_id: int | None


def event_medium(medium: str, server: bool = False,
                 media: Mapping[str, tuple[str, str]] | None = None) -> tuple[str, str, str | None]:
    """(medium, locality, ownership) of a kvtier tier's events, in vLLM's vocabulary (see the
    module docstring), from what the tier class of kvtier medium ``medium`` declares
    (``Tier.kv_event_medium``, ``Tier.locality``): ``media`` (kvtier medium -> those two, as
    ``ChunkEvents`` gathers them), by default the built-in tiers'. A medium no class declares is
    a shared ``STORAGE`` pool."""
    medium = medium.upper()
    declared = _builtin_media() if media is None else media
    vllm_medium, locality = declared.get(medium, ("STORAGE", "REMOTE"))
    if server:
        return vllm_medium, "REMOTE", f"kvtier:server/{medium.lower()}"
    if locality == "LOCAL":
        return vllm_medium, "LOCAL", None
    return vllm_medium, "REMOTE", f"kvtier:{medium.lower()}"


def derived_block_hashes(key: bytes, blocks: int) -> list:
    """Stand-in block hashes for a chunk whose engine kept none: derived from kvtier's chunk key
    (content, namespace and position), converted as vLLM converts its own."""
    return [maybe_convert_block_hash(hashlib.blake2b(key + i.to_bytes(4, "big"), digest_size=32).digest())
            for i in range(blocks)]


class ChunkEvents:
    """Remembers, per chunk key, the fields of its events; turns store events into vLLM events.

    Not thread-safe: the scheduler calls it from its loop only.
    """

    def __init__(self, block_size: int, blocks_per_chunk: int, server: bool = False, max_chunks: int = MAX_CHUNKS,
                 tiers: Iterable[type] = (), groups: Sequence[GroupSpec] = ()):
        """``tiers``: the store's tier classes (a plugin tier's medium and locality are read
        from its class; the built-in ones are known without). ``groups``: vLLM's KV cache
        groups (none: one full-attention group 0, a dense model); a store event names a group's
        entry (``group_key`` of the chunk's key) and is published with that group's fields."""
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.server = server
        self._media = {**_builtin_media(), **_declared(tiers)}
        self.groups = tuple(with_packs(list(groups) or [GroupSpec(0, FULL, (), block_size)]))
        self._packs = packs(list(self.groups))  # first group -> the groups stored in its entries
        self.max_chunks = max_chunks
        # store key of one pack's entry -> (the chunk's fields, the pack's groups); every pack's
        # entry of a chunk is remembered together, so the bound is per chunk
        self._info: OrderedDict[bytes, tuple[ChunkInfo, list[GroupSpec]]] = OrderedDict()
        self.dropped = 0  # store events of chunks no longer remembered (not published)

    def record(self, request: "Request | None", keys: list[bytes], chunk: int, tokens: Iterable[int],
               store_key: bytes | None = None) -> None:
        """Remember chunk ``chunk`` of a request (``keys[chunk]`` its key, ``tokens`` its tokens)
        under ``store_key``: the key the worker's store events name it by (worker rank 0 of
        stage 0's share of it; ``keys[chunk]`` itself by default, as with one worker)."""
        key = keys[chunk] if store_key is None else store_key
        entries = [group_key(key, index) for index in self._packs]
        if all(entry in self._info for entry in entries):
            for entry in entries:
                self._info.move_to_end(entry)
            return
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk * bpc
        engine = getattr(request, "block_hashes", None) or ()
        if len(engine) >= first + bpc:
            hashes = [maybe_convert_block_hash(h) for h in engine[first : first + bpc]]
            parent = maybe_convert_block_hash(engine[first - 1]) if first else None
        else:
            hashes = derived_block_hashes(keys[chunk], bpc)
            parent = derived_block_hashes(keys[chunk - 1], bpc)[-1] if chunk else None
        extra = None
        if request is not None:
            per_block, mm_idx = [], 0
            for b in range(first, first + bpc):
                keys_b, mm_idx = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm_idx)
                per_block.append(keys_b)
            extra = to_event_extra_keys(per_block) if any(k is not None for k in per_block) else None
        lora = getattr(request, "lora_request", None)
        info = ChunkInfo(tuple(hashes), parent, array("I", tokens), extra,
                         lora.lora_name if lora else None, lora.adapter_id if lora else None)
        for entry, members in zip(entries, self._packs.values()):
            self._info[entry] = (info, members)
            self._info.move_to_end(entry)
        while len(self._info) > self.max_chunks * len(self._packs):
            self._info.popitem(last=False)

    def events(self, store_events: Iterable[tuple[str, bytes, str]]) -> list[KVCacheEvent]:
        """vLLM events for kvtier store events ``(kind, key, medium)``: in order, except that
        the full-attention groups' events come before the window groups' (each group's own
        events keep their order)."""
        full: list[KVCacheEvent] = []
        window: list[KVCacheEvent] = []
        for kind, key, medium in store_events:
            known = self._info.get(key)
            if known is None:
                self.dropped += 1
                continue
            info, members = known
            med, locality, ownership = event_medium(medium, self.server, self._media)
            for group in members:
                if kind == "stored":
                    event = BlockStored(block_hashes=list(info.block_hashes), parent_block_hash=info.parent,
                                        token_ids=info.token_ids.tolist(), block_size=self.block_size,
                                        lora_id=info.lora_id, medium=med, lora_name=info.lora_name,
                                        extra_keys=info.extra_keys, group_idx=group.index,
                                        kv_cache_spec_kind=group.kv_event_kind,
                                        kv_cache_spec_sliding_window=group.event_window, locality=locality,
                                        ownership=ownership)
                else:
                    event = BlockRemoved(block_hashes=list(info.block_hashes), medium=med, group_idx=group.index,
                                         locality=locality, ownership=ownership)
                (full if group.kind == FULL else window).append(event)
        return full + window

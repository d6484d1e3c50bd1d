"""vLLM's KV cache groups as kvtier stores them (plain data, no vLLM objects at run time).

vLLM's hybrid KV cache manager ("HMA") gives each attention type its own KV cache group: its
layers, its spec and its own block table per request (vLLM splits a kind's layers into groups of
equal size, so a Gemma-3-like model of 5 local : 1 global layers has five window groups beside
one full group). kvtier stores the groups of a chunk that follow the same storage rule (the same
kind, block size, window and replication: a *pack*, ``GroupSpec.pack``) together, as one entry
keyed by the pack's first group (``kvtier.keys.group_key``): the members' bytes back to back in
group order, each copied with that group's layers and block ids. One entry per pack and chunk
instead of one per group: the five window groups above cost one store operation per chunk, not
five (a store operation's fixed cost, not its bytes, dominates a RAM-tier re-read of small pages).
The rules:

- ``full`` groups (full attention, MLA): every chunk of the prefix, as for a dense model;
- ``window`` groups (sliding window, chunked local attention): only the chunks vLLM needs to
  resume at a chunk boundary. At ``T`` computed tokens vLLM keeps a window group's blocks from
  ``skipped(T) // block_size`` on (null blocks before: ``SlidingWindowManager`` /
  ``ChunkedLocalAttentionManager.get_num_skipped_tokens``), so resuming at ``T`` needs exactly
  the group's blocks ``[first_block(T), T // block_size)``.

- ``state`` groups (recurrent state: Mamba, Mamba2, gated delta net; vLLM's ``MambaSpec``): one
  state per sequence, not per token. With prefix caching vLLM runs them in ``mamba_cache_mode``
  "align": the state after each block boundary is kept in that block (``MambaManager``), and the
  scheduler hands a connector the exact block holding each committed boundary state
  (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: ``(group, block id,
  boundary tokens)``; the block table cannot be read positionally, its other states are null or
  scratch). kvtier stores the state at a chunk boundary as the group's entry of the chunk ending
  there, and resuming at ``T`` tokens needs only that one entry, loaded into the block at index
  ``T // block_size - 1`` (vLLM's ``get_num_skipped_tokens`` for Mamba is ``T - 1``). A state
  group needs one block per chunk (``chunk_tokens`` equal to the block size, as vLLM's own
  offloading has for Mamba).

Recurrent-state groups are each a pack of their own (their states are offered per group).

A prefix hit of ``n`` chunks needs every full group's chunks ``0..n-1``, every window group's
chunks that hold a block in ``[first_block(n * chunk), n * blocks_per_chunk)`` and every state
group's chunk ``n - 1``; the hit is the largest such ``n`` (the same token count for every group).

Groups kvtier cannot store are refused at engine start (``groups_of`` raises ConfigError naming
the model type and the reason): recurrent state without prefix caching (``mamba_cache_mode``
"none": vLLM keeps one running state per request and no state at any boundary), recurrent state
with speculative blocks, and any spec kvtier does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvtier.errors import ConfigError

FULL = "full"
WINDOW = "window"
STATE = "state"  # recurrent state (MambaSpec in mamba_cache_mode "align")
# a group's ``kv_cache_spec_kind`` (vLLM's ``KVCacheSpecKind`` values) when built without a vLLM spec
_EVENT_KIND = {FULL: "full_attention", WINDOW: "sliding_window", STATE: "mamba"}


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: ``kind`` (FULL, WINDOW or STATE), its layers, its block size and, for a
    window group, ``sliding_window`` (tokens; 0 if none), ``extra_retained`` and
    ``attention_chunk`` (chunked local attention's chunk size; 0 if none). ``describe`` is the
    group's spec as it enters the key namespace."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int = 0
    extra_retained: int = 0
    attention_chunk: int = 0
    describe: str = ""
    replicated: bool = False  # every TP rank holds the same bytes (MLA's latent)
    # how vLLM's own KV events name the group (``BlockStored.kv_cache_spec_kind`` /
    # ``kv_cache_spec_sliding_window``, vLLM's ``get_kv_cache_spec_kind`` and
    # ``get_kv_cache_spec_sliding_window``); "" for a group built without a vLLM spec
    event_kind: str = ""
    event_window: int | None = None
    pack: int = -1  # the first group of this group's pack (its entries' key); -1: itself

    @property
    def pack_index(self) -> int:
        """The group whose key names this group's entries: the first group of its pack."""
        return self.index if self.pack < 0 else self.pack

    def storage_rule(self) -> tuple:
        """What decides which chunks of this group are stored and loaded, and where: groups
        with equal rules (never state groups) are stored together, as one pack."""
        if self.kind == STATE:
            return (STATE, self.index)
        return (self.kind, self.block_size, self.sliding_window, self.extra_retained, self.attention_chunk,
                self.replicated)

    @property
    def kv_event_kind(self) -> str:
        """``kv_cache_spec_kind`` of the group's KV events: vLLM's own value, else by the group's
        kind (``full_attention`` for a full group, a dense model; ``sliding_window``; ``mamba``)."""
        return self.event_kind or _EVENT_KIND[self.kind]

    def skipped_tokens(self, computed: int) -> int:
        """Tokens before ``computed`` that vLLM no longer keeps for this group (its null
        blocks): vLLM's ``get_num_skipped_tokens`` for the group's attention type."""
        if self.kind == STATE:  # MambaManager: only the state after the last computed token
            return max(0, computed - 1)
        if self.sliding_window:
            return max(0, computed - self.sliding_window + 1 - self.extra_retained)
        if self.attention_chunk:
            return computed // self.attention_chunk * self.attention_chunk
        return 0

    def first_block(self, computed: int) -> int:
        """The first block index vLLM keeps (a real block, not null) at ``computed`` tokens."""
        return self.skipped_tokens(computed) // self.block_size


def with_packs(groups: list[GroupSpec]) -> list[GroupSpec]:
    """``groups`` with each one's ``pack`` set: the first group of equal ``storage_rule``."""
    first: dict[tuple, int] = {}
    out = []
    for group in groups:
        leader = first.setdefault(group.storage_rule(), group.index)
        out.append(replace(group, pack=leader))
    return out


def packs(groups: list[GroupSpec]) -> dict[int, list[GroupSpec]]:
    """The packs of ``groups``: first group's index -> its members in group order."""
    out: dict[int, list[GroupSpec]] = {}
    for group in groups:
        out.setdefault(group.pack_index, []).append(group)
    return out


def window_chunks(group: GroupSpec, boundary_chunks: int, blocks_per_chunk: int) -> range:
    """The chunks of ``group`` needed to resume at ``boundary_chunks`` whole chunks: all of
    them for a full group, the ones holding a block vLLM keeps for a window group (for a state
    group: the last one, whose end holds the state)."""
    if group.kind == FULL:
        return range(0, boundary_chunks)
    first = group.first_block(boundary_chunks * blocks_per_chunk * group.block_size)
    return range(min(first // blocks_per_chunk, boundary_chunks), boundary_chunks)


def groups_of(kv_cache_config: Any, model_type: str = "") -> list[GroupSpec]:
    """kvtier's view of ``kv_cache_config.kv_cache_groups`` (in vLLM's order); [] without a
    config. ConfigError (one line naming the model type and the reason) for a group kvtier
    cannot store, such as recurrent state."""
    if kv_cache_config is None:
        return []
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = get_kv_cache_spec_sliding_window(spec)
        event = dict(event_kind=str(get_kv_cache_spec_kind(spec).value),
                     event_window=int(window) if window is not None else None)
        if isinstance(spec, UniformTypeKVCacheSpecs):  # one attention type, per-layer specs
            spec = next(iter(spec.kv_cache_specs.values()))
        name = type(spec).__name__
        common = dict(index=i, layer_names=tuple(group.layer_names), block_size=int(spec.block_size),
                      describe=_describe(i, spec, group.layer_names), **event)
        if isinstance(spec, SlidingWindowSpec) and type(spec) is SlidingWindowSpec:
            out.append(GroupSpec(kind=WINDOW, sliding_window=int(spec.sliding_window),
                                 extra_retained=int(spec.extra_retained_tokens), **common))
        elif type(spec) is ChunkedLocalAttentionSpec:
            out.append(GroupSpec(kind=WINDOW, attention_chunk=int(spec.attention_chunk_size), **common))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            out.append(GroupSpec(kind=FULL, replicated=isinstance(spec, MLAAttentionSpec), **common))
        elif isinstance(spec, MambaSpec) and (reason := _state_refusal(spec)) is None:
            out.append(GroupSpec(kind=STATE, **common))
        else:
            if not isinstance(spec, MambaSpec):
                reason = "a KV cache type kvtier does not store"
            raise ConfigError(
                f"kvtier cannot serve model type {model_type or '?'}: KV cache group {i} is {name}, {reason}; "
                f"supported: full attention, MLA, sliding window, chunked local attention, recurrent state in "
                f"mamba_cache_mode align (run this model "
                f"without the kvtier connector)")
    return with_packs(out)


def namespace_groups(groups: list[GroupSpec]) -> str:
    """The groups' specs for the key namespace: "" for one plain full-attention group (a dense
    model: its keys are unchanged), else every group's description and its pack (an entry's
    layout: which groups' bytes it holds)."""
    if len(groups) == 1 and groups[0].kind == FULL and not groups[0].replicated:
        return ""
    return ";".join(f"{g.describe}:pack={g.pack_index}" for g in groups)


def _state_refusal(spec: Any) -> str | None:
    """Why kvtier cannot store a ``MambaSpec`` group's state (None: it can)."""
    kind = _state_kind(spec)
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"{kind} recurrent state in mamba_cache_mode {mode!r}: vLLM keeps no state at block boundaries "
                f"to save or restore (start vLLM with --enable-prefix-caching, which sets mamba_cache_mode align)")
    if getattr(spec, "num_speculative_blocks", 0):
        return f"{kind} recurrent state with speculative decoding blocks, which kvtier does not store"
    return None


def _state_kind(spec: Any) -> str:
    """The recurrent kind of a ``MambaSpec`` (Mamba2, gated delta net, ...) in words."""
    mamba_type = getattr(spec, "mamba_type", None)
    name = str(getattr(mamba_type, "name", mamba_type or "")).lower()
    return {"mamba1": "Mamba", "mamba2": "Mamba2", "gdn_attn": "gated delta net", "gdn": "gated delta net",
            "linear": "linear attention", "short_conv": "short conv"}.get(name, name or "Mamba")


def _describe(index: int, spec: Any, layers: list[str]) -> str:
    """A canonical string of what in a group's spec changes its KV bytes or their meaning."""
    fields = [str(index), type(spec).__name__, f"bs{spec.block_size}"]
    for name in ("num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window", "extra_retained_tokens",
                 "attention_chunk_size", "cache_dtype_str", "page_size_padded", "kv_quant_mode",
                 "shapes", "dtypes", "mamba_type", "mamba_cache_mode", "tp_replicated"):
        value = getattr(spec, name, None)
        if value is not None:
            fields.append(f"{name}={value}")
    fields.append("layers=" + ",".join(layers))
    return ":".join(fields)

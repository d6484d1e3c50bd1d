"""KVTierConnector: vLLM's KV connector (V1 API) on kvtier's tiered store.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"tiers": [{"type": "ram", "capacity": "8GiB"}]}}'

Scheduler side (bookkeeping, no data): looks a request's chunk keys up in the store, plans which
chunks to load into which blocks and which newly computed full chunks to save (generated tokens
included: the next turn of a conversation re-reads the answer as its prompt), and hands both
plans to the worker in the step's metadata. Worker side (data): loads whole (layer, block) pages
from the store into the engine's KV tensors before the forward pass, and after it copies the
pages of newly computed chunks into the store's top tier (a memcpy; lower tiers are written in
the background). A chunk that fails to load is reported through
``get_block_ids_with_load_errors`` so vLLM recomputes it: a storage fault costs time, never a
wrong token.

Saves and loads are synchronous within the step, so ``request_finished`` never needs to hold
blocks: a partial prefill, a preemption or a request that finishes early leaves nothing behind.

Keys (``kvtier.keys``): a request's chunk keys chain over its token ids under a namespace of
everything that changes KV bytes: the model (path, revision, config digest, a sampled digest of
its weights or the configured ``weights_id``, quantization, dtype), the KV dtype and layout, TP
and PP sizes (and an explicit PP layer split), the LoRA adapter (name, path, weights digest) and
the cache salt. Each multimodal item's content hash and placeholder span is folded into every
chunk it overlaps, and through the chain into every later chunk; a prompt with an unhashed item
or given as embeddings is not keyed at all. Each worker stores its share of a chunk under its own
key (TP rank, PP stage: ``kvtier.keys.worker_key``).

The worker process owns the TieredStore. The scheduler (another process) keeps a mirror of
what the worker's private tiers hold, fed by the events the worker reports each step
(``build_connector_worker_meta``), and asks persistent or shared tiers (disk, fs, redis, s3)
directly, so entries stored by an earlier engine or by another machine are found at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, check_load_failure_policy
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics, TierDeltas, tier_counters
from kvtier.integrations.vllm.plugin import route_logs_to_vllm
from kvtier.integrations.vllm.pages import ENTRY_FORMAT, PageLayout
from kvtier.keys import ROOT, MMItem, Namespace, chunk_keys, lora_identity, weights_digest, worker_key
from kvtier.store import KVStore, StoreEvent, TieredStore
from kvtier.tiers.base import SchedulerView

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- metadata


@dataclass
class LoadSpec:
    """Load chunks ``first_chunk .. first_chunk+len(keys)-1`` of a request into its blocks."""

    req_id: str
    keys: list[bytes]
    first_chunk: int
    block_ids: list[int]  # the request's whole block table
    skip_blocks: int  # blocks at the start of the first chunk that are already computed


@dataclass
class SaveSpec:
    """Save one full chunk of a request from its blocks."""

    req_id: str
    key: bytes
    parent: bytes | None
    chunk_index: int
    block_ids: list[int]  # the chunk's blocks


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """What the worker does this step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the store's events of this step."""

    events: list[StoreEvent] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVTierWorkerMetadata":
        if isinstance(other, KVTierWorkerMetadata):
            self.events.extend(other.events)
        return self


# ---------------------------------------------------------------------------------- connector


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    keys: list[bytes]  # keys of the full chunks known so far (the prompt's, then generated ones)
    prompt_len: int
    token_ids: Sequence[int]  # the prompt, then the generated tokens (vLLM's growing all_token_ids)
    namespace: bytes = b""
    mm: tuple[MMItem, ...] = ()  # the prompt's multimodal items, folded into the keys
    lora_name: str | None = None  # for the extra keys of published events
    cache_salt: str | None = None
    block_ids: list[int] = field(default_factory=list)
    hit_chunks: int = 0  # chunks found in the store at lookup
    local_tokens: int = 0  # tokens vLLM's own prefix cache had
    load: tuple[int, int, int] | None = None  # (first_chunk, end_chunk, skip_blocks) pending
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or being stored


class KVTierConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a kvtier TieredStore (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        route_logs_to_vllm()  # kvtier's log lines under vLLM's logging configuration
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        warning = check_load_failure_policy(transfer.kv_load_failure_policy, self.config.require_recompute)
        if warning and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning("%s", warning)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = self.config.chunk_tokens or -(-128 // self.block_size) * self.block_size
        if self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"kv_connector_extra_config.chunk_tokens ({self.chunk_tokens}) must be a multiple "
                f"of the engine's block size ({self.block_size})"
            )
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.namespace = _namespace(vllm_config, kv_cache_config, self.chunk_tokens, self.config.weights_id)
        self._lora_ids: dict[tuple[str, str], str] = {}  # (name, path) -> identity, read once
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config else None
        page = getattr(spec, "page_size_bytes", None)
        # scheduler side: a mirror of the worker's tiers plus probes of the persistent ones
        self._requests: dict[str, _Request] = {}
        self._present: dict[bytes, set[str]] = {}  # chunk key -> media holding it (from events)
        self._probes: list = []
        self._server = None  # scheduler side with a cache server: lookups go to the server
        self._chunk_tokens_of: deque = deque(maxlen=4096)  # recent (key, parent, tokens, extra) for events
        self._events: list = []
        # media the worker's store knows only privately: the scheduler mirrors them from events
        self._mirrored = frozenset(spec.medium for spec in self.config.store.tiers
                                   if spec.scheduler_view is SchedulerView.MIRRORED)
        # worker side: the store and the engine's pages
        self.store: KVStore | None = None
        self._layout: PageLayout | None = None
        self._load_pool: ThreadPoolExecutor | None = None
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config else 0
        self._rank = 0
        self._stage = 0  # pipeline stage of this worker
        self._failed_blocks: set[int] = set()
        self._stats = KVTierConnectorStats()
        self._tier_deltas = TierDeltas()  # the in-process store's tier counters, as deltas
        if role == KVConnectorRole.WORKER:
            self._rank, self._stage = _tp_rank(), _pp_stage()
            cfg = self.config.for_rank(self._rank, self.tp_size, self._stage, self.pp_size)
            cfg = cfg.with_page_size(page) if page else cfg
            if self.config.server:  # a per-node cache server owns the tiers
                from kvtier.server.client import ServerStore

                self.store = ServerStore(self.config.server, token=self.config.server_token)
            else:
                self.store = TieredStore.from_config(cfg.store)
            if self._rank == 0 and self._stage == 0:
                self.store.enable_events()
            log.info("kvtier: worker rank %d stage %d store tiers %s", self._rank, self._stage,
                     self.store.tier_names)
        elif self.config.server:
            from kvtier.server.client import ServerStore

            self._server = ServerStore(self.config.server, token=self.config.server_token)
        else:
            # rank 0 of stage 0 speaks for all workers
            self._probes = _make_probes(self.config.for_rank(0, self.tp_size, 0, self.pp_size).store.tiers)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No layer-wise asynchronous work: full CUDA graphs are fine (False).

        vLLM asks this while it builds its config, in the frontend process, before any engine
        process starts, whenever full CUDA graphs are on: the earliest point a connector sees
        its ``kv_connector_extra_config``. The config is validated here, so a bad tier key or
        type fails ``LLM(...)``/``vllm serve`` at once (ConfigError) instead of after the
        weights load. Where vLLM does not ask (eager mode, the CPU backend), the connector's
        constructor rejects it, on the scheduler and on the worker side.
        """
        ConnectorConfig.from_extra_config(extra_config)
        return False

    # ------------------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store holds (block-aligned, < prompt)."""
        state = self._request_state(request)
        max_chunks = (state.prompt_len - 1) // self.chunk_tokens
        keys = [self._rank_key(k, 0, 0) for k in state.keys[:max_chunks]]
        state.hit_chunks = self._lookup(keys)
        state.local_tokens = num_computed_tokens
        hit_tokens = state.hit_chunks * self.chunk_tokens
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the request's newly allocated blocks."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0])
        state.saved_chunks = max(state.saved_chunks, state.hit_chunks)  # those are stored already
        if num_external_tokens <= 0:
            state.load = None
            return
        start = state.local_tokens
        end = start + num_external_tokens
        first_chunk = start // self.chunk_tokens
        skip = (start - first_chunk * self.chunk_tokens) // self.block_size
        state.load = (first_chunk, end // self.chunk_tokens, skip)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves (newly completed full chunks)."""
        meta = KVTierMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan(meta, req_id, state, done)
        return meta

    def _plan(self, meta: KVTierMetadata, req_id: str, state: _Request, tokens_done: int) -> None:
        """Add a pending load and the saves of chunks completed by this step."""
        if state.load is not None:
            first, end, skip = state.load
            meta.loads.append(LoadSpec(req_id, state.keys[first:end], first, state.block_ids, skip))
            state.saved_chunks = max(state.saved_chunks, end)
            state.load = None
        # chunks whose KV this step completes, generated tokens included (a later turn of a
        # conversation re-reads them as its prompt); a token not yet known is never keyed
        full = min(tokens_done, len(state.token_ids)) // self.chunk_tokens
        if full > len(state.keys):
            prev = state.keys[-1] if state.keys else ROOT
            state.keys += chunk_keys(state.token_ids[: full * self.chunk_tokens], state.namespace, self.chunk_tokens,
                                     start=len(state.keys), prev=prev, mm=state.mm)
        bpc = self.blocks_per_chunk
        for c in range(state.saved_chunks, full):
            blocks = state.block_ids[c * bpc : (c + 1) * bpc]
            if len(blocks) < bpc:
                break
            parent = state.keys[c - 1] if c else None
            meta.saves.append(SaveSpec(req_id, state.keys[c], parent, c, blocks))
            lo = c * self.chunk_tokens
            self._chunk_tokens_of.append((state.keys[c], parent, state.token_ids[lo : lo + self.chunk_tokens],
                                          _event_extra_keys(state, c, self.chunk_tokens)))
            state.saved_chunks = c + 1

    def _lookup(self, keys: list[bytes]) -> int:
        """Leading ``keys`` present: in the mirror of the worker's tiers, else in a probed tier."""
        if self._server is not None:  # the server knows every engine's entries
            return self._server.lookup(keys)
        n = 0
        while n < len(keys) and keys[n] in self._present:
            n += 1
        if n == len(keys) or not self._probes:
            return n
        rest = keys[n:]
        found = [False] * len(rest)
        for probe in self._probes:
            try:
                found = [a or b for a, b in zip(found, probe.contains_many(rest))]
            except Exception:  # a probe must not fail the scheduler; the worker will miss anyway
                log.warning("kvtier: lookup in %s failed", type(probe).__name__, exc_info=True)
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def update_connector_output(self, connector_output) -> None:
        """Apply the worker's store events to the mirror (and keep them for ``take_events``)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVTierWorkerMetadata):
            return
        for kind, key, medium in meta.events:
            if medium not in self._mirrored:
                continue  # persistent and shared tiers are asked directly (probes)
            media = self._present.get(key)
            if kind == "stored":
                if media is None:
                    self._present[key] = media = set()
                media.add(medium)
            elif media is not None:
                media.discard(medium)
                if not media:
                    del self._present[key]
        self._events.extend(meta.events)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so its blocks can be freed at once."""
        self._requests.pop(request.request_id, None)
        return False, None

    def take_events(self):
        """BlockStored/BlockRemoved events for chunks entering/leaving kvtier's tiers."""
        tokens = {key: (parent, toks, extra) for key, parent, toks, extra in self._chunk_tokens_of}
        events = []
        pending, self._events = self._events, []
        for kind, key, medium in pending:
            if kind == "stored":
                parent, toks, (lora, extra) = tokens.get(key, (None, [], (None, None)))
                events.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=list(toks),
                                          block_size=self.chunk_tokens, lora_id=None, medium=medium, lora_name=lora,
                                          extra_keys=[extra] if extra else None))
            else:
                events.append(BlockRemoved(block_hashes=[key], medium=medium))
        return events

    def _request_state(self, request: "Request") -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            # all_token_ids grows as tokens are generated. A prompt given (even partly) as
            # embeddings is not keyed at all: its token ids are placeholders, not its content;
            # nor is one with a multimodal item that has no content hash
            mm = mm_items(request)
            keyed = (request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None
                     and mm is not None)
            tokens = request.all_token_ids if keyed else []
            prompt = list(request.prompt_token_ids) if keyed else []
            mm = tuple(mm or ())
            ns = self.namespace.with_lora(self._lora_identity(request)).with_salt(request.cache_salt).digest()
            lora_name = request.lora_request.lora_name if request.lora_request else None
            state = _Request(chunk_keys(prompt, ns, self.chunk_tokens, mm=mm), len(prompt), tokens, ns, mm,
                             lora_name, request.cache_salt)
            self._requests[request.request_id] = state
        return state

    def _lora_identity(self, request: "Request") -> str | None:
        """The request's LoRA adapter identity (name, path, weights digest), None without one.

        The adapter's weights are sampled once per (name, path) in this connector's life, as vLLM
        itself loads an adapter once: files replaced later at the same path are not noticed.
        """
        lora = request.lora_request
        if lora is None:
            return None
        name, path = lora.lora_name, str(lora.lora_path or "")
        ident = self._lora_ids.get((name, path))
        if ident is None:
            ident = self._lora_ids[(name, path)] = lora_identity(name, path, weights_digest(path) if path else "")
        return ident

    def _rank_key(self, key: bytes, rank: int, stage: int | None = None) -> bytes:
        """The key of one worker's share of a chunk: TP rank ``rank`` of pipeline stage ``stage``
        (this worker's stage when None); the chunk key itself with one worker."""
        stage = self._stage if stage is None else stage
        return worker_key(key, rank, self.tp_size, stage, self.pp_size)

    # ------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the engine's per-layer page tensors."""
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        self._layout = PageLayout(kv_caches, num_blocks, self.blocks_per_chunk)
        if self.config.load_threads > 1:
            self._load_pool = ThreadPoolExecutor(self.config.load_threads, thread_name_prefix="kvtier-load")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copy this step's planned chunks into the engine's pages before the forward pass."""
        meta = self._connector_metadata
        if not isinstance(meta, KVTierMetadata) or self._layout is None:
            return
        t0 = time.perf_counter()
        for load in meta.loads:
            self._load(load)
        if meta.loads:
            self._stats.observe("load_seconds", time.perf_counter() - t0)

    def _load(self, load: LoadSpec) -> None:
        """Copy a request's planned chunks into its blocks.

        Chunks in the top tier are copied inline (a memcpy each); the others are read by the
        load threads at the same time, overlapping a lower tier's I/O. If any chunk fails, every
        block from the first failed chunk on is reported for recomputation: a chunk is worth
        nothing without the chunks before it.
        """
        tiers: list[str | None] = [None] * len(load.keys)
        local = self._in_top_tier(load.keys)
        pending = {}
        if self._load_pool is not None:  # start the slow reads first, then copy the local ones
            pending = {i: self._load_pool.submit(self._load_chunk, load, i) for i, near in enumerate(local) if not near}
        for i in range(len(load.keys)):
            if i not in pending:
                tiers[i] = self._load_chunk(load, i)
        for i, future in pending.items():
            tiers[i] = future.result()
        bad = next((i for i, tier in enumerate(tiers) if tier is None), len(tiers))
        for tier in tiers[:bad]:
            self._stats.count_tier(tier, loaded_chunks=1, loaded_bytes=self._layout.chunk_bytes)
        if bad < len(tiers):
            bpc = self.blocks_per_chunk
            first = load.skip_blocks if bad == 0 else 0
            end = (load.first_chunk + len(load.keys)) * bpc
            self._failed_blocks.update(load.block_ids[(load.first_chunk + bad) * bpc + first : end])
            self._stats.count(load_error_chunks=len(tiers) - bad)

    def _in_top_tier(self, keys: list[bytes]) -> list[bool]:
        """Which chunks the store's top tier holds (copied inline; the others go to the pool)."""
        return self.store.in_top_tier([self._rank_key(k, self._rank) for k in keys])

    def _load_chunk(self, load: LoadSpec, i: int) -> str | None:
        """Load the ``i``-th planned chunk into its blocks; the serving tier's name or None."""
        bpc = self.blocks_per_chunk
        c = load.first_chunk + i
        blocks = load.block_ids[c * bpc : (c + 1) * bpc]
        first = load.skip_blocks if i == 0 else 0
        layout = self._layout
        try:
            return self.store.read(self._rank_key(load.keys[i], self._rank), lambda segs: layout.load(segs, blocks, first))
        except ValueError:  # an entry of another size: not ours to trust
            log.warning("kvtier: chunk %d of %s has an unexpected size; recomputing", c, load.req_id)
            return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen once per step in ``wait_for_save``, after every layer is computed."""

    def wait_for_save(self) -> None:
        """Copy the pages of this step's completed chunks into the store's top tier."""
        meta = self._connector_metadata
        if not isinstance(meta, KVTierMetadata) or self._layout is None:
            return
        layout = self._layout
        t0 = time.perf_counter()
        step = layout.gather([save.block_ids for save in meta.saves])  # the step's pages, O(layers) copies
        for i, save in enumerate(meta.saves):
            key = self._rank_key(save.key, self._rank)
            parent = self._rank_key(save.parent, self._rank) if save.parent else None
            ok = self.store.write(key, layout.chunk_bytes, lambda segs, i=i: step.copy_to(i, segs),
                                  parent=parent, chunk_index=save.chunk_index)
            if ok:
                self._stats.count(saved_chunks=1, saved_bytes=layout.chunk_bytes)
            else:
                self._stats.count(save_dropped=1)
        step.release()
        if meta.saves:
            self._stats.observe("save_seconds", time.perf_counter() - t0)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's store events for the scheduler's mirror (rank 0 of stage 0 speaks for all)."""
        if self.store is None or self._rank != 0 or self._stage != 0:
            return None
        events = self.store.take_events()
        return KVTierWorkerMetadata(events) if events else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counters (then reset), with the in-process store's per-tier counters
        since the last call (a cache server reports its own on its /metrics)."""
        if self.store is not None and not self.config.server:
            for tier, deltas in self._tier_deltas.take(tier_counters(self.store.tiers)).items():
                self._stats.count_tier(tier, **deltas)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVTierConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """vLLM rebuilds a worker's stats payload with this (see kvtier.integrations.vllm.metrics)."""
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        """kvtier's metrics on vLLM's ``/metrics`` (names in kvtier.integrations.vllm.metrics)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Close the store (worker) or the probes (scheduler)."""
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=True)
            self._load_pool = None
        if self._layout is not None:
            self._layout.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        for probe in self._probes:
            probe.close()
        self._probes = []
        if self._server is not None:
            self._server.close()
            self._server = None


def mm_items(request: "Request") -> list[MMItem] | None:
    """The request's multimodal items (content hash + placeholder span), [] for a text prompt,
    None when an item carries no hash (such a prompt must not be keyed).

    The hash is vLLM's ``identifier`` (the item's content hash, prefixed by the LoRA adapter
    when one applies), else its ``mm_hash``: the same hash vLLM's own prefix cache folds in.
    """
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        pos = getattr(feature, "mm_position", None)
        if not ident or pos is None or pos.length <= 0 or pos.offset < 0:
            return None
        items.append(MMItem(str(ident), int(pos.offset), int(pos.length)))
    return items


def _event_extra_keys(state: _Request, chunk: int, chunk_tokens: int) -> tuple[str | None, tuple | None]:
    """(LoRA name, extra keys) of one chunk for a published ``BlockStored``, in vLLM's event
    format: the LoRA name, then ``(mm identifier, offset in the chunk)`` for each multimodal item
    the chunk overlaps, then the cache salt on chunk 0; None when there are none. A router that
    maps chunks by ``token_ids`` needs them to tell two images behind the same tokens apart."""
    lo = chunk * chunk_tokens
    extra: list = [state.lora_name] if state.lora_name else []
    extra += [(m.identifier, m.offset - lo) for m in state.mm if m.overlaps(lo, lo + chunk_tokens)]
    if chunk == 0 and state.cache_salt:
        extra.append(state.cache_salt)
    return state.lora_name, (tuple(extra) if extra else None)


def _namespace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None", chunk_tokens: int,
               weights_id: str | None = None) -> Namespace:
    """The key namespace: everything about the engine that changes KV bytes.

    Model: its name/path, revision, a digest of its (possibly overridden) HF config, its
    weights (``weights_id`` when given, else ``weights_digest`` of a local model directory),
    its quantization method and compute dtype. KV: dtype and layout. Parallelism: TP and PP
    sizes and an explicit PP layer partition (per-worker keys add rank and stage). Request
    parts (LoRA, cache salt, multimodal items) are added per request.
    """
    from vllm import envs
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    hf = getattr(model, "hf_config", None)
    blob = json.dumps(hf.to_dict() if hf is not None else {}, sort_keys=True, default=str).encode()
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config else None
    layout = ":".join(str(x) for x in (
        current_platform.device_type,
        type(spec).__name__ if spec else "",
        getattr(spec, "block_size", ""),
        getattr(spec, "num_kv_heads", ""),
        getattr(spec, "head_size", ""),
        getattr(kv_cache_config, "kv_cache_layout", None) or "",
        f"chunk{chunk_tokens}",
        ENTRY_FORMAT,  # entries of another byte order are misses
    ))
    pp = parallel.pipeline_parallel_size
    return Namespace(
        model=str(model.model),
        revision=str(getattr(model, "revision", None) or ""),
        config_digest=hashlib.sha256(blob).hexdigest(),
        weights_digest=f"id:{weights_id}" if weights_id else weights_digest(model.model),
        quantization=str(getattr(model, "quantization", None) or ""),
        dtype=str(getattr(model, "dtype", "")),
        kv_dtype=str(getattr(spec, "dtype", vllm_config.cache_config.cache_dtype)),
        kv_layout=layout,
        tp_world_size=parallel.tensor_parallel_size,
        tp_rank=0,  # per-worker keys are derived on the worker (see _rank_key)
        pp_world_size=pp,
        pp_partition=str(envs.VLLM_PP_LAYER_PARTITION or "") if pp > 1 else "",
    )


def _make_probes(tier_specs: list) -> list:
    """Lookup-only views of the tiers a scheduler process can see, as each tier declares
    (``Tier.scheduler_view``/``scheduler_probe``): a probe of a directory, a shared tier itself.
    Process-private tiers have none: the mirror covers them. A tier that cannot be reached is
    left out with a warning."""
    from kvtier.errors import KVTierError

    probes = []
    for spec in tier_specs:
        try:
            probe = spec.probe()
        except KVTierError as exc:
            log.warning("kvtier: scheduler cannot look up tier %s: %s", spec.type, exc)
            continue
        if probe is not None:
            probes.append(probe)
    return probes


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process)
        return 0


def _pp_stage() -> int:
    """This worker's pipeline stage (0 when pipeline parallelism is not initialised)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except Exception:  # not initialised (single process)
        return 0

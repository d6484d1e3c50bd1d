"""KVTierConnector: vLLM's KV connector (V1 API) on kvtier's tiered store.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"tiers": [{"type": "ram", "capacity": "8GiB"}]}}'

vLLM builds one connector per role; ``KVTierConnector`` reads and checks the configuration,
derives what both roles share (the chunk geometry, the key namespace, the worker's share) and
delegates every call to the role's side:

- ``KVTierScheduler`` (``kvtier.integrations.vllm.scheduler``), in the scheduler process:
  bookkeeping and planning, no data. Keys, lookups (a mirror of the worker's private tiers fed
  by its store events, probes of persistent and shared tiers), load and save plans, KV events.
- ``KVTierWorker`` (``kvtier.integrations.vllm.worker``), in each worker process: the store, the
  engine's pages (``PageLayout``), loads, saves, load errors, stats.

The plans cross from one side to the other as ``KVTierMetadata``; store events come back as
``KVTierWorkerMetadata`` (``kvtier.integrations.vllm.metadata``).

Transfers (``transfer_mode``): in ``sync`` mode loads and saves complete within the step. In
``async`` mode a hit that lies (partly) below the RAM tier is loaded in the background through
vLLM's asynchronous load protocol (``get_num_new_matched_tokens`` answers ``(n, True)``, the
request waits in ``WAITING_FOR_REMOTE_KVS``, ``get_finished`` reports it loaded); RAM-tier hits
stay inline. Saves read the engine's pages within the step in both modes (in ``async`` mode into
staging slots, written into the store by a background thread, bounded: chunks that find no free
slot are dropped and counted), so ``request_finished`` never needs to hold blocks: a partial
prefill, a preemption or a request that finishes early leaves nothing behind (a request aborted
during its background load keeps its blocks through vLLM until the worker reports the load).
A chunk that fails to load is reported through ``get_block_ids_with_load_errors`` so vLLM
recomputes from it: a storage fault costs time, never a wrong token.

Keys (``kvtier.keys``): a request's chunk keys chain over its token ids under a namespace of
everything that changes KV bytes: the model (path, revision, config digest, a sampled digest of
its weights or the configured ``weights_id``, quantization, dtype), the KV dtype and layout, TP
and PP sizes (and an explicit PP layer split), the LoRA adapter (name, path, weights digest) and
the cache salt. Each multimodal item's content hash and placeholder span is folded into every
chunk it overlaps, and through the chain into every later chunk; a prompt with an unhashed item
or given as embeddings is not keyed at all. Each worker stores its share of a chunk under its own
key (TP rank, PP stage: ``kvtier.keys.WorkerShare``), except replicated KV (MLA's latent, the
same on every TP rank), stored once under rank 0's key and loaded by every rank.

KV cache groups: the connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache
manager on (sliding-window layers hold only their window). Every group is saved and loaded with
its own block ids (``kvtier.integrations.vllm.groups``); each group's spec is in the namespace.
Recurrent state (Mamba2, gated delta net) is stored once per chunk boundary beside the
attention groups' KV when vLLM runs it in mamba_cache_mode "align" (prefix caching on); a model
with a group kvtier cannot store is refused at engine start in one line.

vLLM versions: ``SUPPORTED_VLLM`` (the connector API these versions share); another version
gets one warning line at engine start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig, check_load_failure_policy
from kvtier.integrations.vllm.groups import STATE, GroupSpec, groups_of, namespace_groups
from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics
from kvtier.integrations.vllm.pages import ENTRY_FORMAT
from kvtier.integrations.vllm.plugin import route_logs_to_vllm
from kvtier.integrations.vllm.scheduler import KVTierScheduler, RequestState, mm_items
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import Namespace, WorkerShare, weights_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVTierConnector", "KVTierMetadata", "KVTierWorkerMetadata", "mm_items", "SUPPORTED_VLLM",
           "check_vllm_version"]

log = logging.getLogger(__name__)

# The vLLM versions whose KV connector API (KVConnectorBase_V1, SupportsHMA, the stats and events
# hooks) this connector implements: [low, high). tests/integration/test_vllm_api.py compares the
# installed vLLM's interface with the connector.
SUPPORTED_VLLM = ((0, 32), (0, 34))


def check_vllm_version(version: str) -> str | None:
    """One warning line when vLLM ``version`` is outside ``SUPPORTED_VLLM``, else None."""
    (lo, hi) = SUPPORTED_VLLM
    span = f"vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"kvtier: cannot read vLLM's version {version!r}; the connector supports {span}"
    if lo <= parts < hi:
        return None
    return f"kvtier: vLLM {version} is outside the versions this connector supports ({span}); it may fail"


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a kvtier store: one side per role (see the module docstring).

    ``scheduler`` is set in the scheduler role, ``worker`` in the worker role; the other is None.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        route_logs_to_vllm()  # kvtier's log lines under vLLM's logging configuration
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.config = self.config.with_kv_dtype(  # a tier codec's element width
            getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"),
            getattr(getattr(vllm_config, "model_config", None), "dtype", ""))
        self.config = self.config.with_step_wait(_forward_on_host_cpu())  # lower-tier writes yield to CPU steps
        warning = check_load_failure_policy(transfer.kv_load_failure_policy, self.config.require_recompute)
        if warning and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning("%s", warning)
        codec_warning = self.config.lossy_codec_warning()
        if codec_warning and role == KVConnectorRole.SCHEDULER:
            log.warning("%s", codec_warning)
        if role == KVConnectorRole.SCHEDULER:
            import vllm

            version_warning = check_vllm_version(getattr(vllm, "__version__", "") or "")
            if version_warning:
                log.warning("%s", version_warning)
        self.geometry = _geometry(self.config, vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        hf = getattr(vllm_config.model_config, "hf_config", None)
        model_type = str(getattr(hf, "model_type", "") or "")
        # ConfigError for a group kvtier cannot store (e.g. recurrent state without prefix caching):
        # the engine does not start
        self.groups: list[GroupSpec] = groups_of(kv_cache_config, model_type)
        if any(g.kind == STATE for g in self.groups) and self.geometry.blocks_per_chunk != 1:
            raise ConfigError(
                f"kvtier: model type {model_type or '?'} holds recurrent state, stored once per chunk: "
                f"kv_connector_extra_config.chunk_tokens ({self.geometry.chunk_tokens}) must equal the engine's "
                f"block size ({self.geometry.block_size})")
        lossy = self.config.store.lossy_codec()
        if lossy and any(g.kind == STATE for g in self.groups):
            raise ConfigError(
                f"kvtier: model type {model_type or '?'} holds recurrent state, which tier codec {lossy!r} would "
                f"quantize as KV elements (a state has its own dtype, and its error compounds over every later "
                f"token); valid codecs for it: none, lossless, auto")
        self.replicated = self.tp_size > 1 and bool(self.groups) and (
            all(g.replicated for g in self.groups)
            or getattr(kv_cache_config, "kv_tp_replicas", 1) == self.tp_size)
        self.namespace = _namespace(vllm_config, kv_cache_config, self.geometry.chunk_tokens, self.config.weights_id,
                                    self.groups, self.config.store.lossy_codec())
        self.scheduler: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        if role == KVConnectorRole.WORKER:
            share = WorkerShare(_tp_rank(), self.tp_size, _pp_stage(), self.pp_size)
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config else None
            self.worker = KVTierWorker(self.config, self.geometry, share, getattr(spec, "page_size_bytes", None),
                                       kv_cache_config.num_blocks if kv_cache_config else 0, groups=self.groups,
                                       replicated=self.replicated)
        else:
            share = WorkerShare(0, self.tp_size, 0, self.pp_size)
            events = vllm_config.kv_events_config
            self.scheduler = KVTierScheduler(self.config, self.geometry, self.namespace, share,
                                             publish_events=bool(events and events.enable_kv_cache_events),
                                             groups=self.groups)

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
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the request's newly allocated blocks."""
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads (planned at allocation) and saves (newly completed full chunks)."""
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the worker's store events to the scheduler's mirror."""
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks can be freed at once (False: every save has read its
        pages within its step, also in ``async`` mode; see ``KVTierScheduler.request_finished``)."""
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with every KV cache group's blocks (vLLM's HMA API): False, the
        blocks can be freed at once, as for one group."""
        return self.scheduler.request_finished_all_groups(request, block_ids)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """BlockStored/BlockRemoved events for chunks entering/leaving kvtier's tiers."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def _request_state(self, request: "Request") -> RequestState:
        """The scheduler's state of ``request`` (its chunk keys; for tests)."""
        return self.scheduler.request_state(request)

    def _plan(self, meta: KVTierMetadata, req_id: str, state: RequestState, tokens_done: int) -> None:
        """The scheduler's load and save planning for one request (for tests)."""
        self.scheduler._plan(meta, req_id, state, tokens_done)

    def _rank_key(self, key: bytes, rank: int, stage: int = 0) -> bytes:
        """The key of TP rank ``rank`` of stage ``stage``'s share of a chunk (for tests)."""
        return WorkerShare(rank, self.tp_size, stage, self.pp_size).key(key)

    # ------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the engine's per-layer page tensors."""
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's metadata. vLLM binds it before the step's forward pass, and calls
        ``start_load_kv`` before that pass only when the step has synchronous loads (after it
        otherwise, vLLM 0.32): so the engine's step starts here for the store
        (``KVStore.engine_step``), and ends in ``wait_for_save``."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self.worker.begin_step()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copy this step's inline loads into the engine's pages before the forward pass, and
        start its background loads."""
        meta = self._connector_metadata
        if isinstance(meta, KVTierMetadata):
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves happen once per step in ``wait_for_save``, after every layer is computed."""

    def wait_for_save(self) -> None:
        """Copy the pages of this step's completed chunks into the store's top tier."""
        meta = self._connector_metadata
        if isinstance(meta, KVTierMetadata):
            self.worker.wait_for_save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's store events for the scheduler's mirror (rank 0 of stage 0 speaks for all)."""
        return self.worker.worker_meta() if self.worker is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose background load ended since the last call). No save needs the
        engine's blocks after its step (``async`` saves write from staging copies), so
        ``request_finished`` holds no blocks and nothing is reported as sent."""
        if self.worker is None:
            return None, None
        return None, (self.worker.finished_loads() or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s loads, and (several KV cache groups) the requests whose load failed:
        vLLM recomputes them (it takes no per-block failures for such models)."""
        results = super().get_transfer_results(finished_req_ids)
        if self.worker is not None:
            failed = self.worker.failed_loads()
            results.failed_recving |= failed
            results.finished_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self.worker.failed_blocks() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counters (then reset), with the in-process store's per-tier counters
        since the last call (a cache server reports its own on its /metrics)."""
        return self.worker.take_stats() if self.worker is not None else None

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
        """Close the role's side (the worker's store, or the scheduler's probes)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None


def _geometry(config: ConnectorConfig, block_size: int) -> ChunkGeometry:
    """Chunks of ``chunk_tokens`` (default: 128 rounded up to the block size); ConfigError
    unless that is a whole number of blocks."""
    chunk_tokens = config.chunk_tokens or -(-128 // block_size) * block_size
    if chunk_tokens % block_size:
        raise ConfigError(
            f"kv_connector_extra_config.chunk_tokens ({chunk_tokens}) must be a multiple "
            f"of the engine's block size ({block_size})"
        )
    return ChunkGeometry(block_size, chunk_tokens)


def _forward_on_host_cpu() -> bool:
    """Whether this engine's forward pass runs on the host's cores (vLLM's CPU platform)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _namespace(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None", chunk_tokens: int,
               weights_id: str | None = None, groups: list[GroupSpec] | None = None,
               kv_codec: str = "") -> Namespace:
    """The key namespace: everything about the engine that changes KV bytes.

    Model: its name/path, revision, a digest of its (possibly overridden) HF config, its
    weights (``weights_id`` when given, else ``weights_digest`` of a local model directory),
    its quantization method and compute dtype. KV: dtype and layout. Parallelism: TP and PP
    sizes and an explicit PP layer partition (per-worker keys add rank and stage). KV cache
    groups: each group's spec when there is more than one plain full-attention group. A lossy
    tier codec of the store (``kv_codec``: its entries are another KV). Request
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
        tp_rank=0,  # per-worker keys are derived on the worker (WorkerShare)
        pp_world_size=pp,
        pp_partition=str(envs.VLLM_PP_LAYER_PARTITION or "") if pp > 1 else "",
        kv_groups=namespace_groups(groups or []),
        kv_codec=kv_codec,
    )


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

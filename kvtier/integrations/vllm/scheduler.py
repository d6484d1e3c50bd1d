"""The connector's scheduler side: bookkeeping and planning, no KV data.

Runs in vLLM's scheduler process. For each request it computes the chunk keys (chained over the
token ids under the request's namespace: model, LoRA, cache salt, multimodal items), looks them
up, plans which chunks to load into which blocks and which newly computed full chunks to save
(generated tokens included: the next turn of a conversation re-reads the answer as its prompt),
and hands both plans to the worker in the step's ``KVTierMetadata``.

What the stores hold is learned three ways, as each tier declares (``Tier.scheduler_view``):

- the worker's process-private tiers (RAM) are mirrored from the store events the worker
  reports each step (``KVTierWorkerMetadata``, applied in ``update_connector_output``);
- persistent and shared tiers (disk, fs, redis, s3) are asked directly through lookup-only
  probes, so entries stored by an earlier engine or another machine are found at once;
- with a per-node cache server, the server is asked (it knows every engine's entries).

Lookups use the keys of worker rank 0 of stage 0, which speaks for all workers.

Transfer modes (``transfer_mode``). ``sync``: a load is planned when the request is scheduled
and completes in that step's ``start_load_kv``. ``async``: when a hit lies (partly) below the
RAM tier (some chunk of it is not in the mirror), ``get_num_new_matched_tokens`` answers
``(n, True)``; vLLM allocates the request's blocks, keeps it in ``WAITING_FOR_REMOTE_KVS`` and
calls ``update_state_after_alloc``, which plans a background load into those blocks; the plan
goes to the worker with the step's metadata even though the request is not scheduled. The worker
reports the request finished (``get_finished``) and any failed blocks, and vLLM schedules it
from the loaded (or, after a failure, the valid) prefix. A hit wholly in the mirror stays
inline, as does any hit through a cache server (which may hold it in its shared memory).

KV cache groups (vLLM's hybrid KV cache manager, ``kvtier.integrations.vllm.groups``): the
groups of a chunk that share a storage rule (a pack) are one entry, each group's part saved and
loaded with the block ids vLLM gives that group; the plan names each group (one ``SaveSpec`` or
``LoadSpec`` per group) and the worker joins a pack's members into its entry. Full-attention
groups store every chunk; a sliding-window or chunked-local group stores
only the chunks inside its window before the prompt's last chunk boundary (the point a re-read
of the prompt resumes at) and every chunk after it (generated tokens: the next turn resumes
later). A hit of ``n`` chunks needs every group's chunks for resuming at ``n`` chunks; ``n`` is
the largest such count (the same for every group). vLLM takes a failed load of such a model per
request (``failed_recving``), only for requests waiting for their load, never per block: a hit
loads inline only when it is wholly in the worker's RAM tier and nothing can be evicted from that
tier before its load (``room.RoomLedger``: the worker reports its tier's room each step; one
worker, no state groups, a store in its process), else in the background.

Recurrent state groups (Mamba2, gated delta net; vLLM's ``mamba_cache_mode`` "align", see
``groups.py``): a chunk's state entry is the state at the chunk's end, saved from the exact block
vLLM offers for that boundary in ``SchedulerOutput.kv_connector_block_state`` (the step that
commits it; the worker copies it after that step's forward), only at chunk boundaries, from the
prompt's last chunk boundary on (the point a re-read resumes at). A hit of ``n`` chunks loads
state chunk ``n - 1`` into the group's block at index ``n - 1``.

Per request (vLLM's ``kv_transfer_params``, e.g. ``SamplingParams(extra_args={"kv_transfer_params":
{"kvtier.skip_save": True}})`` or the OpenAI server's ``kv_transfer_params`` field):
``kvtier.skip_save: true`` stores nothing of that request (a one-off prompt that should not
take the place of prefixes worth keeping); its prompt is still looked up and its hits loaded.
Any other value of that key is ignored with a warning naming the valid ones (once per
scheduler; later ones at debug); other keys are
left to other connectors.

Events for routers (when vLLM publishes KV events): ``take_events`` turns the worker's store
events into vLLM ``BlockStored``/``BlockRemoved`` events shaped as the engine's own (its block
hashes, block size, token ids and extra keys; each group's entries with that group's
``group_idx`` and spec kind; see ``events.py``), from what was remembered when each chunk's save
or load was planned.
"""

from __future__ import annotations

import logging
import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from vllm.distributed.kv_events import KVCacheEvent

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.groups import FULL, STATE, GroupSpec, packs, window_chunks, with_packs
from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, KVTierWorkerMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.room import RoomLedger
from kvtier.keys import ROOT, MMItem, Namespace, WorkerShare, chunk_keys, group_key, lora_identity, weights_digest
from kvtier.tiers.base import SchedulerView

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_DIGESTS_KEPT = 1024  # namespace digests remembered per (adapter, cache salt); the table is cleared when full
SKIP_SAVE = "kvtier.skip_save"  # kv_transfer_params key: true stores nothing of the request


@dataclass
class RequestState:
    """Scheduler-side state of one request."""

    keys: list[bytes]  # keys of the full chunks known so far (the prompt's, then generated ones)
    prompt_len: int
    token_ids: Sequence[int]  # the prompt, then the generated tokens (vLLM's growing all_token_ids)
    namespace: bytes = b""
    mm: tuple[MMItem, ...] = ()  # the prompt's multimodal items, folded into the keys
    request: "Request | None" = None  # vLLM's request (its block hashes and extra keys, for events)
    block_ids: list[int] = field(default_factory=list)  # group 0's block table
    more_blocks: list[list[int]] = field(default_factory=list)  # the block tables of groups 1..
    hit_chunks: int = 0  # chunks found in the store at lookup
    background: bool = False  # async mode: the hit loads in the background (below RAM, or async_ram_loads)
    local_tokens: int = 0  # tokens vLLM's own prefix cache had
    load: tuple[int, int, int] | None = None  # (first_chunk, end_chunk, skip_blocks) pending
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or being stored
    saved_states: set[tuple[int, int]] = field(default_factory=set)  # (state group, chunk) saved
    skip_save: bool = False  # the request asked that nothing of it be stored (kvtier.skip_save)


class KVTierScheduler:
    """The scheduler side of ``KVTierConnector`` (see the module docstring).

    Not thread-safe: vLLM calls it from its scheduler loop only.
    """

    def __init__(self, config: ConnectorConfig, geometry: ChunkGeometry, namespace: Namespace, share: WorkerShare,
                 publish_events: bool = False, groups: Sequence[GroupSpec] = ()):
        self.config = config
        self.geometry = geometry
        self._auth_key = config.store.auth_secret("kv_connector_extra_config")  # keys the chunk keys
        # vLLM's KV cache groups; none given: one full-attention group (a dense model)
        self.groups = with_packs(list(groups) or [GroupSpec(0, FULL, (), geometry.block_size)])
        # failures per request only: a hit loads in the background unless it cannot fail (``room.py``;
        # always with a state group, also with one group: vLLM allocates its state block at the
        # hit's end only for an asynchronous load)
        self._hybrid = len(self.groups) > 1 or any(g.kind == STATE for g in self.groups)
        self._per_group = self._hybrid or any(g.kind != FULL for g in self.groups)  # hits need each group's window
        self._states = {g.index: g for g in self.groups if g.kind == STATE}  # recurrent state groups
        # several groups without state, one worker, a store in its process: a hit wholly in the
        # RAM tier loads inline when the worker's reported room shows it cannot be evicted first
        self._room = (RoomLedger() if self._hybrid and not self._states
                      and share.tp_size * share.pp_size == 1 and not config.server else None)
        self._step = 0  # the metadata built so far (``KVTierMetadata.step``)
        self._bad_skip_save = BadValueLog()  # bad kvtier.skip_save values: one warning, then debug
        self.namespace = namespace
        self._share = share.of(0, 0)  # worker rank 0 of stage 0 speaks for all
        self._lora_ids: dict[tuple[str, str], str] = {}  # (name, path) -> identity, read once
        self._digests: dict[tuple[str | None, str | None], bytes] = {}  # (lora, salt) -> namespace digest
        self._requests: dict[str, RequestState] = {}
        self._present: dict[bytes, set[str]] = {}  # chunk key -> media holding it (from events)
        # fields of published events, remembered per chunk (None: vLLM publishes no KV events)
        self.chunk_events = (ChunkEvents(geometry.block_size, geometry.blocks_per_chunk, server=bool(config.server),
                                         tiers=[spec.tier_class for spec in config.store.tiers], groups=self.groups)
                             if publish_events else None)
        self._events: list = []
        self._background = config.transfer_mode == "async"
        self._async_ram = config.async_ram_loads  # every hit counts as below RAM: all load in the background
        self._async_loads: list[LoadSpec] = []  # planned at allocation, sent with the next metadata
        # media the worker's store knows only privately: mirrored from the worker's events
        self._mirrored = frozenset(spec.medium for spec in config.store.tiers
                                   if spec.scheduler_view is SchedulerView.MIRRORED)
        self._server = None  # with a cache server: lookups go to the server
        self._probes: list = []
        if config.server:
            from kvtier.server.client import ServerStore

            self._server = ServerStore(config.server, token=config.server_token)
        else:
            self._probes = make_probes(config.for_rank(0, share.tp_size, 0, share.pp_size).store.tiers)

    # ------------------------------------------------------------------------- vLLM's calls

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store holds (whole chunks, less than
        the prompt), and whether they load asynchronously: in ``async`` mode when some chunk
        of the hit lies below the RAM tier, or any hit with ``async_ram_loads`` (never for 0
        tokens)."""
        state = self.request_state(request)
        chunk = self.geometry.chunk_tokens
        max_chunks = (state.prompt_len - 1) // chunk
        state.hit_chunks, mirrored = self._hit(self._share.keys(state.keys[:max_chunks]))
        state.background = ((self._background and (mirrored < state.hit_chunks or self._async_ram))
                            or (self._hybrid and not self._inline_safe(state.hit_chunks, mirrored)))
        state.local_tokens = num_computed_tokens
        hit_tokens = state.hit_chunks * chunk
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, state.background

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Plan the load of the external tokens into the request's newly allocated blocks: at
        the request's next scheduling (inline), or now, for the next step's metadata, when the
        load runs in the background (vLLM calls this again, with no external tokens, once the
        request is scheduled after its load)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._set_blocks(state, blocks.get_block_ids())
        state.saved_chunks = max(state.saved_chunks, state.hit_chunks)  # those are stored already
        if num_external_tokens <= 0:
            state.load = None
            return
        chunk = self.geometry.chunk_tokens
        start = state.local_tokens
        end = start + num_external_tokens
        first_chunk = start // chunk
        skip = (start - first_chunk * chunk) // self.geometry.block_size
        state.load = (first_chunk, end // chunk, skip)
        if state.background:  # vLLM took (n, True): the request waits
            self._async_loads.extend(self._take_load(request.request_id, state, background=True))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVTierMetadata:
        """This step's loads (planned at allocation) and saves (newly completed full chunks)."""
        self._step += 1
        meta = KVTierMetadata(step=self._step)
        meta.loads, self._async_loads = self._async_loads, []  # background loads of waiting requests
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            self._set_blocks(state, new.block_ids)
            # after a background load that failed part-way vLLM computes from the first missing
            # chunk: those chunks are saved again as they complete
            state.saved_chunks = min(state.saved_chunks, new.num_computed_tokens // self.geometry.chunk_tokens)
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._plan(meta, new.req_id, state, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._set_blocks(state, new_ids or ())
            elif new_ids:
                state.block_ids.extend(new_ids[0])
                for table, ids in zip(state.more_blocks, new_ids[1:]):
                    table.extend(ids)
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan(meta, req_id, state, done)
        if self._states:
            block_state = getattr(scheduler_output, "kv_connector_block_state", None)
            self._plan_states(meta, getattr(block_state, "boundary_state_offloads", None) or {})
        if self._room is not None:  # what this step may put into the worker's top tier
            self._room.planned(self._step, len(meta.saves))
            for load in meta.loads:
                if load.background:
                    self._room.loading(load.req_id, len(load.keys))
        return meta

    def _inline_safe(self, hit_chunks: int, mirrored: int) -> bool:
        """Whether a hit of several KV cache groups may load inline: wholly in the worker's RAM
        tier, which cannot evict before the load (see ``room.py``)."""
        return self._room is not None and 0 < hit_chunks == mirrored and self._room.safe()

    def _plan_states(self, meta: KVTierMetadata, offers: dict[str, list[tuple[int, int, int]]]) -> None:
        """Saves of recurrent states from vLLM's boundary-state offers of this step
        (``{req_id: [(group, block id, boundary tokens)]}``): a state at a chunk boundary whose
        chunk is stored (``_saves_chunk``), keyed and not saved before, from the exact block
        offered (one block: ``chunk_tokens`` is the block size with a state group)."""
        chunk = self.geometry.chunk_tokens
        for req_id, entries in offers.items():
            state = self._requests.get(req_id)
            if state is None or state.skip_save:
                continue
            for group_idx, block_id, boundary in entries:
                group = self._states.get(group_idx)
                c = boundary // chunk - 1
                if group is None or boundary <= 0 or boundary % chunk or not state.hit_chunks <= c < len(state.keys):
                    continue  # not a state group, not a chunk boundary, found in the store, or not keyed yet
                if (group_idx, c) in state.saved_states or not self._saves_chunk(group, state, c):
                    continue
                state.saved_states.add((group_idx, c))
                parent = state.keys[c - 1] if c else None
                meta.saves.append(SaveSpec(req_id, state.keys[c], parent, c, [block_id], group=group_idx))

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the worker's store events to the mirror (and keep them for ``take_events``)."""
        if self._room is not None:
            self._room.loaded(getattr(connector_output, "finished_recving", None))
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVTierWorkerMetadata):
            return
        if self._room is not None:
            self._room.reported(meta.step, meta.room)
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
        if self.chunk_events is not None:
            self._events.extend(meta.events)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks can be freed at once (False, in both transfer modes).

        Contract with the worker: the worker reads a chunk's pages inside the step that saves
        it, also in ``async`` mode (the store write then runs in the background from a staging
        copy), so no save ever needs the blocks after its step, and the worker reports no
        request as finished sending. Returning True here would leak the blocks: vLLM frees them
        only when a worker reports the request in ``get_finished``. A request that ends while
        its background load runs (an abort) keeps its blocks anyway: vLLM holds them until the
        worker reports the load finished, which it always does."""
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` for vLLM's hybrid KV cache manager (every group's blocks)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> list[KVCacheEvent]:
        """BlockStored/BlockRemoved events for chunks entering/leaving kvtier's tiers, shaped as
        the engine's own block events (``events.py``); [] when vLLM publishes no KV events."""
        pending, self._events = self._events, []
        return self.chunk_events.events(pending) if self.chunk_events is not None else []

    def close(self) -> None:
        """Close the probes or the server connection."""
        for probe in self._probes:
            probe.close()
        self._probes = []
        if self._server is not None:
            self._server.close()
            self._server = None

    # ------------------------------------------------------------------------- requests

    def request_state(self, request: "Request") -> RequestState:
        """The request's state, created (keys of its prompt's full chunks) on first sight."""
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
            ns = self._digest(self._lora_identity(request), request.cache_salt)
            state = RequestState(chunk_keys(prompt, ns, self.geometry.chunk_tokens, mm=mm,
                                            auth_key=self._auth_key), len(prompt), tokens,
                                 ns, mm, request, skip_save=_skips_save(request, self._bad_skip_save))
            self._requests[request.request_id] = state
        return state

    def _digest(self, lora: str | None, salt: str | None) -> bytes:
        """The namespace digest of requests of adapter ``lora`` and cache salt ``salt``
        (remembered: the base model's is asked for on every request; a bounded table, since
        salts come from clients)."""
        ident = (lora, salt)
        digest = self._digests.get(ident)
        if digest is None:
            if len(self._digests) >= _DIGESTS_KEPT:
                self._digests.clear()
            digest = self._digests[ident] = self.namespace.with_lora(lora).with_salt(salt).digest()
        return digest

    def _lora_identity(self, request: "Request") -> str | None:
        """The request's LoRA adapter identity (name, path, weights digest), None without one.

        The adapter's weights are sampled once per (name, path) in this scheduler's life, as
        vLLM itself loads an adapter once: files replaced later at the same path are not noticed.
        """
        lora = request.lora_request
        if lora is None:
            return None
        name, path = lora.lora_name, str(lora.lora_path or "")
        ident = self._lora_ids.get((name, path))
        if ident is None:
            ident = self._lora_ids[(name, path)] = lora_identity(name, path, weights_digest(path) if path else "")
        return ident

    def _set_blocks(self, state: RequestState, tables: Sequence[Sequence[int]]) -> None:
        """Take the request's block table of every group (vLLM's per-group tuple)."""
        tables = list(tables)
        state.block_ids = list(tables[0]) if tables else []
        state.more_blocks = [list(t) for t in tables[1:]]
        while len(state.more_blocks) < len(self.groups) - 1:
            state.more_blocks.append([])

    def _blocks(self, state: RequestState, group: int) -> list[int]:
        """The request's block table of ``group``."""
        return state.block_ids if group == 0 else state.more_blocks[group - 1]

    def _saves_chunk(self, group: GroupSpec, state: RequestState, c: int) -> bool:
        """Whether chunk ``c`` of ``group`` is stored: always for a full group; for a window
        group when it is inside the window before the prompt's last chunk boundary, or after
        that boundary."""
        if group.kind == FULL:
            return True
        resume = (state.prompt_len - 1) // self.geometry.chunk_tokens if state.prompt_len else 0
        return c >= resume or c in window_chunks(group, resume, self.geometry.blocks_per_chunk)

    def _plan(self, meta: KVTierMetadata, req_id: str, state: RequestState, tokens_done: int) -> None:
        """Add a pending load and the saves of chunks completed by this step."""
        if state.load is not None:
            meta.loads.extend(self._take_load(req_id, state, background=False))
        if state.skip_save:  # nothing of it is stored: its later chunks need no keys either
            return
        # chunks whose KV this step completes, generated tokens included (a later turn of a
        # conversation re-reads them as its prompt); a token not yet known is never keyed
        chunk = self.geometry.chunk_tokens
        full = min(tokens_done, len(state.token_ids)) // chunk
        if full > len(state.keys):
            prev = state.keys[-1] if state.keys else ROOT
            state.keys += chunk_keys(state.token_ids[: full * chunk], state.namespace, chunk,
                                     start=len(state.keys), prev=prev, mm=state.mm, auth_key=self._auth_key)
        bpc = self.geometry.blocks_per_chunk
        paged = [g for g in self.groups if g.kind != STATE]  # state groups: saved from vLLM's offers
        for c in range(state.saved_chunks, full):
            tables = [self.geometry.chunk_blocks(self._blocks(state, g.index), c) for g in paged]
            if any(len(blocks) < bpc for blocks in tables):
                break
            parent = state.keys[c - 1] if c else None
            for group, blocks in zip(paged, tables):
                if self._saves_chunk(group, state, c):
                    meta.saves.append(SaveSpec(req_id, state.keys[c], parent, c, blocks, group=group.index))
            self._remember_chunk(state, c)
            state.saved_chunks = c + 1

    def _remember_chunk(self, state: RequestState, c: int) -> None:
        """Remember chunk ``c``'s event fields (when events are published)."""
        if self.chunk_events is not None:
            chunk = self.geometry.chunk_tokens
            self.chunk_events.record(state.request, state.keys, c, state.token_ids[c * chunk : (c + 1) * chunk],
                                     store_key=self._share.key(state.keys[c]))

    def _take_load(self, req_id: str, state: RequestState, background: bool) -> list[LoadSpec]:
        """The request's pending load as one ``LoadSpec`` per group with blocks to fill (the
        load is then no longer pending). A window group loads only the blocks vLLM keeps at the
        hit's end (its blocks before them are null)."""
        first, end, skip = state.load
        state.saved_chunks = max(state.saved_chunks, end)
        state.load = None
        for c in range(first, end):  # a loaded chunk may be promoted into a faster tier: an event
            self._remember_chunk(state, c)
        bpc = self.geometry.blocks_per_chunk
        loads = []
        for group in self.groups:
            start = first * bpc + skip
            if group.kind != FULL:
                start = max(start, group.first_block(end * self.geometry.chunk_tokens))
            if start >= end * bpc:
                continue
            c0 = start // bpc
            loads.append(LoadSpec(req_id, state.keys[c0:end], c0, list(self._blocks(state, group.index)),
                                  start - c0 * bpc, background, group=group.index))
        return loads

    # ------------------------------------------------------------------------- lookups

    def _hit(self, keys: list[bytes]) -> tuple[int, int]:
        """(chunks of the prefix of ``keys`` (rank 0's keys) that every group can load at the
        same token count, how many of those the mirror holds: see ``_lookup``). One group: the
        leading keys present. Several: the full groups' common leading run, then the largest
        count at or below it for which every window group holds its window."""
        if not self._per_group:
            return self._lookup(keys)
        n, mirrored = len(keys), len(keys)
        leads = [members[0] for members in packs(self.groups).values()]  # one lookup per pack
        for group in leads:
            if group.kind == FULL:
                found, near = self._lookup([group_key(k, group.index) for k in keys[:n]])
                n, mirrored = min(n, found), min(mirrored, near)
        windows = [g for g in leads if g.kind != FULL]
        bpc = self.geometry.blocks_per_chunk
        while n > 0 and windows:
            ok, near_end = True, n  # near_end: the hit's chunks up to the first a window has below RAM
            for group in windows:
                chunks = window_chunks(group, n, bpc)
                found, near = self._lookup([group_key(keys[c], group.index) for c in chunks])
                if found < len(chunks):
                    ok = False
                    break
                if near < len(chunks):
                    near_end = min(near_end, chunks.start + near)
            if ok:
                mirrored = min(mirrored, near_end)
                break
            n -= 1
        return n, min(n, mirrored)

    def _lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """(leading ``keys`` present, how many of those the mirror of the worker's private
        tiers holds): the mirror first, then the probed tiers. A cache server's hits count as
        mirrored (it may serve them from shared memory)."""
        if self._server is not None:  # the server knows every engine's entries
            n = self._server.lookup(keys)
            return n, n
        n = 0
        while n < len(keys) and keys[n] in self._present:
            n += 1
        mirrored = n
        if n == len(keys) or not self._probes:
            return n, mirrored
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
        return n, mirrored


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


def make_probes(tier_specs: list) -> list:
    """Lookup-only views of the tiers a scheduler process can see, as each tier declares
    (``Tier.scheduler_view``/``scheduler_probe``): a probe of a directory, a shared tier itself.
    Process-private tiers have none: the mirror covers them. A tier that cannot be reached is
    left out with a warning."""
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


_SHORT = reprlib.Repr()  # a client's value as logged: cut short
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlevel = 2


class BadValueLog:
    """Warns about the first bad ``kvtier.skip_save`` value it is shown, then logs the rest at
    debug only (one per scheduler: a client sending bad values cannot flood the log)."""

    def __init__(self):
        self.warned = False

    def report(self, request: "Request", value: Any) -> None:
        """Log one request's bad value (cut to 60 characters)."""
        rid, shown = getattr(request, "request_id", "?"), _SHORT.repr(value)
        if self.warned:
            log.debug("kvtier: request %s: kv_transfer_params %r is %s (ignored)", rid, SKIP_SAVE, shown)
            return
        self.warned = True
        log.warning("kvtier: request %s: kv_transfer_params %r is %s; valid: true or false (ignored: the request "
                    "is stored; later requests with a bad value are logged at debug only)", rid, SKIP_SAVE, shown)


def _skips_save(request: "Request", bad: BadValueLog) -> bool:
    """Whether the request's ``kv_transfer_params`` say ``kvtier.skip_save: true``. A value
    other than true or false is ignored (the request is stored) and shown to ``bad``."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or SKIP_SAVE not in params:
        return False
    value = params[SKIP_SAVE]
    if isinstance(value, bool):
        return value
    bad.report(request, value)
    return False

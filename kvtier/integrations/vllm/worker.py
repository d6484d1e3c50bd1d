"""The connector's worker side: the store, the engine's pages, loads, saves and stats.

Runs in each vLLM worker process. It owns the worker's ``KVStore`` (an in-process
``TieredStore``, or a client of a per-node cache server) and a ``PageLayout`` over the engine's
KV tensors, and carries out the plan the scheduler side put in the step's ``KVTierMetadata``:

- loads: before the forward pass, whole (layer, block) pages are copied from the store into the
  request's blocks; chunks in the store's top tier inline (on a CPU engine pinned in batches of
  up to ``TOP_BATCH_BYTES`` and copied as one list of page copies), the others read by
  ``load_threads`` threads at once so a lower tier's I/O overlaps. A chunk that fails to load
  (absent, corrupt, of another size, a tier fault) is reported through
  ``failed_blocks`` with every block after it, so vLLM recomputes them: a storage fault costs
  time, never a wrong token;
- background loads (``transfer_mode: async``, and a hybrid model's loads unless the scheduler
  knows they cannot fail, see below;
  ``LoadSpec.background``): the request is not in this step's batch; ``start_load_kv`` copies its
  chunks in the store's top tier at once (unless ``async_ram_loads``) and hands the others to
  ``load_threads`` background threads that read them from the store into the request's blocks
  (``PageLayout.begin_load``: on CPU straight into the pages, with the torch engine into staging,
  scattered from the engine's thread), and ``get_finished`` reports the request once every read
  has ended, with the blocks from the first failed chunk on among the load errors of the same
  step. A load is always reported, also when its request was aborted meanwhile (vLLM frees the
  blocks then);
- saves: after the forward pass, the step's completed chunks are gathered once
  (``PageLayout.gather``) and copied into the store's top tier; lower tiers are written in the
  background by the store. A save the store cannot take is dropped and counted;
- background saves (``transfer_mode: async``, ``BackgroundSaves``): the step still reads the
  chunks' pages, and one background thread writes them into the store (top-tier placement,
  eviction, write-through queueing, or the round trip to a cache server), off the step. With
  the ``host`` copy engine (CPU) and a store whose ``write`` is a memcpy into this process (a
  ``TieredStore`` over a RAM tier) there is no background writer: the step copies the pages
  straight into the store's pages, as in ``sync`` (one copy per page, not two; the lower tiers
  are written by the store's own writers either way). With the ``host`` engine and any other
  store (a cache server's client, a disk top tier) the step copies the pages into a staging
  slot per chunk (a memcpy per page); with the ``torch`` engine (CUDA) the step only issues the batched gather
  (one indexed copy per layer on the side stream, the compute stream waiting for it, then one
  non-blocking copy to pinned host memory) and the writer thread waits for that copy and moves
  the bytes into the slots (``_Landing``), so the step never waits for the device-to-host
  copy. The pages are read inside the step because a running request's blocks can be freed
  without ``request_finished`` (preemption, in the next step's scheduling) and reused by the
  very next forward pass, and no worker call that this side receives comes before that pass.
  So vLLM never has to keep a request's blocks for kvtier: ``request_finished`` answers False
  in both modes and no request is ever reported as sending. The staging slots bound the
  backlog: a chunk that finds no free slot is dropped and counted (``save_backlog_dropped``),
  with the rest of its request's chunks in that step (worthless without it); the step never
  waits for the store.

Each worker stores its share of a chunk under its own key (``WorkerShare.key``: TP rank, PP
stage). Rank 0 of stage 0 records the store's events for the scheduler's mirror.

KV cache groups (vLLM's hybrid KV cache manager): one ``PageLayout`` per group over that group's
layers; each ``LoadSpec``/``SaveSpec`` names its group. The groups of a pack (equal storage rule,
``groups.py``) share one entry per chunk, keyed by the pack's first group
(``kvtier.keys.group_key``): their parts back to back in group order, each copied with its own
group's block ids; a pack's specs of one request are joined here (``_joined``) and moved with one
store operation per chunk. With several groups a failed load is reported per request
(``failed_loads``: vLLM cannot map block ids back to a group), never per block; such a load is
inline only when the scheduler knows it cannot fail: this worker reports its top tier's room
after each step (``_reports_room``, see ``room.py``) and copies a step's inline loads before it
starts the step's background loads (whose promotions could evict).

Replicated KV (MLA under tensor parallelism: the latent is the same on every rank): every rank
uses rank 0's key, so one copy serves every rank; when the store is shared between the ranks (a
cache server, or only tiers shared by design: fs, redis, s3; a disk tier is a directory per
rank) only rank 0 writes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.buffers import scatter, split_segments, total_bytes
from kvtier.errors import CorruptEntry
from kvtier.fastcopy import last_level_cache_bytes, stays_cached
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.groups import FULL, STATE, GroupSpec, with_packs
from kvtier.integrations.vllm.metadata import ChunkGeometry, KVTierMetadata, KVTierWorkerMetadata, LoadSpec, SaveSpec
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, TierDeltas, tier_counters
from kvtier.integrations.vllm.pages import LoadStep, PageLayout, SaveStep
from kvtier.keys import WorkerShare, group_key
from kvtier.store import KVStore, TieredStore, WriteItem
from kvtier.tiers.base import SchedulerView

log = logging.getLogger(__name__)

# Background saves (transfer_mode async): the staging slots, one chunk each, that bound the
# backlog of chunks read from the engine but not yet in the store. As many slots as fit in
# SAVE_BACKLOG_BYTES, at most SAVE_BACKLOG_CHUNKS and at least one.
SAVE_BACKLOG_BYTES = 128 << 20
SAVE_BACKLOG_CHUNKS = 64
# A load's top-tier chunks of at least this many bytes are copied by two threads at once: a
# second thread pays only where the copy is long (on a 2-core CPU engine it shares a core with
# the engine's own OpenMP threads; 10 MB took ~2.9 ms on one thread and ~2.5 ms on two).
SPLIT_COPY_BYTES = 32 << 20
# an inline load pins at most this many bytes of top-tier entries at once (``_copy_top``): an
# entry evicted while pinned keeps its pages until the copy ends, so a promotion made meanwhile
# by another thread evicts that much more
TOP_BATCH_BYTES = 4 << 20


@dataclass
class BackgroundLoad:
    """A request's load of one pack running on the background threads: one future per chunk
    (the serving tier's name, or None when the chunk could not be loaded)."""

    loads: list[LoadSpec]  # one per group of the pack (the same chunks)
    steps: list[LoadStep]  # one per group, in the same order
    futures: list[Future] = field(default_factory=list)
    first_bad: int | None = None  # a failed chunk: later chunks are not read (worth nothing)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def tiers(self) -> list[str | None]:
        return [f.result() for f in self.futures]

    @property
    def load(self) -> LoadSpec:
        """The first group's load (its chunks, keys and request are every member's)."""
        return self.loads[0]


@dataclass
class _Landing:
    """A step's gathers (one per group of a pack) still on their way to host memory (``torch``
    copy engine): the background writer waits for them and copies chunk ``i`` into staging slot
    ``slots[i]`` (each group's part at its offset) before it writes the first of them (``land``)."""

    steps: list[tuple[SaveStep, int]]  # (a group's gather, its part's offset in the entry)
    slots: list[int]
    landed: bool | None = None  # None: not yet; True: the slots hold the chunks; False: failed

    def land(self, saves: "BackgroundSaves") -> bool:
        """Move the gathered chunks into their slots once (later calls return the outcome);
        False when that failed (the chunks are then dropped). Never raises."""
        if self.landed is None:
            try:
                for step, offset in self.steps:
                    end = offset + step._layout.chunk_bytes
                    for i, slot in enumerate(self.slots):  # on this thread: the copy threads are the step's
                        step.copy_to(i, [saves.slot(slot)[offset:end]], parallel=False)
                self.landed = True
            except Exception:
                log.exception("kvtier: a background save's copy to host failed; %d chunks dropped", len(self.slots))
                self.landed = False
            finally:
                for step, _ in self.steps:
                    try:
                        step.release()
                    except Exception:
                        log.exception("kvtier: releasing a save's staging buffer failed")
                        self.landed = False
        return self.landed


@dataclass
class _SaveJob:
    """One chunk waiting for the background writer: in its staging slot, or on its way there
    (``landing``)."""

    key: bytes  # the worker's own key (``WorkerShare.key``)
    parent: bytes | None
    chunk_index: int
    slot: int
    landing: _Landing | None = None
    size: int = 0  # the entry's bytes (0: a whole slot); a group's chunk may be smaller than a slot


_WRITER_BATCH = 16  # staged chunks the background writer hands a (non-memcpy) store at once


class BackgroundSaves:
    """Writes staged chunks into a store on one background thread (``transfer_mode: async``).

    The engine's thread ``take``s a free staging slot per chunk (None when every slot is in use:
    the caller drops the chunk), copies the chunk's bytes into ``slot(i)`` (or gives the job a
    ``_Landing`` that the writer completes first) and ``submit``s the jobs; the writer thread
    writes them into the store in order (a store whose writes are not a memcpy gets what is
    queued as one ``write_many`` batch of at most ``_WRITER_BATCH``: a cache server then reserves
    and commits them in two round trips) and frees each slot once the store has copied it. The
    backlog never exceeds the slots: nothing is queued without limit.

    Outcomes (``saved``, ``dropped``: the store refused the chunk or raised) are counted under a
    lock and handed out by ``take_outcomes`` on the engine's thread. ``close`` writes what is
    queued, then stops the thread; later ``take`` calls return None.
    """

    def __init__(self, store: KVStore, chunk_bytes: int, slots: int):
        if slots < 1 or chunk_bytes < 1:
            raise ValueError(f"need at least one slot of at least one byte, got {slots} x {chunk_bytes}")
        self._store = store
        self.chunk_bytes = chunk_bytes
        self.slots = slots
        self._buffer = np.empty(slots * chunk_bytes, dtype=np.uint8)
        self._buffer.fill(0)  # touch every page now, not in the first steps that save
        self._free = list(range(slots))
        self._queue: deque[_SaveJob] = deque()
        self._busy = 0  # jobs queued or being written
        self._outcomes = {"saved": 0, "dropped": 0, "saved_bytes": 0}
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-save", daemon=True)
        self._thread.start()

    def take(self) -> int | None:
        """A free staging slot for one chunk, or None when all are in use (or closed)."""
        with self._cond:
            if self._closed or not self._free:
                return None
            return self._free.pop()

    def give_back(self, slots: list[int]) -> None:
        """Return slots taken but not submitted (their copy failed)."""
        with self._cond:
            self._free.extend(slots)

    def slot(self, i: int) -> np.ndarray:
        """The bytes of staging slot ``i`` (one chunk)."""
        return self._buffer[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]

    def submit(self, jobs: list[_SaveJob]) -> None:
        """Queue staged chunks for the writer (their slots hold the chunks' bytes)."""
        if not jobs:
            return
        with self._cond:
            self._queue.extend(jobs)
            self._busy += len(jobs)
            self._cond.notify_all()

    def take_outcomes(self) -> dict[str, int]:
        """Chunks written (``saved``, with their ``saved_bytes``) and refused (``dropped``) since
        the last call."""
        with self._cond:
            out, self._outcomes = self._outcomes, {"saved": 0, "dropped": 0, "saved_bytes": 0}
        return out

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted chunk has been written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvtier: background saves still running after %.0f s at close", timeout)

    def _run(self) -> None:
        batch = 1 if self._store.memcpy_writes else _WRITER_BATCH  # a memcpy store gains nothing from batches
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                jobs = [self._queue.popleft() for _ in range(min(batch, len(self._queue)))]
            results = self._write(jobs)
            with self._cond:
                for job, ok in zip(jobs, results):
                    self._free.append(job.slot)
                    self._outcomes["saved" if ok else "dropped"] += 1
                    if ok:
                        self._outcomes["saved_bytes"] += job.size or self.chunk_bytes
                self._busy -= len(jobs)
                self._cond.notify_all()

    def _write(self, jobs: list[_SaveJob]) -> list[bool]:
        """Write staged chunks as one ``write_many`` batch; per job, False when its landing
        failed or the store refused it or failed (never raises: the writer must go on and free
        the slots)."""
        landed = [job.landing is None or job.landing.land(self) for job in jobs]
        items = []
        for job, ok in zip(jobs, landed):
            if ok:
                data = self.slot(job.slot)[: job.size or self.chunk_bytes]
                items.append(WriteItem(job.key, data.size, lambda segs, data=data: _fill_from(data, segs),
                                       job.parent, job.chunk_index))
        try:
            results = list(self._store.write_many(items))
            if len(results) != len(items):
                raise ValueError(f"the store answered {len(results)} results for {len(items)} chunks")
        except Exception:
            log.exception("kvtier: background save of %d chunks failed; dropped", len(items))
            results = [False] * len(items)
        stored = iter(results)
        return [ok and bool(next(stored)) for ok in landed]


def _fill_from(data: np.ndarray, segments) -> None:
    """Copy ``data`` into the store's ``segments``; ValueError unless they hold exactly it."""
    size = total_bytes(segments)
    if size != data.size:
        raise ValueError(f"store segments of {size} bytes for a chunk of {data.size}")
    scatter(data, segments)

class KVTierWorker:
    """The worker side of ``KVTierConnector`` (see the module docstring).

    vLLM calls it from the worker's engine thread; only the load threads run store reads and
    page copies beside it (``PageLayout.load`` allows that), and in ``async`` mode the save
    writer runs store writes from its staging slots (never touching the engine's pages).
    """

    def __init__(self, config: ConnectorConfig, geometry: ChunkGeometry, share: WorkerShare,
                 page_bytes: int | None = None, num_blocks: int = 0, groups: list[GroupSpec] | None = None,
                 replicated: bool = False):
        self.config = config
        self.geometry = geometry
        self.share = share
        self._num_blocks = num_blocks
        self.groups = with_packs(list(groups or []))  # vLLM's KV cache groups; none: one group of every layer
        # replicated KV (MLA under TP): every rank keys its copy as rank 0 does
        self.key_share = share.of(0, share.pp_stage) if replicated else share
        cfg = config.for_rank(share.tp_rank, share.tp_size, share.pp_stage, share.pp_size)
        cfg = cfg.with_page_size(page_bytes) if page_bytes else cfg
        # a store every rank reads the same keys of: a cache server, or only tiers shared by design
        # (fs, redis, s3); a disk tier is a directory per rank (``DiskTier.for_rank``)
        shared_store = bool(cfg.server) or all(spec.scheduler_view is SchedulerView.SHARED
                                               for spec in cfg.store.tiers)
        # one copy of replicated KV in a store the ranks share: rank 0 writes it, every rank reads it
        self._saves_on = not (replicated and share.tp_rank != 0 and shared_store)
        self.store: KVStore = self._open_store(cfg)
        self._events_owner = share.tp_rank == 0 and share.pp_stage == 0  # speaks for all workers
        if self._events_owner:
            self.store.enable_events()
        self._layouts: dict[int, PageLayout] = {}  # group -> its layers' pages
        self._pack_of: dict[int, int] = {g.index: g.pack_index for g in self.groups}  # group -> its pack
        self._members: dict[int, list[int]] = {}  # pack -> this worker's groups of it (``_index_packs``)
        self._pack_bytes: dict[int, int] = {}  # pack -> its entry's bytes on this worker
        self._kind_of: dict[int, str] = {g.index: g.kind for g in self.groups}  # group -> FULL, WINDOW, STATE
        self._failed_reqs: set[str] = set()  # several groups: loads that failed, per request
        self._load_pool: ThreadPoolExecutor | None = None
        self._background_pool: ThreadPoolExecutor | None = None  # async mode: reads off the step
        # the second half of a large top-tier copy (``_copy_local``): a thread of its own, never
        # queued behind the load threads' lower-tier reads
        self._copy_pool: ThreadPoolExecutor | None = None
        self._background: dict[str, BackgroundLoad] = {}  # request id -> its load in flight
        self._announced = False  # the one-time log line of the first background load
        self._saves: BackgroundSaves | None = None  # async mode: store writes off the step
        self._failed_blocks: set[int] = set()
        self._cache_bytes = last_level_cache_bytes()  # the CPU's last-level cache (None: unknown)
        self._reports_room = False  # see ``_room_reporting`` (set at ``register_kv_caches``)
        self._done_step = -1  # the last step (``KVTierMetadata.step``) whose saves were made
        self._stats = KVTierConnectorStats()
        self._tier_deltas = TierDeltas()  # the in-process store's tier counters, as deltas
        log.info("kvtier: worker rank %d stage %d store tiers %s", share.tp_rank, share.pp_stage,
                 self.store.tier_names)

    @property
    def _layout(self) -> PageLayout | None:
        """Group 0's page layout (the only one of a single-group engine); None before
        ``register_kv_caches``."""
        return self._layouts.get(0) or next(iter(self._layouts.values()), None)

    @_layout.setter
    def _layout(self, layout: PageLayout) -> None:
        self._layouts[0] = layout
        self._index_packs()

    def _index_packs(self) -> None:
        """Derive, from the layouts this worker holds, each pack's members (in entry order) and
        its entry's bytes; called whenever the layouts change."""
        self._members = {}
        for group in sorted(self._layouts):
            self._members.setdefault(self._pack(group), []).append(group)
        self._pack_bytes = {pack: sum(self._layouts[g].chunk_bytes for g in members)
                            for pack, members in self._members.items()}

    def _pack(self, group: int) -> int:
        """The pack (its first group's index) that group ``group`` is stored in."""
        return self._pack_of.get(group, group)

    def _key(self, key: bytes, group: int = 0) -> bytes:
        """The store key of this worker's share of group ``group``'s pack of the chunk ``key``."""
        return group_key(self.key_share.key(key), self._pack(group))

    def _entry_bytes(self, specs: list) -> int:
        """The bytes of one entry of the groups of ``specs`` (a pack's members on this worker)."""
        return sum(self._layouts[spec.group].chunk_bytes for spec in specs)

    def _joined(self, specs: list) -> list[list]:
        """``specs`` (LoadSpecs or SaveSpecs, this worker's groups only) joined per entry: the
        specs of one request's pack (and, for saves, of one chunk), in group order. A pack's
        members always carry the same chunks, keys and skipped blocks: the scheduler plans them
        by the same rule."""
        out: dict[tuple, list] = {}
        for spec in specs:
            chunk = getattr(spec, "chunk_index", None)
            out.setdefault((spec.req_id, self._pack(spec.group), chunk), []).append(spec)
        return [sorted(members, key=lambda spec: spec.group) for members in out.values()]

    def _read_entry(self, key: bytes, specs: list, fill) -> str | None:
        """``store.read(key, fill)`` of one pack's entry (``specs``: its members named by the
        plan). An entry whose size is not this worker's pack (forged, truncated, another
        layout's) is deleted, as well as refused (CorruptEntry): no load can use it, and a save
        of the recomputed chunk would keep it (a write of a key the store holds is a no-op)."""
        foreign = []

        def checked(segments) -> None:
            try:
                self._check_size(specs, segments)
            except CorruptEntry:
                foreign.append(key)
                raise
            fill(segments)

        try:
            return self.store.read(key, checked)
        except CorruptEntry:
            self._delete_foreign(foreign)
            raise

    def _check_size(self, specs: list, segments) -> None:
        """CorruptEntry unless ``segments`` hold one entry of the pack of ``specs`` (an entry of
        another size: forged, truncated, another layout's)."""
        expected = self._pack_bytes[self._pack(specs[0].group)]
        if total_bytes(segments) != expected:
            raise CorruptEntry(f"entry of {total_bytes(segments)} bytes is not one chunk of {expected}")

    def _delete_foreign(self, keys: list[bytes]) -> None:
        """Delete entries refused for their size (no load can use them, and a save of the
        recomputed chunk would keep them: a write of a key the store holds is a no-op)."""
        for key in keys:
            try:
                self.store.delete(key)
            except Exception:
                log.exception("kvtier: deleting an entry of another size failed")

    def _parts(self, specs: list, segments) -> list:
        """An entry's ``segments`` cut into each member group's part (``specs`` in entry order);
        CorruptEntry, before anything is copied, unless they hold exactly one entry."""
        sizes = [self._layouts[spec.group].chunk_bytes for spec in specs]
        if len(sizes) == 1:
            return [segments]  # the layout's own copy checks the size
        try:
            return split_segments(segments, sizes)  # checks that the parts add up, before any copy
        except ValueError as exc:
            raise CorruptEntry(f"entry is not one chunk of this pack: {exc}") from exc

    def _layout_of(self, group: int) -> PageLayout | None:
        """Group ``group``'s page layout (None: this worker holds none of its layers)."""
        return self._layouts.get(group)

    @staticmethod
    def _open_store(cfg: ConnectorConfig) -> KVStore:
        """The worker's store: a cache server's client when one is configured, else in-process."""
        if cfg.server:  # a per-node cache server owns the tiers
            from kvtier.server.client import ServerStore

            return ServerStore(cfg.server, token=cfg.server_token)
        return TieredStore.from_config(cfg.store)

    # ------------------------------------------------------------------------- engine pages

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the engine's per-layer page tensors; start the load threads, and in ``async``
        mode the background loads' threads and the save writer with its staging slots (as many
        chunks as fit in ``SAVE_BACKLOG_BYTES``, at most ``SAVE_BACKLOG_CHUNKS``)."""
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        bpc = self.geometry.blocks_per_chunk
        if len(self.groups) <= 1:
            self._layouts = {0: PageLayout(kv_caches, num_blocks, bpc)}
        else:  # one layout per group, over this worker's layers of the group (PP: a stage's share)
            for group in self.groups:
                layers = {name: kv_caches[name] for name in group.layer_names if name in kv_caches}
                if layers:
                    self._layouts[group.index] = PageLayout(layers, num_blocks, bpc)
        self._index_packs()
        if self.config.load_threads > 1:
            self._load_pool = ThreadPoolExecutor(self.config.load_threads, thread_name_prefix="kvtier-load")
        if self.config.transfer_mode == "async":
            self._background_pool = ThreadPoolExecutor(self.config.load_threads, thread_name_prefix="kvtier-bgload")
            if self._saves_copy_twice():
                chunk = max(self._pack_bytes.values())  # the largest entry
                slots = max(1, min(SAVE_BACKLOG_CHUNKS, SAVE_BACKLOG_BYTES // chunk))
                self._saves = BackgroundSaves(self.store, chunk, slots)
            else:
                log.info("kvtier: transfer_mode async: saves copy the pages straight into the store's RAM "
                         "tier within the step (one copy; the lower tiers are written in the background)")
        self._reports_room = self._room_reporting()

    def _room_reporting(self) -> bool:
        """Whether this worker reports its top tier's room each step (``room.py``): several KV
        cache groups and no state group, the only worker, its top tier an arena in this process
        and the only tier the scheduler mirrors (a chunk the mirror holds is then in the top tier:
        its load puts nothing; from a second RAM tier it would be promoted, evicting), and saves
        made within their step (not by the background writer, whose writes no step accounts for)."""
        return (len(self.groups) > 1 and all(g.kind != STATE for g in self.groups)
                and self.share.tp_size * self.share.pp_size == 1 and not self.config.server
                and self.store.memcpy_writes and self._saves is None
                and not any(tier.scheduler_view() is SchedulerView.MIRRORED for tier in self.store.tiers[1:]))

    def _saves_copy_twice(self) -> bool:
        """Whether ``async`` saves go through staging slots and the background writer. Not when
        every layout is copied by the ``host`` engine and the store's ``write`` is a memcpy into
        this process's memory: the step must read the pages itself in any case, and copying them
        straight into the store's pages is then the whole save (one copy, not two)."""
        host = all(layout.engine == "host" for layout in self._layouts.values())
        return not (host and self.store.memcpy_writes)

    # ------------------------------------------------------------------------- loads

    def begin_step(self) -> None:
        """The engine's step starts (its metadata is bound, its forward pass is next): the store's
        lower-tier writers may hold their copies until ``wait_for_save`` ends it
        (``KVStore.engine_step``)."""
        self.store.engine_step(True)

    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Copy this step's inline loads into the engine's pages (before the forward pass when
        the step has any) and start its background loads."""
        if self._layout is None or not meta.loads:
            return
        joined = self._joined([load for load in meta.loads if load.group in self._layouts])
        inline = [loads for loads in joined if not loads[0].background]
        if not self._reports_room:  # the slow reads start first
            self._start_backgrounds(joined)
        if inline:
            t0 = time.perf_counter()
            # a step's loads that fit in the cache are copied with ordinary stores: the forward
            # pass then reads them from the cache, as it reads vLLM's own recently used pages
            size = sum(len(loads[0].keys) * self._entry_bytes(loads) for loads in inline)
            stream = not stays_cached(size, self._cache_bytes)
            for loads in inline:
                self._load(loads, stream)
            self._stats.observe("load_seconds", time.perf_counter() - t0)
        if self._reports_room:  # their promotions must not evict what the inline loads copy
            self._start_backgrounds(joined)

    def _start_backgrounds(self, joined: list[list[LoadSpec]]) -> None:
        """``_start_background`` for each background load among ``joined``."""
        for loads in joined:
            if loads[0].background:
                self._start_background(loads)

    def _start_background(self, loads: list[LoadSpec]) -> None:
        """Hand a waiting request's chunks of one pack (``loads``: its groups' specs) to the
        background threads (see the module notes)."""
        pool = self._background_pool or self._start_background_pool()
        load = loads[0]
        pending = BackgroundLoad(loads, [self._layouts[m.group].begin_load(len(load.keys)) for m in loads])
        # chunks in the store's top tier are copied now, as an inline load copies them (a memcpy
        # each, no thread hand-off), unless async_ram_loads sends those to the threads too; the
        # request is still reported through get_finished, so a failure stays per request
        local = ([False] * len(load.keys) if self.config.async_ram_loads
                 else self.store.in_top_tier([self._key(k, load.group) for k in load.keys]))
        futures: list[Future | None] = [None if near else pool.submit(self._fill_chunk, pending, i)
                                        for i, near in enumerate(local)]  # the slow reads start first
        copied = self._copy_local(self._copy_thread(), lambda i: self._fill_chunk(pending, i),
                                  [i for i, near in enumerate(local) if near], self._entry_bytes(loads))
        for i, tier in copied.items():
            futures[i] = done = Future()
            done.set_result(tier)
        pending.futures = futures
        self._background[(load.req_id, self._pack(load.group))] = pending
        self._stats.count(background_loads=1)
        if not self._announced:
            self._announced = True
            log.info("kvtier: transfer_mode async: first background load (%d chunks of request %s)",
                     len(load.keys), load.req_id)

    def _start_background_pool(self) -> ThreadPoolExecutor:
        """The background threads, for a load planned in async mode by a scheduler whose
        config this worker did not read as async (never expected; loads still complete)."""
        self._background_pool = ThreadPoolExecutor(self.config.load_threads, thread_name_prefix="kvtier-bgload")
        return self._background_pool

    def _fill_chunk(self, pending: BackgroundLoad, i: int) -> str | None:
        """Background thread: read chunk ``i`` of a background load into its slot of the load
        step; the serving tier's name or None. Never raises (the load must be reported)."""
        if pending.first_bad is not None and pending.first_bad < i:
            return None  # an earlier chunk failed: this one would be recomputed anyway
        load = pending.load
        c = load.first_chunk + i
        first = load.skip_blocks if i == 0 else 0

        def fill(segments) -> None:
            for member, step, part in zip(pending.loads, pending.steps, self._parts(pending.loads, segments)):
                step.fill(i, part, self.geometry.chunk_blocks(member.block_ids, c), first)

        try:
            tier = self._read_entry(self._key(load.keys[i], load.group), pending.loads, fill)
        except CorruptEntry:  # an entry of another size: not ours to trust
            log.warning("kvtier: chunk %d of %s has an unexpected size; recomputing", c, load.req_id)
            tier = None
        except Exception:
            log.exception("kvtier: background load of chunk %d of %s failed; recomputing", c, load.req_id)
            tier = None
        if tier is None and (pending.first_bad is None or i < pending.first_bad):
            pending.first_bad = i
        return tier

    def finished_loads(self) -> set[str]:
        """Requests whose background load has ended since the last call (engine thread): the
        loaded prefix is in their pages (scattered now with the torch engine), and the blocks
        from the first failed chunk on are among ``failed_blocks``."""
        ended = [ident for ident, pending in self._background.items() if pending.done()]
        for ident in ended:
            pending = self._background.pop(ident)
            good = self._settle(pending.loads, pending.tiers())
            try:
                for step in pending.steps:
                    step.scatter(range(good))
            finally:
                for step in pending.steps:
                    step.release()
        running = {req_id for req_id, _ in self._background}
        return {req_id for req_id, _ in ended if req_id not in running}  # every group's load ended

    def failed_loads(self) -> set[str]:
        """Requests (several KV cache groups) whose load failed since the last call, once no
        load of theirs still runs (another pack's threads may still write their blocks: vLLM
        must not hear of the request before ``finished_loads`` would report it)."""
        running = {req_id for req_id, _ in self._background}
        failed = {req_id for req_id in self._failed_reqs if req_id not in running}
        self._failed_reqs -= failed
        return failed

    def _load(self, loads: list[LoadSpec], stream: bool = True) -> None:
        """Copy a request's planned chunks of one pack (``loads``: its groups' specs) into its blocks.

        Chunks in the top tier are copied inline (a memcpy each; with streaming stores unless
        ``stream`` is false, see ``_copy_top``); the others are read by the load threads at the
        same time, overlapping a lower tier's I/O. If any chunk fails, every
        block from the first failed chunk on is reported for recomputation: a chunk is worth
        nothing without the chunks before it.
        """
        load = loads[0]
        keys = [self._key(k, load.group) for k in load.keys]
        tiers: list[str | None] = [None] * len(keys)
        if self.store.reads_in_batches:  # a cache server: one round trip for the batch, copied on this thread
            self._read_many(loads, keys, tiers)
            self._settle(loads, tiers)
            return
        local = self.store.in_top_tier(keys)
        pending = {}
        if self._load_pool is not None:  # start the slow reads first, then copy the local ones
            pending = {i: self._load_pool.submit(self._load_chunk, loads, i) for i, near in enumerate(local) if not near}
        nearby = [i for i in range(len(keys)) if i not in pending]
        if not pending and all(self._layouts[m.group].engine == "host" for m in loads):
            nearby = self._copy_top(loads, keys, nearby, tiers, stream)  # the load promotes nothing itself
        copier = self._copy_thread() if self._load_pool is not None else None
        for i, tier in self._copy_local(copier, lambda i: self._load_chunk(loads, i), nearby,
                                        self._entry_bytes(loads)).items():
            tiers[i] = tier
        for i, future in pending.items():
            tiers[i] = future.result()
        self._settle(loads, tiers)

    def _read_many(self, loads: list[LoadSpec], keys: list[bytes], tiers: list[str | None]) -> None:
        """Read every chunk of one pack's load with one ``store.read_many`` and copy each into
        its pages, recording each loaded chunk's tier in ``tiers``. An entry of another size is
        left out (None) and deleted, as ``_read_entry`` does."""
        load = loads[0]
        foreign: list[bytes] = []

        def consume(i: int, segments) -> None:
            try:
                self._check_size(loads, segments)  # before any copy
                self._fill_pages(loads, i, segments)
            except CorruptEntry:
                log.warning("kvtier: chunk %d of %s has an unexpected size; recomputing", load.first_chunk + i,
                            load.req_id)
                foreign.append(keys[i])

        found = self.store.read_many(keys, consume)
        for i, tier in enumerate(found):
            tiers[i] = tier if keys[i] not in foreign else None
        self._delete_foreign(foreign)

    def _copy_top(self, loads: list[LoadSpec], keys: list[bytes], chunks: list[int],
                  tiers: list[str | None], stream: bool = True) -> list[int]:
        """``host`` engine: copy the top tier's entries of ``chunks`` (of one pack's load) into
        their pages in batches of up to ``TOP_BATCH_BYTES`` (each pinned under one hold of the
        store's lock; copied on this thread: a CPU engine's OpenMP threads hold the other cores,
        and a copy split over two threads took 3.6-3.8 ms in the engine where one took 3.3),
        recording each copied chunk's tier in ``tiers``. An entry of another size is refused and
        deleted, as ``_read_entry`` does. ``stream``: streaming stores (False: ordinary ones, for
        a step's loads that fit in the cache). Returns the chunks the top tier did not hold (left
        to per-chunk reads)."""
        left, foreign = [], []
        top = self.store.tier_names[0]
        per_batch = max(1, TOP_BATCH_BYTES // self._entry_bytes(loads))
        for start in range(0, len(chunks), per_batch):
            batch, pairs = chunks[start : start + per_batch], []
            with self.store.borrow_top([keys[i] for i in batch]) as entries:
                for i, segments in zip(batch, entries):
                    if segments is None:
                        left.append(i)
                        continue
                    try:
                        pairs.extend(self._load_pairs(loads, i, segments))
                    except CorruptEntry:
                        log.warning("kvtier: chunk %d of %s has an unexpected size; recomputing",
                                    loads[0].first_chunk + i, loads[0].req_id)
                        foreign.append(keys[i])
                        continue
                    tiers[i] = top
                if pairs:
                    self._layouts[loads[0].group].copy(pairs, split=False, stream=stream)
        self._delete_foreign(foreign)
        return left

    def _load_pairs(self, loads: list[LoadSpec], i: int, segments) -> list:
        """The page copies of the ``i``-th planned chunk of a pack's load from its entry
        (``segments``); CorruptEntry, before any copy, for an entry of another size."""
        load = loads[0]
        c = load.first_chunk + i
        first = load.skip_blocks if i == 0 else 0
        pairs = []
        # the size checks are _parts' (several groups) and the layout's (each part)
        for member, part in zip(loads, self._parts(loads, segments)):
            pairs += self._layouts[member.group].load_pairs(part, self.geometry.chunk_blocks(member.block_ids, c), first)
        return pairs

    def _copy_thread(self) -> ThreadPoolExecutor:
        """The thread that copies the second half of a large top-tier load (engine thread only)."""
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-copy-local")
        return self._copy_pool

    @staticmethod
    def _copy_local(pool: ThreadPoolExecutor | None, copy_one, chunks: list[int], entry_bytes: int) -> dict:
        """``{i: copy_one(i)}`` for the top-tier ``chunks`` (a memcpy per page each): on this thread,
        and, when they hold at least ``SPLIT_COPY_BYTES`` and ``pool`` is given, the second half of
        them on ``pool``'s thread at the same time (numpy releases the interpreter lock while it
        copies, so two cores copy at once; one thread does not reach a machine's memory bandwidth)."""
        if pool is None or len(chunks) < 2 or len(chunks) * entry_bytes < SPLIT_COPY_BYTES:
            return {i: copy_one(i) for i in chunks}
        half = chunks[len(chunks) // 2:]
        other = pool.submit(lambda: {i: copy_one(i) for i in half})
        out = {i: copy_one(i) for i in chunks[: len(chunks) // 2]}
        out.update(other.result())
        return out

    def _load_chunk(self, loads: list[LoadSpec], i: int) -> str | None:
        """Load the ``i``-th planned chunk of a pack into its groups' blocks; the serving tier's
        name or None."""
        load = loads[0]
        try:
            return self._read_entry(self._key(load.keys[i], load.group), loads,
                                    lambda segments: self._fill_pages(loads, i, segments))
        except CorruptEntry:  # an entry of another size: not ours to trust
            log.warning("kvtier: chunk %d of %s has an unexpected size; recomputing", load.first_chunk + i,
                        load.req_id)
            return None

    def _fill_pages(self, loads: list[LoadSpec], i: int, segments) -> None:
        """Copy the ``i``-th planned chunk of a pack's load (its entry's ``segments``) into its
        groups' blocks; CorruptEntry, before any copy, for an entry of another size."""
        load = loads[0]
        c, first = load.first_chunk + i, load.skip_blocks if i == 0 else 0
        for member, part in zip(loads, self._parts(loads, segments)):
            self._layouts[member.group].load(part, self.geometry.chunk_blocks(member.block_ids, c), first)

    def _settle(self, loads: list[LoadSpec], tiers: list[str | None]) -> int:
        """Count a finished load of one pack (``loads``: its groups' specs) and report the blocks
        from its first failed chunk on for recomputation; the number of chunks loaded before
        that failure."""
        load = loads[0]
        bad = next((i for i, tier in enumerate(tiers) if tier is None), len(tiers))
        entry_bytes = self._entry_bytes(loads)
        for tier, n in Counter(tiers[:bad]).items():
            self._stats.count_tier(tier, loaded_chunks=n, loaded_bytes=n * entry_bytes)
        if bad < len(tiers) and len(self.groups) > 1:  # vLLM takes such failures per request only
            if not load.background:  # the scheduler's room check rules this out (``room.py``)
                log.error("kvtier: an inline load of request %s (several KV cache groups) failed at chunk %d; "
                          "vLLM cannot recompute it", load.req_id, load.first_chunk + bad)
            self._failed_reqs.add(load.req_id)
            self._stats.count(load_error_chunks=len(tiers) - bad)
        elif bad < len(tiers):
            bpc = self.geometry.blocks_per_chunk
            first = load.skip_blocks if bad == 0 else 0
            end = (load.first_chunk + len(load.keys)) * bpc
            self._failed_blocks.update(load.block_ids[(load.first_chunk + bad) * bpc + first : end])
            self._stats.count(load_error_chunks=len(tiers) - bad)
        return bad

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------------- saves

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Save this step's completed chunks: into the store's top tier now (``sync``, and
        ``async`` without a background writer: see ``_saves_copy_twice``), or read into staging
        slots now and written into the store by the background writer (``async``; chunks that
        find no free slot are dropped and counted). Either way the engine's pages are no longer
        needed when this returns. The step ends here for the store (``engine_step``)."""
        try:
            self._save_step(meta)
        finally:
            self.store.engine_step(False)

    def _save_step(self, meta: KVTierMetadata) -> None:
        """``wait_for_save``'s copies."""
        self._done_step = meta.step
        if not self._layouts or not meta.saves or not self._saves_on:
            return
        t0 = time.perf_counter()
        by_pack: dict[int, list[list[SaveSpec]]] = {}
        for members in self._joined([save for save in meta.saves if save.group in self._layouts]):
            pack = self._pack(members[0].group)
            if [spec.group for spec in members] == self._members[pack]:
                by_pack.setdefault(pack, []).append(members)
            else:  # not every group of the pack here: a short entry no load could use
                self._stats.count(save_dropped=1)
        # full packs first: a window chunk's event chains to the full group's chunk before it, and
        # a step's events are what has been written by then (the async writer writes in order)
        for pack in sorted(by_pack, key=lambda pack: self._kind_of.get(pack) != FULL):
            mine = by_pack[pack]
            if self._saves is None:
                self._save_inline(mine)
            else:
                self._save_background(self._saves, mine)
        self._stats.observe("save_seconds", time.perf_counter() - t0)

    def _gather(self, entries: list[list[SaveSpec]]) -> list[tuple[SaveStep, int]]:
        """Start reading the pages of one pack's ``entries`` (each its groups' specs of one
        chunk): one batched gather per group (``PageLayout.gather``: O(layers) copies), with each
        group's offset in the entry. On failure the gathers already started are released."""
        steps: list[tuple[SaveStep, int]] = []
        offset = 0
        try:
            for k, spec in enumerate(entries[0]):
                layout = self._layouts[spec.group]
                steps.append((layout.gather([entry[k].block_ids for entry in entries]), offset))
                offset += layout.chunk_bytes
        except BaseException:
            for step, _ in steps:
                step.release()
            raise
        return steps

    def _save_inline(self, entries: list[list[SaveSpec]]) -> None:
        """Copy one pack's chunks' pages into the store's top tier (``sync``)."""
        size = self._entry_bytes(entries[0])
        steps = self._gather(entries)  # the step's pages

        def fill(i: int, segments) -> None:
            for (step, _), part in zip(steps, self._parts(entries[i], segments)):
                step.copy_to(i, part)

        items = []
        for i, members in enumerate(entries):
            save = members[0]
            parent = self._key(save.parent, save.group) if save.parent else None
            items.append(WriteItem(self._key(save.key, save.group), size, lambda segs, i=i: fill(i, segs),
                                   parent, save.chunk_index))
        try:  # one batch: a cache server reserves and commits the step's chunks in two round trips
            saved = sum(self.store.write_many(items))
            if saved:
                self._stats.count(saved_chunks=saved, saved_bytes=saved * size)
            if saved < len(items):
                self._stats.count(save_dropped=len(items) - saved)
        finally:
            for step, _ in steps:
                step.release()

    def _save_background(self, saves: BackgroundSaves, entries: list[list[SaveSpec]]) -> None:
        """Read one pack's chunks that get a staging slot (one batched gather per group) and
        queue them for the background writer; drop and count the others (``async``). ``host``
        engine: the pages are copied into the slots now. ``torch`` engine: the gathers are
        issued now (the pages may change once they return) and the writer lands them in the
        slots, so the step does not wait for the device-to-host copy."""
        size = self._entry_bytes(entries[0])
        jobs = self._stage_slots(saves, entries, size)
        if not jobs:
            return
        taken = [job.slot for _, job in jobs]
        try:
            steps = self._gather([members for members, _ in jobs])
            if self._layouts[entries[0][0].group].engine == "torch":
                landing = _Landing(steps, taken)
                for _, job in jobs:
                    job.landing = landing
            else:
                try:
                    for step, offset in steps:
                        end = offset + step._layout.chunk_bytes
                        for i, (_, job) in enumerate(jobs):
                            step.copy_to(i, [saves.slot(job.slot)[offset:end]])
                finally:
                    for step, _ in steps:
                        step.release()
        except BaseException:
            saves.give_back(taken)
            raise
        saves.submit([job for _, job in jobs])

    def _stage_slots(self, saves: BackgroundSaves, entries: list[list[SaveSpec]],
                     size: int = 0) -> list[tuple[list[SaveSpec], _SaveJob]]:
        """A staging slot for each entry (a chunk's specs of one pack), in order, while slots are
        free. A chunk without one is dropped with its request's later chunks of this step (a
        chunk is worth nothing without the chunks before it); every drop is counted as
        ``save_backlog_dropped``."""
        jobs: list[tuple[list[SaveSpec], _SaveJob]] = []
        broken: set[str] = set()  # requests with a dropped chunk this step
        for members in entries:
            spec = members[0]
            slot = None if spec.req_id in broken else saves.take()
            if slot is None:
                broken.add(spec.req_id)
                self._stats.count(save_backlog_dropped=1)
                continue
            parent = self._key(spec.parent, spec.group) if spec.parent else None
            jobs.append((members, _SaveJob(self._key(spec.key, spec.group), parent, spec.chunk_index, slot, size=size)))
        return jobs

    def drain_saves(self, timeout: float = 30.0) -> bool:
        """Wait until every background save has been written or dropped (True at once in
        ``sync`` mode, where saves end within their step); False on timeout."""
        return self._saves is None or self._saves.drain(timeout)

    # ------------------------------------------------------------------------- reports

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        """This step's store events for the scheduler's mirror (rank 0 of stage 0 only) and, where
        reported, the top tier's room after the last step whose saves were made, measured
        before the events are taken (``room.py``)."""
        room = self.store.top_room(max(self._pack_bytes.values())) if self._reports_room else None
        events = self.store.take_events() if self._events_owner else []
        if not events and room is None:
            return None
        return KVTierWorkerMetadata(events, self._done_step, room)

    def take_stats(self) -> KVTierConnectorStats | None:
        """This interval's counters (then reset), with the in-process store's per-tier counters
        since the last call (a cache server reports its own on its /metrics)."""
        if self._saves is not None:  # the background writer's outcomes since the last call
            done = self._saves.take_outcomes()
            self._stats.count(saved_chunks=done["saved"], saved_bytes=done.get("saved_bytes", done["saved"] * self._saves.chunk_bytes),
                              save_dropped=done["dropped"])
        if not self.config.server:
            for tier, deltas in self._tier_deltas.take(tier_counters(self.store.tiers)).items():
                self._stats.count_tier(tier, **deltas)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVTierConnectorStats()
        return stats

    def close(self) -> None:
        """Stop the load threads (background loads run to their end) and the background
        writer (queued saves are written first), drop the staging buffers, close the store."""
        if self._saves is not None:
            self._saves.close()
            self._saves = None
        for pool in (self._load_pool, self._background_pool, self._copy_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._load_pool = self._background_pool = self._copy_pool = None
        for pending in self._background.values():
            for step in pending.steps:
                step.release()
        self._background.clear()
        for layout in self._layouts.values():
            layout.close()
        self.store.close()

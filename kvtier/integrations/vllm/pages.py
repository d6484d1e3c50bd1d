"""Copies between vLLM's paged KV tensors and kvtier entries (data movement only).

Pages. Each layer's KV tensor is seen as uint8 ``[pieces, num_blocks, piece_bytes]``: on the CPU
backend (``[num_blocks, kv_heads, block_size, 2*head_size]``) and for MLA (``[num_blocks, ...]``)
a block is one piece; on CUDA FlashAttention layouts (``[2, num_blocks, ...]``) it is two pieces,
K then V. A recurrent-state layer (``[num_blocks, 1, 1, state bytes]`` over pages padded to the
attention page: a block stride larger than its state) is one piece of its state bytes; the padding
is never read or written. A piece is opaque bytes and is copied whole, so a round trip is bit-exact (on CPU a
page is K rows then V rows per block; nothing here reads that).

Entry byte order (``ENTRY_FORMAT``): block-major. An entry is ``[blocks_per_chunk, layers,
pieces, piece_bytes]``: each block's layers are contiguous, as in vLLM's own offloading since
0.12. Two consequences the copies rely on: the chunks of a step staged back to back form one
``[blocks, layers, pieces, piece_bytes]`` buffer, so a step is gathered with one indexed copy per
layer; and the blocks of a chunk that a load skips (already computed by the engine) are a prefix
of the entry. Entries written before this order (layer-major) are never read as this one: the
connector puts ``ENTRY_FORMAT`` in the key namespace, so they are misses.

Two copy engines execute the same plan (which blocks, which entry rows, in which order):

- ``torch``: indexed copies, one ``index_select`` per layer gathering every block of a step into
  a staging buffer, one ``index_copy_`` per layer scattering on load; on CUDA the staging buffer
  is on the device and crosses to pinned host memory in one ``non_blocking`` copy on a stream
  of its own (loads use a side stream). Copy calls per step: O(layers), whatever the number of
  blocks and pieces.
- ``host``: one ``memcpy`` per page with numpy, large batches split over a few threads, straight
  between the engine's pages and the entry's segments (no staging copy). The CPU default:
  measured on this project's 2-core machines, torch's CPU indexed copies reach 0.6-9 GB/s and
  collapse to 0.1-0.3 GB/s when their OpenMP threads contend with other work, while a page
  memcpy runs at memory speed; on CPU a page is a whole 128-token block (tens to hundreds of KB),
  so per-page Python overhead is small. Tests run both engines on CPU and check that they write
  the same bytes, so the CPU tests exercise the plan, ordering and error paths the GPU uses.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError, CorruptEntry
from kvtier.fastcopy import copy_pairs

ENTRY_FORMAT = "entry:block-major-v1"
ENGINES = ("host", "torch")
DEFAULT_STAGING_BYTES = 256 << 20  # per staging buffer (device and pinned host each, torch engine)
_PARALLEL_BYTES = 4 << 20  # below this one thread is as fast (thread hand-off costs ~10-50 us)


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor  # uint8 view, shape [pieces, num_blocks, piece_bytes]
    rows: torch.Tensor  # the same memory as [num_blocks, pieces, words] of the widest fitting dtype
    array: np.ndarray | None  # the uint8 view as numpy (CPU tensors only)


class PageLayout:
    """The engine's KV tensors seen as (layer, block, piece) byte ranges; copies to and from entries.

    ``save``/``load`` move one chunk; ``gather``/``begin_load`` move a step's chunks together.
    Thread safety: ``load`` and ``LoadStep.fill`` may run on several threads at once (lower-tier
    reads); ``save``, ``gather`` and ``LoadStep.scatter`` are called from the engine's thread; a
    ``SaveStep`` of the ``torch`` engine may be finished (``copy_to``, ``release``) by one other
    thread (the connector's background writer).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks_per_chunk: int,
                 copy_threads: int | None = None, engine: str | None = None,
                 max_staging_bytes: int = DEFAULT_STAGING_BYTES):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors")
        self.layers = [_wrap(name, t, num_blocks) for name, t in kv_caches.items()]
        shapes = {tuple(layer.tensor.shape) for layer in self.layers}
        if len(shapes) != 1:
            raise ConfigError(f"kvtier needs layers of one shape, got {sorted(shapes)}")
        self.pieces, self.num_blocks, self.piece_bytes = shapes.pop()
        self.blocks_per_chunk = blocks_per_chunk
        self._block_bytes = len(self.layers) * self.pieces * self.piece_bytes
        self.device = self.layers[0].tensor.device
        self.on_cpu = self.device.type == "cpu"
        # [num_blocks, piece_bytes] numpy views, in entry order within a block (layer, piece)
        self._pages = [layer.array[p] for layer in self.layers for p in range(self.pieces)] if self.on_cpu else []
        engine = engine or ("host" if self.on_cpu else "torch")
        if engine not in ENGINES or (engine == "host" and not self.on_cpu):
            raise ConfigError(f"copy engine {engine!r} is not valid for {self.device.type} tensors; valid: "
                              f"{', '.join(ENGINES) if self.on_cpu else 'torch'}")
        self.engine = engine
        # chunks staged together (torch engine): a step larger than this moves in several groups,
        # each O(layers) copies, so staging never holds more than max_staging_bytes per buffer
        self.group_chunks = max(1, max_staging_bytes // max(1, self.chunk_bytes))
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if cuda else None  # gathers, loads
        # saves' copies to host run on a stream of their own, so a step's load scatter (on the
        # side stream) never queues behind the previous step's device-to-host copy
        self._d2h_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._buffers = _Buffers(self)
        # Host copies of a large chunk are split over a few threads (copy_pairs releases the GIL while
        # copying): one thread does not reach the memory bandwidth of the machine. Only over the
        # cores this thread may run on: the copy threads inherit its affinity, and a CPU engine
        # may bind its thread to one core (vLLM's CPU worker does where libiomp or libgomp is
        # preloaded; threads sharing that core would only take turns).
        threads = copy_threads if copy_threads is not None else min(4, _usable_cpus())
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvtier-copy") if threads > 1 else None
        self._threads = threads
        # the engine's thread (it builds the layout): its unsplit copies keep the GIL, since a
        # thread that lets go of it may then wait for another (a writer) to hand it back
        self._engine_thread = threading.get_ident()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return self._block_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one entry (one chunk across every layer)."""
        return self._block_bytes * self.blocks_per_chunk

    @property
    def page_bytes(self) -> int:
        """The smallest copy unit: one (layer, block, piece) byte range."""
        return self.piece_bytes

    # ------------------------------------------------------------------ one chunk (connector API)

    def save(self, block_ids: Sequence[int], segments: Sequence) -> None:
        """Copy the pages of ``block_ids`` (one chunk) into the entry ``segments``."""
        step = self.gather([block_ids])
        try:
            step.copy_to(0, segments)
        finally:
            step.release()

    def load(self, segments: Sequence, block_ids: Sequence[int], first: int = 0) -> None:
        """Copy an entry into the pages of ``block_ids``, skipping the chunk's first ``first`` blocks.

        Skipped blocks are already computed by the engine (a local prefix-cache hit that ends
        inside the chunk); they may be shared with other requests and are never written.
        CorruptEntry, before any page is written, unless ``segments`` hold exactly one chunk.
        """
        step = self.begin_load(1)
        try:
            step.fill(0, segments, block_ids, first)
            step.scatter()
        finally:
            step.release()

    def load_pairs(self, segments: Sequence, block_ids: Sequence[int], first: int = 0) -> list:
        """``host`` engine: the (page, entry piece) copies that ``load`` makes, not yet made (so
        that many chunks' copies run as one batch, ``copy``). The same checks first:
        CorruptEntry unless ``segments`` hold exactly one chunk, ValueError for bad blocks."""
        if self.engine != "host":
            raise ValueError("load_pairs is for the host copy engine")
        return self._page_pairs(block_ids, self._load_arrays(segments, block_ids, first), first, to_entry=False)

    def copy(self, pairs: list, split: bool = True, stream: bool = True) -> None:
        """Make ``load_pairs``' copies (of any layouts' pages): split over the copy threads when
        they are large and ``split``, else on this thread without letting go of the GIL (the
        engine's thread: had it released the GIL, it could wait for another thread to hand it
        back after the copy); an unsplit copy uses streaming stores unless ``stream`` is false
        (``copy_pairs``), a split one always does."""
        if split:
            self._copy(pairs)
        else:
            copy_pairs(pairs, release_gil=False, stream=stream)

    # ------------------------------------------------------------------ a step's chunks

    def gather(self, chunks: Sequence[Sequence[int]]) -> "SaveStep":
        """Start copying the pages of a step's chunks (each a list of ``blocks_per_chunk`` block ids).

        ``torch`` engine: one indexed copy per layer into a device staging buffer (on CUDA on a
        side stream that first waits for the compute stream) and one copy to host (pinned on
        CUDA, ``non_blocking`` on a stream of its own that waits only for the gather, so later
        loads on the side stream do not queue behind it). ``host`` engine: nothing yet;
        ``SaveStep.copy_to`` copies pages straight into the entry.

        When the pages may change: ``torch`` engine, at once (on CPU the gather has completed when
        this returns; on CUDA the compute stream waits for the gather's device copies, so work it
        runs later, such as the next forward pass reusing these blocks, cannot overwrite a page
        before it is read; the copy to host may still run, and ``copy_to``/``wait`` wait for it,
        from any thread). ``host`` engine: only after the last ``copy_to``.
        """
        chunks = [list(c) for c in chunks]
        for blocks in chunks:
            self._check_blocks(blocks)
        step = SaveStep(self, chunks)
        if self.engine == "torch" and chunks:
            step._start()
        return step

    def begin_load(self, n_chunks: int) -> "LoadStep":
        """A batch of up to ``n_chunks`` chunk loads: ``fill`` each, then ``scatter`` once."""
        return LoadStep(self, n_chunks)

    # ------------------------------------------------------------------ internals

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        if len(blocks) != self.blocks_per_chunk:
            raise ValueError(f"a chunk has {self.blocks_per_chunk} blocks, got {len(blocks)}")
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside [0, {self.num_blocks})")

    def _load_arrays(self, segments: Sequence, block_ids: Sequence[int], first: int) -> list[np.ndarray]:
        """A load's checks, before anything is copied (``first`` in range, valid blocks, one
        chunk of whole pieces), then the entry's segments as flat uint8 arrays."""
        if not 0 <= first <= self.blocks_per_chunk:
            raise ValueError(f"first={first} outside [0, {self.blocks_per_chunk}]")
        self._check_blocks(block_ids)
        return self._arrays(segments)

    def _arrays(self, segments: Sequence) -> list[np.ndarray]:
        """Entry segments as flat uint8 arrays; CorruptEntry (an entry of another size is not
        this engine's chunk) unless they hold exactly one chunk of whole pieces."""
        arrays = [_as_array(seg) for seg in segments]
        size = self.piece_bytes
        total = sum(a.size for a in arrays)
        if total != self.chunk_bytes or any(a.size % size for a in arrays):
            raise CorruptEntry(f"entry of {total} bytes is not one chunk of {self.chunk_bytes}")
        return arrays

    def _page_pairs(self, block_ids: Sequence[int], arrays: list[np.ndarray], first: int,
                    to_entry: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """(dst, src) page pairs between the pages of ``block_ids[first:]`` and the entry, in
        entry order (block, layer, piece)."""
        pieces = _pieces(arrays, self.piece_bytes, skip=first * len(self._pages))
        pages = [page[block] for block in block_ids[first:] for page in self._pages]
        return list(zip(pieces, pages) if to_entry else zip(pages, pieces))

    def _copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``dst[:] = src[:]`` for each pair (``copy_pairs``); large batches are split over the
        copy threads. Unsplit on the engine's thread, the copy keeps the GIL (``copy``)."""
        if self._pool is None or sum(src.nbytes for _, src in pairs) < _PARALLEL_BYTES:
            copy_pairs(pairs, release_gil=threading.get_ident() != self._engine_thread)
            return
        n = self._threads
        pairs = _split_large(pairs, n)
        futures = [self._pool.submit(copy_pairs, pairs[i::n]) for i in range(1, n)]
        copy_pairs(pairs[0::n])
        for future in futures:
            future.result()

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        """An int64 index tensor on the engine's device. On CUDA one small ``non_blocking`` copy
        from pinned memory on the current stream (call it on the side stream: a pageable copy
        would wait for the compute stream's queued work)."""
        index = torch.tensor(list(ids), dtype=torch.int64)
        return index if self.on_cpu else index.pin_memory().to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the copy threads and drop the staging buffers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers.clear()


class SaveStep:
    """The pages of a step's chunks on their way out (see ``PageLayout.gather``)."""

    def __init__(self, layout: PageLayout, chunks: list[list[int]]):
        self._layout = layout
        self._chunks = chunks
        self._groups: list[_Group] = []  # torch engine: chunks [g * group_chunks, ...) each

    def _start(self) -> None:
        layout, size = self._layout, self._layout.group_chunks
        for first in range(0, len(self._chunks), size):
            blocks = [b for chunk in self._chunks[first : first + size] for b in chunk]
            group = _Group(layout._buffers.take(len(blocks)))
            self._groups.append(group)
            staging = group.staging
            with _on_side_stream(layout) as stream:
                index = layout._index(blocks)
                for i, layer in enumerate(layout.layers):  # one indexed copy per layer
                    torch.index_select(layer.rows, 0, index, out=staging.device[: len(blocks), i])
                gathered = _event(stream)  # the pages are no longer read after this point
            if gathered is None:  # CPU: the gather is done and staging is host memory
                continue
            # later work on the compute stream (the next forward pass, which may reuse these
            # blocks) waits for the gather, not for the copy to host
            torch.cuda.current_stream(layout.device).wait_event(gathered)
            d2h = layout._d2h_stream
            d2h.wait_event(gathered)
            with torch.cuda.stream(d2h):  # one device-to-host copy for the group
                staging.host[: len(blocks)].copy_(staging.device[: len(blocks)], non_blocking=True)
            group.record(d2h, blocking=True)  # waited for by the writer thread: sleep, not spin

    def ready(self) -> bool:
        """Whether the gather has completed (never blocks)."""
        return all(group.ready() for group in self._groups)

    def wait(self) -> None:
        """Block until the gather has completed; the pages may change after this."""
        for group in self._groups:
            group.wait()

    def copy_to(self, i: int, segments: Sequence, parallel: bool = True) -> None:
        """Copy chunk ``i``'s entry bytes into ``segments`` (CorruptEntry, before any byte is
        copied, unless they hold exactly one chunk). ``parallel=False``: on the calling thread
        only (a background caller must not queue work ahead of the engine's own copies on the
        layout's copy threads)."""
        layout = self._layout
        arrays = layout._arrays(segments)
        copy = layout._copy if parallel else copy_pairs
        if not self._groups:  # host engine: straight from the pages
            copy(layout._page_pairs(self._chunks[i], arrays, 0, to_entry=True))
            return
        group = self._groups[i // layout.group_chunks]
        group.wait()
        j, bpc = i % layout.group_chunks, layout.blocks_per_chunk
        copy(_split_copy(arrays, group.staging.host_bytes(j * bpc, (j + 1) * bpc), to_segments=True))

    def release(self) -> None:
        """Return the staging buffers (waits for the gather first)."""
        for group in self._groups:
            group.wait()
            self._layout._buffers.give(group.staging)
        self._groups = []


def _event(stream):
    """An event recorded on ``stream`` now (None on CPU, where copies are synchronous)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _Group:
    """One staging buffer in use and the event that marks its copies done (CUDA)."""

    def __init__(self, staging: "_Staging"):
        self.staging = staging
        self.event = None

    def record(self, stream, blocking: bool = False) -> None:
        """Mark the group's copies queued so far on ``stream`` (CUDA; nothing on CPU).
        ``blocking``: ``wait`` sleeps until they complete instead of spinning (for waits off
        the engine's thread)."""
        if stream is not None:
            self.event = torch.cuda.Event(blocking=blocking)
            self.event.record(stream)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class LoadStep:
    """A batch of chunk loads (see ``PageLayout.begin_load``): ``fill`` each chunk (from any
    thread), then ``scatter`` once from the engine's thread, then ``release``.

    ``torch`` engine: slots are staged in groups of ``layout.group_chunks`` chunks, each group's
    staging buffer taken when its first slot is filled; ``scatter`` moves each group with one
    host-to-device copy and one indexed copy per layer."""

    def __init__(self, layout: PageLayout, n_chunks: int):
        self._layout = layout
        self._n = n_chunks
        self._filled: dict[int, tuple[list[int], int]] = {}  # chunk slot -> (block ids, first)
        self._groups: dict[int, _Group] = {}
        self._lock = threading.Lock()

    def _group(self, g: int) -> "_Group":
        with self._lock:
            group = self._groups.get(g)
            if group is None:  # staging for the chunks this group holds, not a full group
                size = self._layout.group_chunks
                chunks = min(size, self._n - g * size)
                group = self._groups[g] = _Group(self._layout._buffers.take(chunks * self._layout.blocks_per_chunk))
            return group

    def fill(self, i: int, segments: Sequence, block_ids: Sequence[int], first: int = 0) -> None:
        """Take chunk ``i``'s entry (``segments``) for the pages of ``block_ids[first:]``.

        ``host`` engine: the pages are written now; ``torch`` engine: the bytes go to the staging
        buffer and the pages are written by ``scatter``. Before anything is copied: CorruptEntry
        unless the segments hold exactly one chunk, ValueError unless the blocks are valid.
        """
        layout = self._layout
        if not 0 <= i < self._n:
            raise IndexError(f"chunk slot {i} outside [0, {self._n})")
        if layout.engine == "host":
            layout.copy(layout.load_pairs(segments, block_ids, first))
        else:
            arrays = layout._load_arrays(segments, block_ids, first)
            staging = self._group(i // layout.group_chunks).staging
            j, bpc = i % layout.group_chunks, layout.blocks_per_chunk
            dst = staging.host_bytes(j * bpc + first, (j + 1) * bpc)
            layout._copy(_split_copy(arrays, dst, to_segments=False, skip=first * layout.block_bytes))
        with self._lock:
            self._filled[i] = (list(block_ids), first)

    def scatter(self, slots: Iterable[int] | None = None) -> None:
        """Write the staged chunks ``slots`` (default: every filled one) into their pages: per
        group one host-to-device copy and one indexed copy per layer (``torch`` engine); returns
        once the pages hold the bytes (the compute stream also waits for them). Nothing to do
        for the ``host`` engine, whose ``fill`` wrote the pages."""
        layout = self._layout
        if layout.engine == "host":
            return
        with self._lock:
            chosen = sorted(self._filled if slots is None else set(slots) & set(self._filled))
            plan = [(i, self._filled[i]) for i in chosen]
            groups = dict(self._groups)
        size = layout.group_chunks
        for g, group in sorted(groups.items()):
            _scatter_group(layout, group, [(i - g * size, f) for i, f in plan if i // size == g])

    def release(self) -> None:
        """Return the staging buffers."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.wait()
            self._layout._buffers.give(group.staging)


def _scatter_group(layout: PageLayout, group: "_Group", plan: list[tuple[int, tuple[list[int], int]]]) -> None:
    """One group's staged chunks into their pages: (slot in group, (block ids, first)) each."""
    bpc = layout.blocks_per_chunk
    rows = [j * bpc + k for j, (blocks, first) in plan for k in range(first, bpc)]
    dst = [blocks[k] for _, (blocks, first) in plan for k in range(first, bpc)]
    if not rows:
        return
    staging = group.staging
    with _on_side_stream(layout) as stream:
        dst_index = layout._index(dst)
        top = rows[-1] + 1
        if staging.host is not staging.device:  # one host-to-device copy for the group
            staging.device[:top].copy_(staging.host[:top], non_blocking=True)
        src = staging.device[:top]
        if rows != list(range(len(rows))):  # skipped blocks or empty slots: compact once
            src = src.index_select(0, layout._index(rows))
        for li, layer in enumerate(layout.layers):  # one indexed copy per layer
            layer.rows.index_copy_(0, dst_index, src[:, li])
        group.record(stream)
        if stream is not None:
            torch.cuda.current_stream(layout.device).wait_event(group.event)
    group.wait()


@dataclass
class _Staging:
    """A staging area of ``blocks`` entry blocks: ``device`` (engine device) and ``host``
    (pinned on CUDA; the same tensor as ``device`` on CPU), both ``[blocks, layers, pieces, words]``."""

    blocks: int
    device: torch.Tensor
    host: torch.Tensor
    host_u8: np.ndarray  # host as flat uint8 numpy

    def host_bytes(self, start_block: int, end_block: int) -> np.ndarray:
        """The host bytes of entry blocks ``[start_block, end_block)``, flat uint8."""
        per = self.host_u8.size // self.blocks
        return self.host_u8[start_block * per : end_block * per]


class _Buffers:
    """Reused staging areas (thread-safe): ``take`` one at least n blocks large, ``give`` it back."""

    def __init__(self, layout: PageLayout):
        self._layout = layout
        self._free: list[_Staging] = []
        self._lock = threading.Lock()

    def take(self, blocks: int) -> _Staging:
        with self._lock:
            for k, staging in enumerate(self._free):
                if staging.blocks >= blocks:
                    return self._free.pop(k)
        return self._make(max(blocks, 1))

    def give(self, staging: _Staging) -> None:
        with self._lock:
            self._free.append(staging)
            self._free.sort(key=lambda s: s.blocks)
            del self._free[:-2]  # keep the two largest

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def _make(self, blocks: int) -> _Staging:
        layout = self._layout
        row = layout.layers[0].rows
        shape = (blocks, len(layout.layers), *row.shape[1:])
        device = torch.empty(shape, dtype=row.dtype, device=layout.device)
        host = device if layout.on_cpu else torch.empty(shape, dtype=row.dtype, pin_memory=True)
        return _Staging(blocks, device, host, host.view(-1).view(torch.uint8).numpy())


class _on_side_stream:
    """Context: run on the layout's side stream after the compute stream's queued work (CUDA);
    nothing on CPU. Yields the stream (or None)."""

    def __init__(self, layout: PageLayout):
        self._stream = layout._stream
        self._ctx = None

    def __enter__(self):
        if self._stream is None:
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        self._ctx = torch.cuda.stream(self._stream)
        self._ctx.__enter__()
        return self._stream

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _wrap(name: str, t: torch.Tensor, num_blocks: int) -> _Layer:
    """View a layer's KV tensor as uint8 ``[pieces, num_blocks, piece_bytes]`` (and wide rows)."""
    if t.dim() >= 1 and t.shape[0] == num_blocks:
        block_dim = 0
    elif t.dim() >= 2 and t.shape[1] == num_blocks:
        block_dim = 1
    else:
        raise ConfigError(f"layer {name}: cannot find the block dimension in shape {tuple(t.shape)}")
    if t.is_contiguous():
        pre = int(np.prod(t.shape[:block_dim])) if block_dim else 1
        u8 = t.view(torch.uint8).reshape(pre, num_blocks, -1)
    elif block_dim == 0 and t.dim() >= 2 and t[0].is_contiguous() and t.stride(0) >= t[0].numel():
        # blocks of padded pages (vLLM's recurrent state: [num_blocks, ..., state bytes] with a
        # block stride of the group's padded page size): a page is each block's leading bytes
        item = t.element_size()
        page, stride = t[0].numel() * item, t.stride(0) * item
        storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        u8 = storage.as_strided((1, num_blocks, page), (num_blocks * stride, stride, 1), t.storage_offset() * item)
    else:
        raise ConfigError(f"layer {name}: KV tensor is not contiguous; kvtier copies whole pages")
    word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if u8.shape[2] % d.itemsize == 0)
    rows = u8.transpose(0, 1).view(word)  # [num_blocks, pieces, words]: wide elements copy faster
    array = u8.numpy() if t.device.type == "cpu" else None
    return _Layer(name, u8, rows, array)


def _as_array(seg) -> np.ndarray:
    """A segment as a flat uint8 numpy array (no copy)."""
    if isinstance(seg, np.ndarray):
        return seg.reshape(-1).view(np.uint8)
    return np.frombuffer(seg, dtype=np.uint8)


def _pieces(arrays: list[np.ndarray], size: int, skip: int = 0) -> list[np.ndarray]:
    """Piece-sized views of the segments, in entry order, from the ``skip``-th piece on
    (every segment holds whole pieces)."""
    return [a[off : off + size] for a in arrays for off in range(0, a.size, size)][skip:]


def _split_copy(arrays: list[np.ndarray], flat: np.ndarray, to_segments: bool,
                skip: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(dst, src) pairs between the entry's segments and ``flat``, which holds the entry's bytes
    from offset ``skip`` on."""
    pairs, pos = [], 0
    for a in arrays:
        lo, hi = max(pos, skip), pos + a.size
        if lo < hi:
            seg, part = a[lo - pos : hi - pos], flat[lo - skip : hi - skip]
            pairs.append((seg, part) if to_segments else (part, seg))
        pos = hi
    return pairs


def _usable_cpus() -> int:
    """The CPUs the calling thread may run on (its affinity where the OS reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _split_large(pairs: list[tuple[np.ndarray, np.ndarray]], n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The same copies with every pair larger than 1/n of the total cut into n parts, so that
    n threads share the bytes evenly."""
    limit = max(1, sum(src.nbytes for _, src in pairs) // n)
    out = []
    for dst, src in pairs:
        if src.nbytes <= limit:
            out.append((dst, src))
            continue
        step = -(-src.size // n)
        out.extend((dst[k : k + step], src[k : k + step]) for k in range(0, src.size, step))
    return out

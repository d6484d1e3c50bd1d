"""Copies between vLLM's paged KV tensors and kvtier entries (data movement only).

An entry holds the KV of one chunk: for each layer (in registration order), for each of the
chunk's blocks, the block's bytes in that layer. A block's bytes are treated as opaque: on the
CPU backend a layer tensor is ``[num_blocks, ...]`` and a block is one contiguous page; on CUDA
FlashAttention layouts (``[2, num_blocks, ...]``) a block is two pieces, K then V. Whatever the
layout, each piece is copied whole, so a round trip is bit-exact.

Entry segments handed out by the store are uint8 arrays whose concatenation is the entry; each
segment is a whole number of pieces (the connector sizes the RAM arena's pages to the engine's
page size), so every piece maps to one slice of one segment and is copied with one memcpy.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor  # uint8 view, shape [pieces, num_blocks, piece_bytes]
    array: np.ndarray | None  # the same memory as numpy (CPU tensors only)


class PageLayout:
    """The engine's KV tensors seen as (layer, block, piece) byte ranges."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks_per_chunk: int,
                 copy_threads: int | None = None):
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache tensors")
        self.layers = [self._wrap(name, t, num_blocks) for name, t in kv_caches.items()]
        shapes = {tuple(layer.tensor.shape) for layer in self.layers}
        if len(shapes) != 1:
            raise ConfigError(f"kvtier needs layers of one shape, got {sorted(shapes)}")
        self.pieces, self.num_blocks, self.piece_bytes = shapes.pop()
        self.blocks_per_chunk = blocks_per_chunk
        self.device = self.layers[0].tensor.device
        self.on_cpu = self.device.type == "cpu"
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        # Host copies of a large chunk are split over a few threads (numpy releases the GIL while
        # copying): one thread does not reach the memory bandwidth of the machine.
        threads = copy_threads if copy_threads is not None else min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvtier-copy") if threads > 1 else None
        self._threads = threads

    @staticmethod
    def _wrap(name: str, t: torch.Tensor, num_blocks: int) -> _Layer:
        """View a layer's KV tensor as uint8 ``[pieces, num_blocks, piece_bytes]``."""
        if t.dim() >= 1 and t.shape[0] == num_blocks:
            block_dim = 0
        elif t.dim() >= 2 and t.shape[1] == num_blocks:
            block_dim = 1
        else:
            raise ConfigError(f"layer {name}: cannot find the block dimension in shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ConfigError(f"layer {name}: KV tensor is not contiguous; kvtier copies whole pages")
        pre = int(np.prod(t.shape[:block_dim])) if block_dim else 1
        u8 = t.view(torch.uint8).reshape(pre, num_blocks, -1)
        array = u8.numpy() if t.device.type == "cpu" else None
        return _Layer(name, u8, array)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return len(self.layers) * self.pieces * self.piece_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one entry (one chunk across every layer)."""
        return self.block_bytes * self.blocks_per_chunk

    @property
    def page_bytes(self) -> int:
        """The copy unit: one (layer, block, piece) byte range."""
        return self.piece_bytes

    def _pieces(self, segments: Sequence) -> Iterator[np.ndarray]:
        """Split entry segments into piece-sized uint8 views, in entry order.

        ValueError (before anything is copied) unless the segments hold exactly one chunk.
        """
        size = self.piece_bytes
        arrays = [seg if isinstance(seg, np.ndarray) else np.frombuffer(seg, dtype=np.uint8) for seg in segments]
        if sum(a.size for a in arrays) != self.chunk_bytes or any(a.size % size for a in arrays):
            raise ValueError(f"entry of {sum(a.size for a in arrays)} bytes is not one chunk of {self.chunk_bytes}")
        return (a[off : off + size] for a in arrays for off in range(0, a.size, size))

    def _order(self, block_ids: Sequence[int]):
        """(layer, piece, block) triples in entry order, paired with the block's index in the chunk."""
        for layer in self.layers:
            for j, block in enumerate(block_ids):
                for p in range(self.pieces):
                    yield layer, p, j, block

    def save(self, block_ids: Sequence[int], segments: Sequence) -> None:
        """Copy the pages of ``block_ids`` (one chunk) into the entry ``segments``."""
        dst = self._pieces(segments)
        if self.on_cpu:
            self._copy([(next(dst), layer.array[p, block]) for layer, p, _, block in self._order(block_ids)])
            return
        with torch.cuda.stream(self._stream):
            for layer, p, _, block in self._order(block_ids):
                torch.from_numpy(next(dst)).copy_(layer.tensor[p, block], non_blocking=True)
        self._stream.synchronize()

    def load(self, segments: Sequence, block_ids: Sequence[int], first: int = 0) -> None:
        """Copy an entry into the pages of ``block_ids``, skipping the chunk's first ``first`` blocks.

        Skipped blocks are already computed by the engine (a local prefix-cache hit that ends
        inside the chunk); they may be shared with other requests and are never written.
        """
        src = self._pieces(segments)
        if self.on_cpu:
            pairs = [(layer.array[p, block], piece)
                     for (layer, p, j, block), piece in zip(self._order(block_ids), src) if j >= first]
            self._copy(pairs)
            return
        with torch.cuda.stream(self._stream):
            for layer, p, j, block in self._order(block_ids):
                piece = next(src)
                if j >= first:
                    layer.tensor[p, block].copy_(torch.from_numpy(piece), non_blocking=True)
        self._stream.synchronize()

    def _copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for each pair; large batches are split over the copy threads."""
        if self._pool is None or len(pairs) < 2 or sum(src.nbytes for _, src in pairs) < _PARALLEL_BYTES:
            for dst, src in pairs:
                np.copyto(dst, src)
            return
        n = self._threads
        futures = [self._pool.submit(_copy_all, pairs[i::n]) for i in range(1, n)]
        _copy_all(pairs[0::n])
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the copy threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


_PARALLEL_BYTES = 4 << 20  # below this one thread is as fast (thread hand-off costs ~10-50 us)


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)

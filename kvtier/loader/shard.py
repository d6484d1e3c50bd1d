"""Tensor-parallel shards: read one rank's slice of each tensor, and write a pre-sharded layout.

``rank_slice`` splits a dim evenly; ``default_tp_dim`` knows the Llama/Qwen-family rule
(column-parallel projections and embeddings split along dim 0, row-parallel ``o_proj`` and
``down_proj`` along dim 1, everything else replicated). ``write_presharded`` writes
``model-rank-{rank}-part-{part}.safetensors`` so each rank later reads only its own files; the
files are written header-first and filled tensor by tensor, so memory stays bounded by the
reader's ``memory_limit`` whatever the model size.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from kvtier.errors import LoaderError
from kvtier.loader.header import DTYPES, TensorInfo
from kvtier.loader.reader import ReaderConfig, SliceSpec, StreamReader

_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|embed_tokens|lm_head)\.(weight|bias)$")
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")


def default_tp_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """The dim a tensor is split along under tensor parallelism, or None when replicated."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name) and len(shape) == 2:
        return 1
    return None


def rank_slice(size: int, rank: int, world: int, name: str = "tensor") -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s even share of ``size``; LoaderError if it does not divide."""
    if world < 1 or not 0 <= rank < world:
        raise LoaderError(f"rank {rank} is not in a world of size {world}")
    if size % world:
        raise LoaderError(f"{name}: dim of size {size} does not split evenly over {world} ranks")
    part = size // world
    return rank * part, (rank + 1) * part


def rank_slices(rank: int, world: int,
                dim_of: Callable[[str, tuple[int, ...]], int | None] = default_tp_dim
                ) -> Callable[[TensorInfo], SliceSpec | None]:
    """A ``slices`` function for ``StreamReader.stream`` selecting ``rank``'s share of each tensor."""
    def pick(info: TensorInfo) -> SliceSpec | None:
        dim = dim_of(info.name, info.shape)
        if dim is None or world == 1:
            return None
        start, stop = rank_slice(info.shape[dim], rank, world, info.name)
        return dim, start, stop
    return pick


@dataclass(frozen=True)
class _Spec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is known up front, in any order.

    The header goes first; ``write(name, tensor)`` puts each tensor's bytes at its offset. The
    file appears under its final name only on ``close()`` after every tensor was written
    (temp file + ``os.replace``); ``abort()`` removes it. Not thread-safe.
    """

    def __init__(self, path: str, specs: Iterable[_Spec], metadata: Mapping[str, str] | None = None):
        self.path = path
        self._tmp = f"{path}.tmp.{os.getpid()}"
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._offsets: dict[str, tuple[int, _Spec]] = {}
        pos = 0
        for s in specs:
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
            self._offsets[s.name] = (pos, s)
            pos += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as safetensors does
        self._data_start = 8 + len(raw)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
        os.ftruncate(self._fd, self._data_start + pos)
        self._left = set(self._offsets)

    def write(self, name: str, tensor) -> None:
        import torch

        pos, spec = self._offsets[name]
        flat = tensor.contiguous().cpu().reshape(-1)
        data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        if len(data) != spec.nbytes:
            raise LoaderError(f"{self.path}: tensor {name!r} has {len(data)} bytes, expected {spec.nbytes}")
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], self._data_start + pos + done)
        self._left.discard(name)

    def close(self) -> None:
        if self._left:
            self.abort()
            raise LoaderError(f"{self.path}: {len(self._left)} tensors never written (e.g. {min(self._left)!r})")
        os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        os.close(self._fd)
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


def shard_file_name(rank: int, part: int) -> str:
    """vLLM's pre-sharded file name pattern."""
    return f"model-rank-{rank}-part-{part}.safetensors"


def write_presharded(files: list[str], out_dir: str, world: int, config: ReaderConfig | None = None,
                     max_part_bytes: int = 5 * 1000**3,
                     dim_of: Callable[[str, tuple[int, ...]], int | None] = default_tp_dim,
                     on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Write each rank's slices of ``files`` to ``out_dir``; return the written paths.

    Tensor names are kept; each rank file holds that rank's slice (or a full copy of a
    replicated tensor). Raises LoaderError when a split dim does not divide by ``world``.
    """
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    with StreamReader(files, config) as reader:
        for rank in range(world):
            pick = rank_slices(rank, world, dim_of)
            parts: list[list[_Spec]] = [[]]
            size = 0
            for name, (_, info) in sorted(reader.index.items(), key=lambda kv: (kv[1][0], kv[1][1].start)):
                spec = pick(info)
                shape = info.shape if spec is None else (
                    info.shape[:spec[0]] + (spec[2] - spec[1],) + info.shape[spec[0] + 1:])
                nbytes = DTYPES[info.dtype][0]
                for d in shape:
                    nbytes *= d
                if parts[-1] and size + nbytes > max_part_bytes:
                    parts.append([])
                    size = 0
                parts[-1].append(_Spec(name, info.dtype, shape, nbytes))
                size += nbytes
            meta = {"format": "pt", "kvtier_tp_world": str(world), "kvtier_tp_rank": str(rank)}
            writers = {}
            where = {}
            try:
                for part, specs in enumerate(parts):
                    path = os.path.join(out_dir, shard_file_name(rank, part))
                    writers[part] = SafetensorsWriter(path, specs, meta)
                    where.update({s.name: part for s in specs})
                for name, tensor in reader.stream(slices=pick, on_bytes=on_bytes):
                    writers[where[name]].write(name, tensor)
                for part, w in writers.items():
                    w.close()
                    written.append(w.path)
            except BaseException:
                for w in writers.values():
                    if os.path.exists(w._tmp):
                        w.abort()
                raise
    return written

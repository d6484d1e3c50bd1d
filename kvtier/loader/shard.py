"""Tensor-parallel shards: read one rank's slice of a tensor, and find one rank's files in a
pre-sharded layout.

``rank_slice`` splits a dim evenly; ``default_tp_dim`` knows the Llama/Qwen-family rule
(column-parallel projections and embeddings split along dim 0, row-parallel ``o_proj`` and
``down_proj`` along dim 1, everything else replicated).

vLLM's pre-sharded layout (its ``sharded_state`` load format; written by ``kvtier shard``) holds
each rank's own parameters, under the engine's parameter names, in
``model-rank-{rank}-part-{part}.safetensors`` (or ``model-pp-{pp}-tp-{tp}-part-{part}`` with
pipeline parallelism). ``ShardedLayout`` finds it among a directory's file names and hands each
rank its own files, after checking that the layout was cut for the engine's world size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kvtier.errors import LoaderError
from kvtier.loader.header import TensorInfo
from kvtier.loader.reader import SliceSpec

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


_TP_ONLY = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")
_PP_AND_TP = re.compile(r"model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors")
MANIFEST_NAME = "kvtier-shard.json"


def shard_file_name(rank: int, part: int, pp_rank: int | None = None) -> str:
    """vLLM's pre-sharded file name (the pipeline-parallel form when ``pp_rank`` is given)."""
    if pp_rank is None:
        return f"model-rank-{rank}-part-{part}.safetensors"
    return f"model-pp-{pp_rank}-tp-{rank}-part-{part}.safetensors"


def rank_file(name: str) -> tuple[int, int, int, bool] | None:
    """``(pp_rank, tp_rank, part, pipeline_form)`` of a pre-sharded file name, else None."""
    if m := _TP_ONLY.fullmatch(name):
        return 0, int(m[1]), int(m[2]), False
    if m := _PP_AND_TP.fullmatch(name):
        return int(m[1]), int(m[2]), int(m[3]), True
    return None


@dataclass(frozen=True)
class ShardedLayout:
    """The pre-sharded files of one directory: ``files[(pp_rank, tp_rank)]`` in part order."""

    files: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    pipeline: bool = False

    @property
    def tp_size(self) -> int:
        return 1 + max(tp for _, tp in self.files)

    @property
    def pp_size(self) -> int:
        return 1 + max(pp for pp, _ in self.files)

    @classmethod
    def find(cls, names: Iterable[str], where: str = "model") -> "ShardedLayout | None":
        """The layout among ``names`` (base names), or None when none of them is a rank file.

        Raises LoaderError when the layout is incomplete: a rank or a part missing, or both file
        name forms mixed, since loading such a directory would silently miss weights.
        """
        parts: dict[tuple[int, int], dict[int, str]] = {}
        forms = set()
        for name in names:
            where_in = rank_file(name)
            if where_in is None:
                continue
            pp, tp, part, pipeline = where_in
            forms.add(pipeline)
            parts.setdefault((pp, tp), {})[part] = name
        if not parts:
            return None
        if len(forms) > 1:
            raise LoaderError(f"{where}: holds both model-rank-* and model-pp-* files; keep one layout")
        layout = cls({k: [v[p] for p in sorted(v)] for k, v in parts.items()}, pipeline=forms.pop())
        for pp in range(layout.pp_size):
            for tp in range(layout.tp_size):
                got = parts.get((pp, tp))
                if not got:
                    raise LoaderError(f"{where}: pre-sharded layout lacks the files of "
                                      f"{'pp rank %d, ' % pp if layout.pipeline else ''}tp rank {tp}")
                if sorted(got) != list(range(len(got))):
                    missing = min(set(range(max(got) + 1)) - set(got))
                    raise LoaderError(f"{where}: {got[max(got)]} is there but part {missing} of that rank is not")
        return layout

    def rank_files(self, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1,
                   where: str = "model") -> list[str]:
        """The base names rank ``(pp_rank, tp_rank)`` reads; LoaderError if cut for another world."""
        if (self.tp_size, self.pp_size) != (tp_size, pp_size):
            raise LoaderError(
                f"{where}: pre-sharded for tensor_parallel_size={self.tp_size}"
                f"{', pipeline_parallel_size=%d' % self.pp_size if self.pipeline else ''}, but the engine runs "
                f"tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size}; "
                f"re-shard with: kvtier shard MODEL --tp {tp_size} --out DIR")
        return list(self.files[(pp_rank, tp_rank)])

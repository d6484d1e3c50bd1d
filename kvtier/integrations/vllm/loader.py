"""vLLM load format ``kvtier``: weights streamed by kvtier's concurrent reader.

    vllm serve MODEL --load-format kvtier --model-loader-extra-config '{"concurrency": 16}'

MODEL is a local directory. vLLM 0.32 refuses an ``s3://`` MODEL for any load format but its
own object-storage ones, so remote weights are named in the extra config instead: MODEL is a
local directory holding the config files, and ``weights_uri`` (``s3://bucket/prefix/``) is
streamed straight from S3, or pulled once into the node-local cache first when ``cache_dir``
is set. (``kvtier pull`` prints the cached directory, which also works as MODEL:
``vllm serve "$(kvtier pull s3://bucket/model/)" --load-format kvtier``.)

A directory in vLLM's pre-sharded layout (``model-rank-{rank}-part-{part}.safetensors``, written
by ``kvtier shard`` or vLLM's ``save_sharded_state``) is detected: each rank then streams only its
own files and copies them into its parameters by name, as vLLM's ``sharded_state`` format does.
With ``save_shards_to: DIR`` each rank also writes its parameters there in that layout once they
are loaded, before the platform repacks them (vLLM's CPU backend drops linear weights after
packing them, so its own ``save_sharded_state`` on a running engine misses them); ``kvtier shard``
is built on this.
Extra-config keys are those of ``KVTierLoadOptions``; an unknown key is rejected with the
list of valid ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from kvtier.config import Size, build
from kvtier.errors import LoaderError
from kvtier.loader.cache import resolve
from kvtier.loader.reader import ReaderConfig, StreamReader, join_uri, list_dir, model_files
from kvtier.loader.shard import ShardedLayout, rank_file
from kvtier.loader.sources import scheme_of

logger = init_logger("vllm.kvtier.loader")  # under "vllm", so vLLM's log handlers show our INFO lines
MiB = 1024 * 1024


@dataclass(frozen=True)
class KVTierLoadOptions:
    """``--model-loader-extra-config`` of the kvtier load format."""

    concurrency: int = 0
    block_size: Size = Size(16 * MiB)
    memory_limit: Size = Size(1024 * MiB)
    check_values: bool = False
    cache_dir: str | None = None
    endpoint_url: str | None = None
    device: str = "cpu"
    weights_uri: str | None = None
    local_mode: str = "auto"
    save_shards_to: str | None = None
    max_part_size: Size = Size(5 * 1000**3)

    def reader_config(self) -> ReaderConfig:
        return ReaderConfig(concurrency=self.concurrency, block_size=self.block_size,
                            memory_limit=self.memory_limit, check_values=self.check_values,
                            device=self.device, endpoint_url=self.endpoint_url, local_mode=self.local_mode)


class KVTierModelLoader(BaseModelLoader):
    """Streams safetensors weights with many large concurrent reads (local disk or S3)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = build(KVTierLoadOptions, load_config.model_loader_extra_config or {},
                             "model_loader_extra_config")
        self.reader_config = self.options.reader_config()

    def _weights_dir(self, model_config: ModelConfig) -> str:
        """The local directory or ``s3://`` prefix the weights are read from (after the node cache)."""
        uri = self.options.weights_uri or model_config.model_weights or model_config.model
        if scheme_of(uri) == "file" and not os.path.exists(uri):
            raise LoaderError(f"{uri}: the kvtier load format reads a local directory or an s3:// URI")
        return resolve(uri, self.options.cache_dir, **self._pull_kwargs())

    def _pull_kwargs(self) -> dict:
        from kvtier.loader.sources.s3 import S3Config

        return {"source_kwargs": {"config": S3Config(endpoint_url=self.options.endpoint_url)}}

    def download_model(self, model_config: ModelConfig) -> None:
        """Pull an s3:// model into the node cache (when one is configured)."""
        self._weights_dir(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Stream this rank's weights into ``model``: its own files of a pre-sharded layout, else
        every tensor of the checkpoint through ``model.load_weights`` in completion order."""
        base = self._weights_dir(model_config)
        layout = None
        if not base.endswith(".safetensors"):
            layout = ShardedLayout.find(list_dir(base, self.options.endpoint_url), where=base)
        if layout is not None:
            self._load_sharded(model, base, layout)
        else:
            self._load_checkpoint(model, model_config, base)
        if self.options.save_shards_to:
            self._save_shards(model, self.options.save_shards_to)

    def _load_checkpoint(self, model: nn.Module, model_config: ModelConfig, base: str) -> None:
        """Stream every tensor of the checkpoint through ``model.load_weights``."""
        files = model_files(base, self.options.endpoint_url)
        wanted = {name for name, _ in model.named_parameters()}
        with StreamReader(files, self.reader_config) as reader:
            logger.info("kvtier: streaming %d files (%.2f GB), concurrency %d",
                        len(files), reader.total_bytes() / 1e9, reader.concurrency)
            loaded = model.load_weights(reader.stream())
        if model_config.quantization is None and loaded is not None:
            missing = wanted - set(loaded)
            if missing:
                raise ValueError(f"kvtier: weights not found in the checkpoint: {sorted(missing)[:5]}")

    def _load_sharded(self, model: nn.Module, base: str, layout: ShardedLayout) -> None:
        """Copy this rank's pre-sharded tensors into the parameters of the same name.

        Every parameter (tied ones once, as vLLM saves them) must be in the rank's files with the
        parameter's shape, or a prefix of it (vLLM pads some parameters, e.g. for LoRA).
        """
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.model_loader import ShardedStateLoader

        tp_rank, pp = get_tensor_model_parallel_rank(), get_pp_group()
        names = layout.rank_files(tp_rank, get_tensor_model_parallel_world_size(), pp.rank_in_group, pp.world_size,
                                  where=base)
        files = [join_uri(base, n) for n in names]
        # the tensors vLLM's save_model writes: one of each group sharing storage (tied weights)
        dedup = getattr(ShardedStateLoader, "_filter_subtensors", lambda tensors: tensors)
        params = dedup(model.state_dict())
        with StreamReader(files, self.reader_config) as reader:
            logger.info("kvtier: rank %d streaming its %d pre-sharded files (%.2f GB), concurrency %d",
                        tp_rank, len(files), reader.total_bytes() / 1e9, reader.concurrency)
            for name, tensor in reader.stream():
                param = params.pop(name, None)
                if param is None:
                    raise LoaderError(f"{base}: {name!r} in rank {tp_rank}'s files is not a parameter of this model")
                _copy_into(param.data, tensor, name)
        if params:
            raise LoaderError(f"{base}: rank {tp_rank}'s files lack {len(params)} parameters, e.g. {min(params)!r}")

    def _save_shards(self, model: nn.Module, out: str) -> None:
        """Write this rank's parameters to ``out`` in vLLM's pre-sharded layout, readable by all
        as the umask allows (safetensors creates its files 0600, which other users and pods
        serving the directory could not read)."""
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.model_loader import ShardedStateLoader

        os.makedirs(out, exist_ok=True)
        ShardedStateLoader.save_model(model, out, max_size=self.options.max_part_size)
        rank = (get_pp_group().rank_in_group, get_tensor_model_parallel_rank())
        mode = 0o666 & ~_umask()
        for name in os.listdir(out):
            found = rank_file(name)
            if found is not None and found[:2] == rank:
                os.chmod(os.path.join(out, name), mode)
        logger.info("kvtier: rank %d saved its shards to %s", rank[1], out)


def _umask() -> int:
    """This process's umask, read from /proc without changing it (other threads of the worker
    may be creating files); where /proc lacks it, set and put back at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _copy_into(param, tensor, name: str) -> None:
    """Copy ``tensor`` into the leading corner of ``param``; LoaderError when it does not fit."""
    if tensor.dim() != param.dim() or any(t > p for t, p in zip(tensor.shape, param.shape)):
        raise LoaderError(f"{name}: shard has shape {tuple(tensor.shape)}, the parameter {tuple(param.shape)}")
    for dim, size in enumerate(tensor.shape):
        if size < param.shape[dim]:
            param = param.narrow(dim, 0, size)
    param.copy_(tensor)

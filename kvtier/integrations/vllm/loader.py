"""vLLM load format ``kvtier``: weights streamed by kvtier's concurrent reader.

    vllm serve MODEL --load-format kvtier --model-loader-extra-config '{"concurrency": 16}'

MODEL is a local directory. vLLM 0.32 refuses an ``s3://`` MODEL for any load format but its
own object-storage ones, so remote weights are named in the extra config instead: MODEL is a
local directory holding the config files, and ``weights_uri`` (``s3://bucket/prefix/``) is
streamed straight from S3, or pulled once into the node-local cache first when ``cache_dir``
is set. (``kvtier pull`` prints the cached directory, which also works as MODEL.)
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
from kvtier.loader.reader import ReaderConfig, StreamReader, model_files
from kvtier.loader.sources import scheme_of

logger = init_logger(__name__)
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

    def _files(self, model_config: ModelConfig) -> list[str]:
        uri = self.options.weights_uri or model_config.model_weights or model_config.model
        if scheme_of(uri) == "file" and not os.path.exists(uri):
            raise LoaderError(f"{uri}: the kvtier load format reads a local directory or an s3:// URI")
        local = resolve(uri, self.options.cache_dir, **self._pull_kwargs())
        return model_files(local, self.options.endpoint_url)

    def _pull_kwargs(self) -> dict:
        from kvtier.loader.sources.s3 import S3Config

        return {"source_kwargs": {"config": S3Config(endpoint_url=self.options.endpoint_url)}}

    def download_model(self, model_config: ModelConfig) -> None:
        """Pull an s3:// model into the node cache (when one is configured) and list its files."""
        self._files(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Stream every tensor into ``model.load_weights`` in completion order."""
        files = self._files(model_config)
        wanted = {name for name, _ in model.named_parameters()}
        with StreamReader(files, self.reader_config) as reader:
            logger.info("kvtier: streaming %d files (%.2f GB), concurrency %d",
                        len(files), reader.total_bytes() / 1e9, reader.concurrency)
            loaded = model.load_weights(reader.stream())
        if model_config.quantization is None and loaded is not None:
            missing = wanted - set(loaded)
            if missing:
                raise ValueError(f"kvtier: weights not found in the checkpoint: {sorted(missing)[:5]}")

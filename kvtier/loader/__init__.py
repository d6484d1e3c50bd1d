"""Streaming safetensors loader: validated headers, file/S3 sources, a concurrent reader,
per-rank shards, a node-local cache of remote models and a read-throughput probe.

    from kvtier.loader import ReaderConfig, StreamReader, model_files
    with StreamReader(model_files("s3://bucket/model/"), ReaderConfig(concurrency=16)) as r:
        for name, tensor in r.stream():   # completion order; the caller owns each tensor
            ...

Importing this package does not import torch or boto3; they are imported on first use.

Modules: ``header`` (safetensors headers, sharded indexes), ``sources/`` (file, s3), ``reader``
(``StreamReader``), ``shard`` (per-rank slices), ``cache`` (node-local copies), ``probe``.

Imports: ``kvtier.config``, ``kvtier.errors``, ``kvtier.registry``, ``kvtier.fileio``,
``kvtier.s3client``; never the KV store, its tiers or policies, the server, vLLM or the CLI.
"""

from kvtier.loader.header import Header, TensorInfo, parse_header, read_file_header
from kvtier.loader.reader import ReaderConfig, StreamReader, load_tensors, model_files, slice_ranges

__all__ = [
    "Header",
    "TensorInfo",
    "parse_header",
    "read_file_header",
    "ReaderConfig",
    "StreamReader",
    "load_tensors",
    "model_files",
    "slice_ranges",
]

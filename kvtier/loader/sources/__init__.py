"""Loader sources, one per file, found by URI scheme through the shared Registry.

- ``base.py``: ``Source`` (``size``, ``read_into``; ``read`` and ``list_dir`` built on them).
- ``file.py``: local files through ``kvtier.fileio``; ``s3.py``: ranged GETs through a client
  from ``kvtier.s3client`` (boto3 imported when first used).

Imports: ``kvtier.registry``, ``kvtier.fileio``, ``kvtier.s3client``, ``kvtier.errors``.
"""

from __future__ import annotations

from kvtier.loader.sources.base import Source
from kvtier.registry import Registry

SOURCES: Registry[Source] = Registry("loader source", {
    "file": "kvtier.loader.sources.file:FileSource",
    "s3": ("kvtier.loader.sources.s3:S3Source", "install boto3 with `pip install kvtier[s3]`"),
})


def scheme_of(uri: str) -> str:
    """``s3://b/k`` -> ``s3``; a plain path or ``file://`` -> ``file``."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else "file"


def source_class(uri: str) -> type[Source]:
    """The Source class for ``uri``'s scheme (ConfigError listing the schemes otherwise)."""
    return SOURCES.get(scheme_of(uri))


def open_source(uri: str, **kwargs) -> Source:
    """Open ``uri`` with the backend for its scheme."""
    return source_class(uri)(uri, **kwargs)


__all__ = ["Source", "SOURCES", "open_source", "scheme_of", "source_class"]

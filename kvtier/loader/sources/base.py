"""The loader's source protocol: random-access reads of one object (a file, an S3 object).

A backend implements ``size`` and ``read_into``; everything else (``read``, the header, the
streaming reader) is built on those two. ``version`` names the content a source reads (an S3
ETag, pinned when the size is first asked): every later read is of that content or fails with
``VersionChanged``, never a mix of two versions. ``list_dir`` lists a directory or prefix of such
objects. Sources are thread-safe: the streaming reader calls ``read_into`` from many threads.
"""

from __future__ import annotations

import abc
from typing import Sequence

from kvtier.errors import LoaderError


class Source(abc.ABC):
    """One readable object, named by ``uri``. Holds resources: ``close()`` or use ``with``."""

    #: Concurrency the reader uses when the caller does not choose one.
    default_concurrency: int = 16

    def __init__(self, uri: str):
        self.uri = uri

    @abc.abstractmethod
    def size(self) -> int:
        """Size of the object in bytes."""

    @abc.abstractmethod
    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order with the bytes starting at ``offset`` (one contiguous range).

        Raises LoaderError on a short read or after retries are exhausted. Thread-safe.
        """

    def version(self) -> str | None:
        """The pinned identity of the object's content (S3: its ETag, taken once with the size);
        None when the source cannot tell (then only the size is known to be stable)."""
        return None

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (for headers and small reads)."""
        buf = bytearray(length)
        if length:
            self.read_into(offset, [memoryview(buf)])
        return bytes(buf)

    @classmethod
    def list_dir(cls, uri: str) -> list[tuple[str, int]]:
        """``(relative name, size)`` of every object directly under the directory/prefix ``uri``."""
        raise LoaderError(f"{uri}: listing is not supported by {cls.__name__}")

    def close(self) -> None:
        """Release connections/file descriptors (idempotent)."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class VersionChanged(LoaderError):
    """The object was replaced after its version was pinned (S3: If-Match failed, or another
    ETag came back): the bytes read so far belong to a version that no longer exists."""


def short_read(uri: str, offset: int, wanted: int, got: int) -> LoaderError:
    """The error for a read that ended early (the object shrank or lied about its size)."""
    return LoaderError(f"{uri}: short read at offset {offset} ({got} of {wanted} bytes)")

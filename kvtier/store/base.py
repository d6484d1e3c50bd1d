"""KVStore: the one interface of a KV chunk store, in-process (``TieredStore``) or through a
per-node server (``kvtier.server.client.ServerStore``).

A few methods are abstract; the conveniences (``get``, ``get_into``, ``put``, ``__contains__``,
``in_top_tier``, the context manager) are built on them, as fsspec builds its file system on a
handful of primitives. Callers (the vLLM connector, the server) speak only this interface.

Contract shared by every implementation:
- A key is a ``KEY_BYTES``-byte digest. A miss is a value: ``read`` returns None, ``write``
  False, ``lookup`` a shorter count. A storage fault is a counted miss, never an exception.
- ``read`` hands the payload to ``consume`` as a list of read-only uint8 segments, valid only
  during the call; an exception from ``consume`` propagates. ``write`` hands ``fill`` writable
  segments of ``nbytes`` in all; ``fill`` must only copy.
- Every method may be called from any thread.
- ``read_many``/``write_many`` are ``read``/``write`` of several chunks; a store that pays a round
  trip per call (the cache server's client) answers a batch in one (``reads_in_batches``).

Imports: ``kvtier.buffers``, ``kvtier.keys``, ``kvtier.store.events``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from kvtier.buffers import BufferTooSmall, byte_view, gather, gather_into, scatter
from kvtier.keys import Key
from kvtier.store.events import StoreEvent

Segments = list
# A fill/consume callback gets the entry's bytes as a list of writable/readable uint8 segments
# whose concatenation is the payload, valid only during the call.
Fill = Callable[[Segments], None]
Consume = Callable[[Segments], None]


class WriteItem(NamedTuple):
    """One chunk of a ``write_many`` batch: ``write``'s arguments."""

    key: Key
    nbytes: int
    fill: Fill
    parent: Key | None = None
    chunk_index: int = 0


class KVStore(ABC):
    """A store of KV chunks under chunk keys (see the module contract)."""

    # ----------------------------------------------------------------------------- primitives

    @abstractmethod
    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` the store holds (a chain is worth its leading run only).
        No side effects on what is kept; an invalid key ends the run like a missing one."""

    @abstractmethod
    def read(self, key: Key, consume: Consume) -> str | None:
        """Hand ``key``'s payload to ``consume``; the name of the tier that served it, or None
        on a miss (absent, corrupt, a fault, not a chunk key)."""

    @abstractmethod
    def write(self, key: Key, nbytes: int, fill: Fill, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a chunk of ``nbytes`` that ``fill`` copies in. ``parent`` is the previous
        chunk's key in its prefix chain (None for the first), ``chunk_index`` its position.
        True if the store holds the entry afterwards (also when it already did)."""

    @abstractmethod
    def delete(self, key: Key) -> bool:
        """Remove ``key`` from every tier (copies of it under way do not bring it back);
        False when the store could not be reached."""

    @abstractmethod
    def take_events(self) -> list[StoreEvent]:
        """Events recorded since the last call (each event is handed out once)."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters of the store and of each tier (a snapshot)."""

    @abstractmethod
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued lower-tier writes are done; False on timeout or fault."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; further calls are not allowed."""

    @property
    @abstractmethod
    def tier_names(self) -> list[str]:
        """Names of the tiers, fastest first (for logs)."""

    # ----------------------------------------------------------------------------- built on them

    def enable_events(self, maxlen: int = 100_000) -> None:
        """Start recording events for ``take_events`` (stores that always record: nothing)."""

    def engine_step(self, running: bool) -> None:
        """The engine's step (its forward pass) starts (True) or ends (False), for stores whose
        background writers yield to it (``StoreConfig.writer_step_wait_s``). By default: nothing."""

    @property
    def reads_in_batches(self) -> bool:
        """Whether ``read_many`` costs less than a ``read`` per key (one round trip for the
        batch: the cache server's client). By default: not."""
        return False

    def read_many(self, keys: Sequence[Key], consume: Callable[[int, Segments], None]) -> list[str | None]:
        """``read`` of each of ``keys``: ``consume(i, segments)`` gets the ``i``-th key's payload
        (segments valid only during the call); per key, the serving tier's name or None (a miss).
        An exception from ``consume`` propagates. By default one ``read`` per key, in order."""
        return [self.read(key, lambda segments, i=i: consume(i, segments)) for i, key in enumerate(keys)]

    def write_many(self, items: Sequence[WriteItem]) -> list[bool]:
        """Store several chunks; for each item, what ``write`` would return for it.

        Stores that pay a round trip per write (the cache server's client) batch them; by
        default each item is one ``write``, in order. An exception from a ``fill`` propagates:
        items before it may be stored, it and the items after it are not.
        """
        return [self.write(item.key, item.nbytes, item.fill, item.parent, item.chunk_index) for item in items]

    def put_many(self, items: Sequence[tuple[Key, Any]]) -> list[bool]:
        """Store a copy of each ``(key, data)`` (bytes-like ``data``; no parent, chunk index 0)
        through ``write_many``."""
        batch = []
        for key, data in items:
            src = byte_view(data)
            batch.append(WriteItem(key, src.size, lambda segments, src=src: scatter(src, segments)))
        return self.write_many(batch)

    def in_top_tier(self, keys: Sequence[Key]) -> list[bool]:
        """For each key, whether it is a memcpy away now (the store's top tier in this
        process). No side effects. By default: none is."""
        return [False] * len(keys)

    @property
    def memcpy_writes(self) -> bool:
        """Whether ``write`` is a copy into this process's memory: no I/O and no round trip on
        the caller's thread (lower tiers, if any, are written in the background). By default:
        not."""
        return False

    @contextmanager
    def borrow_top(self, keys: Sequence[Key]) -> Iterator[list[Any]]:
        """For each of ``keys``, its payload's segments where the store's top tier holds it in
        this process's memory (else None), all pinned until the ``with`` block ends: read them in
        the block, never after. Counted as ``read`` counts a top-tier hit; a key without
        segments is left to ``read``. By default: no top tier in this process's memory."""
        yield [None] * len(keys)

    def top_room(self, nbytes: int) -> int | None:
        """How many more entries of ``nbytes`` the top tier takes now without evicting anything
        (None: not known in this process). By default: not known."""
        return None

    def get_into(self, key: Key, out: Any) -> int | None:
        """Copy ``key``'s payload into the writable buffer ``out``; the byte count or None.

        A buffer smaller than the entry is a miss (None, counted as an error); ``out`` is then
        left untouched.
        """
        written = 0

        def consume(segments: Segments) -> None:
            nonlocal written
            written = gather_into(segments, out)

        try:
            found = self.read(key, consume)
        except BufferTooSmall:
            self._count_error()
            return None
        return written if found is not None else None

    def get(self, key: Key) -> bytes | None:
        """The payload of ``key`` as new bytes, or None."""
        chunks: list[bytes] = []
        found = self.read(key, lambda segments: chunks.append(gather(segments)))
        return chunks[0] if found is not None else None

    def put(self, key: Key, data: Any, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a copy of the bytes-like ``data`` (see ``write``)."""
        src = byte_view(data)
        return self.write(key, src.size, lambda segments: scatter(src, segments), parent, chunk_index)

    def __contains__(self, key: Key) -> bool:
        return self.lookup([key]) == 1

    def _count_error(self) -> None:
        """Count one caller-side error (a buffer too small); implementations keep counters."""

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

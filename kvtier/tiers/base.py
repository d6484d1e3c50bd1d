"""The tier protocol: storage of opaque payloads under 32-byte chunk keys.

A tier moves data; it does not decide what to evict. For tiers the store manages
(``self_managed = False``: ram, disk) the store keeps the index and the eviction policy and
makes room before each ``put``. Shared tiers that other processes or machines also write
(redis, s3, fs) set ``self_managed = True`` and enforce their own byte budget.

Contract for every implementation:
- A miss is a value: ``get_into`` returns ``None`` for an absent key, for an entry that fails
  its checksum or does not parse (counted in ``stats.corrupt`` and removed), and for a tier
  fault (counted in ``stats.errors``). It never raises for those, and never returns wrong bytes.
- ``put`` stores a copy of the caller's bytes and returns True, or returns False (counted) when
  it could not. Putting an existing key again is allowed and leaves one complete entry.
- A key is a ``KEY_BYTES``-byte digest; any other key is a caller's mistake: ``InvalidKey`` (a
  ValueError, from ``kvtier.entry.check_key``), never a crash deeper down or a stored entry.
- No allocation is sized from a stored header alone: a header whose length exceeds
  ``max_entry_bytes`` (by default what the tier can hold) is a corrupt entry (counted, removed, a
  miss), as is one that does not match the stored size.
- All methods are thread-safe.

Capabilities are declared on the class, never guessed from a tier's type name elsewhere:
- ``scheduler_view()``: how a process that does not own the tier (vLLM's scheduler) learns what
  it holds: ``MIRRORED`` from the owner's store events (process-private memory), ``PROBED``
  through a lookup-only ``scheduler_probe`` (a directory), ``SHARED`` by opening the tier itself
  (a server other processes write too). A store-managed tier must declare it (ConfigError).
- ``for_rank(config, share)``: one worker's configuration when tensor/pipeline-parallel workers
  each own a store (split a process-local capacity, give each its own directory).
- ``for_engine_pages(config, page_bytes, given)``: the configuration fitted to an engine's page
  size (options the user gave, ``given``, are kept).
- The RAM arena's zero-copy methods form ``kvtier.tiers.ram.ArenaTier``.

Imports: ``kvtier.keys``, ``kvtier.entry``, ``kvtier.config``, ``kvtier.errors`` only.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Iterable, Iterator, Protocol

from kvtier.entry import EntryAuth, check_key, decode, decode_header, seal
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.fileio import parse_mode, resolve_group
from kvtier.keys import Key
# The entry bound of a tier with no byte budget: Redis's own limit on one value (512 MB).
UNBOUNDED_ENTRY_BYTES = 512 * 1024**2


@dataclass
class TierStats:
    """Counters of one tier. Increment through ``add`` (thread-safe)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt: int = 0
    errors: int = 0
    dropped: int = 0
    evictions: int = 0
    coded: int = 0  # entries this tier's codec stored coded (lossless or fp8); the rest are raw
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add each named delta to its counter atomically."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        """A snapshot of the counters."""
        with self._lock:
            # not dataclasses.asdict: it deep-copies every field, and a lock cannot be copied
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class SchedulerView(Enum):
    """How a process that does not own a tier learns which keys it holds."""

    MIRRORED = "mirrored"  # process-private: known only from the owning store's events
    PROBED = "probed"  # visible to other processes: asked through ``Tier.scheduler_probe``
    SHARED = "shared"  # shared by design: the other process opens the tier and asks it


class Probe(Protocol):
    """A lookup-only view of a tier (``contains_many`` and ``close``)."""

    def contains_many(self, keys: Iterable[Key]) -> list[bool]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RankShare:
    """One worker among ``world`` tensor-parallel ranks x ``stages`` pipeline stages."""

    rank: int
    world: int
    stage: int = 0
    stages: int = 1

    @property
    def workers(self) -> int:
        """Workers that each own a store (a process-local capacity is split over them)."""
        return self.world * self.stages

    @property
    def subdir(self) -> str:
        """This worker's own subdirectory name: ``tp{world}-rank{rank}``, or with several
        stages ``pp{stages}-stage{stage}-tp{world}-rank{rank}``."""
        tp = f"tp{self.world}-rank{self.rank}"
        return tp if self.stages == 1 else f"pp{self.stages}-stage{self.stage}-{tp}"


LOCAL = "LOCAL"  # a tier's ``locality``: only the engine whose store owns it loads from it
REMOTE = "REMOTE"  # ... or: shared, every engine that opens it loads from it (vLLM's words)


class Tier(ABC):
    """Base class of every tier. Subclasses implement the abstract methods; the rest is built on them.

    What a tier class declares (the registry checks a plugin's declarations when it loads it):
    - ``Config``: its typed config dataclass; ``kvtier.config.build`` makes it from the tier's
      options (unknown keys rejected), and the registry opens the tier as ``cls(config, name=...)``.
    - ``medium``: kvtier's name of its medium, upper case (``CPU``, ``DISK``, ``FS``, ``REDIS``,
      ``S3``): what store events, metrics and the router's weights name, and the tier in a KV
      event's ``ownership`` (``kvtier:<medium>``).
    - ``kv_event_medium``: the medium of its KV events in vLLM's vocabulary (``CPU``, ``STORAGE``).
    - ``locality``: ``LOCAL`` (only the owning engine loads it) or ``REMOTE`` (shared: every
      engine loads it; its blocks count for all engines), as vLLM's KV events say it.
    """

    Config: ClassVar[type]  # the typed config dataclass (declared by every concrete tier)
    medium: ClassVar[str] = "CPU"  # kvtier's medium name: CPU, DISK, FS, REDIS, S3
    kv_event_medium: ClassVar[str] = "CPU"  # vLLM's KV event medium: CPU or STORAGE
    locality: ClassVar[str] = LOCAL  # LOCAL or REMOTE (shared by every engine)
    self_managed: ClassVar[bool] = False  # True: the tier enforces its own capacity

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        put = cls.__dict__.get("put")
        if put is not None and not getattr(put, "__isabstractmethod__", False) and not hasattr(put, "__wrapped__"):
            cls.put = _timed_put(put)  # an ``auto`` codec learns the tier's bandwidth from its puts
        get_into = cls.__dict__.get("get_into")
        if (get_into is not None and not getattr(get_into, "__isabstractmethod__", False)
                and not hasattr(get_into, "__wrapped__")):
            cls.get_into = _timed_get(get_into)  # ... and from its reads

    def __init__(self, config: Any, name: str):
        """Open the tier described by ``config`` (an instance of ``Config``, already built and
        range-checked by ``kvtier.config.build``) under ``name`` (the spec's ``name``, which
        counters and errors show). A tier that cannot start now raises ``TierUnavailable``; a
        configuration mistake it finds raises ``ConfigError`` naming ``name``. Subclasses call
        ``super().__init__(config, name)`` first."""
        self.config = config
        self.name = name
        self.stats = TierStats()
        self.auth: EntryAuth | None = None  # set by the store (``set_auth``); None: unauthenticated
        self._codec_lock = threading.Lock()  # resolves ``codec`` once

    def set_auth(self, auth: EntryAuth | None) -> None:
        """Authenticate every entry this tier writes with ``auth`` and accept only entries that
        carry its valid tag (None: write untagged entries, accept only those). Called by the store
        before the tier is used."""
        self.auth = auth

    @property
    def codec(self):
        """The ``kvtier.codecs.Codec`` this tier codes its entries with (its config's ``codec``),
        or None (stored raw). Resolved once, under a lock: a put and a stats read racing to
        resolve it see the same codec (for ``auto``, the same ``AutoChoice``)."""
        try:
            return self._codec
        except AttributeError:
            pass
        with self._codec_lock:
            try:
                return self._codec
            except AttributeError:
                pass
            name = getattr(getattr(self, "config", None), "codec", "none")
            codec = auto = None
            if name != "none":
                from kvtier.codecs import AutoChoice, get_codec

                codec = get_codec(name, f"tier {self.name}.codec")
                if name == "auto":
                    auto = AutoChoice(codec)
                    auto.link_probe = self._probe_reads
                    codec = _AutoCodec(auto)
            self._auto = auto
            self._codec = codec  # last: a reader that sees it sees _auto too
            return codec

    @property
    def serves_lossy(self) -> bool:
        """Whether this tier serves lossy (fp8) entries: only when its own codec is lossy. A
        tier of exact KV counts one as corrupt (a miss), so lossy KV never reaches a reader
        that did not ask for it, whoever wrote it under its keys."""
        return bool(getattr(self.codec, "lossy", False))

    def codec_state(self) -> dict:
        """The tier's codec setting and, for ``auto``, the current choice and its inputs (tier
        bandwidth, codec speeds and ratio, counts of coded and raw puts): for metrics."""
        name = getattr(getattr(self, "config", None), "codec", "none")
        self.codec  # resolve
        auto = getattr(self, "_auto", None)
        return {"codec": name, **(auto.state() if auto is not None else {})}

    def _probe_reads(self, nbytes: int) -> list[tuple[int, float]]:
        """An ``auto`` codec's read probe (``AutoChoice.probe_link``): two raw entries, of
        ``nbytes`` and of a sixteenth of it (at least 4 KiB), put under random keys, each read
        back ``PROBE_READS`` times in turn and deleted; [(bytes, seconds)] with the fastest read
        of each size twice (the link as it is when nothing else waits: a read slowed by a busy
        core says nothing of the link). [] when the tier has no room for both beside what it
        holds (a probe must never evict an entry) or refuses or loses either. They are real
        operations of the tier, counted in its stats (2 puts, 6 hits, 2 deletes); a fault
        that stops the deletes leaves two entries under random keys that nothing reads, which
        the tier's capacity policy (or ``ttl_s``) removes in time."""
        import hashlib
        import os

        sizes = (max(4096, nbytes // 16), nbytes)
        capacity = self.capacity_bytes
        if capacity > 0 and capacity - self.used_bytes() < 2 * sum(sizes):
            return []
        get_into = type(self).get_into
        get_into = getattr(get_into, "__wrapped__", get_into)  # untimed: the probe is fitted here
        keys = [hashlib.sha256(b"kvtier read probe" + os.urandom(16)).digest() for _ in sizes]
        best = [math.inf, math.inf]
        buffer = bytearray(max(sizes))
        try:
            for key, size in zip(keys, sizes):
                if not self.put(key, os.urandom(size)):
                    return []
            for _ in range(PROBE_READS):
                for i, (key, size) in enumerate(zip(keys, sizes)):
                    start = time.perf_counter()
                    if get_into(self, key, buffer) != size:
                        return []
                    best[i] = min(best[i], time.perf_counter() - start)
        finally:
            for key in keys:
                self.delete(key)
        return [(sizes[0], best[0]), (sizes[1], best[1])] * 2

    # Capabilities (class-level: answered from a configuration, before any tier is opened).

    @classmethod
    def scheduler_view(cls) -> SchedulerView:
        """How another process sees this tier's keys. Shared (self-managed) tiers are
        ``SHARED``; a store-managed tier must override this: ConfigError if it does not (it
        would otherwise be invisible to vLLM's scheduler, a silent 0% hit rate)."""
        if cls.self_managed:
            return SchedulerView.SHARED
        raise ConfigError(f"tier class {cls.__name__} is store-managed but does not declare how another "
                          f"process sees its keys (override Tier.scheduler_view)")

    @classmethod
    def scheduler_probe(cls, config: Any, name: str) -> Probe | None:
        """A lookup-only view for a process that does not own the tier, per ``scheduler_view``:
        None for ``MIRRORED``; the tier itself for ``SHARED``; a ``PROBED`` tier overrides
        this. May raise KVTierError (TierUnavailable, ConfigError) when it cannot be had."""
        view = cls.scheduler_view()
        if view is SchedulerView.MIRRORED:
            return None
        if view is SchedulerView.SHARED:
            return cls(config, name=name)
        raise ConfigError(f"tier class {cls.__name__} is probed but offers no scheduler_probe")

    @classmethod
    def for_rank(cls, config: Any, share: RankShare) -> Any:
        """The configuration of one worker's tier (``share``) when each worker owns a store.
        By default the same one: a shared tier is shared anyway (workers use different keys)."""
        return config

    @classmethod
    def for_engine_pages(cls, config: Any, page_bytes: int, given: frozenset[str]) -> Any:
        """The configuration fitted to an engine whose KV pages are ``page_bytes`` each;
        options named in ``given`` were set by the user and are kept. By default unchanged."""
        return config

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes of payload this tier may hold."""

    @property
    def max_entry_bytes(self) -> int:
        """The largest payload one entry of this tier can have: a header announcing more is
        corrupt. By default the tier's capacity (a tier without a byte budget, capacity 0,
        falls back to ``UNBOUNDED_ENTRY_BYTES``)."""
        return self.capacity_bytes or UNBOUNDED_ENTRY_BYTES

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of payload held now (as this process knows it)."""

    @abstractmethod
    def contains(self, key: Key) -> bool:
        """Whether an entry for ``key`` is present (it may still turn out corrupt on read)."""

    @abstractmethod
    def size_of(self, key: Key) -> int | None:
        """Payload bytes of ``key``'s entry, or None when absent."""

    @abstractmethod
    def get_into(self, key: Key, out) -> int | None:
        """Copy ``key``'s payload into the writable buffer ``out``; return the byte count.

        Returns None on a miss, a corrupt entry or a tier fault (see the module contract).
        ``out`` must be at least the payload's size; a smaller buffer is a miss, counted as an error.
        """

    @abstractmethod
    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Store a copy of the bytes-like ``data`` under ``key``; True if stored."""

    @abstractmethod
    def delete(self, key: Key) -> bool:
        """Remove ``key``'s entry; True if there was one."""

    @abstractmethod
    def keys(self) -> Iterator[Key]:
        """Iterate over the keys present (a snapshot; safe while other threads write)."""

    # Built on the abstract methods; backends override them when they can batch.

    def contains_many(self, keys: Iterable[Key]) -> list[bool]:
        """``contains`` for each key, in order (one round trip where the backend can)."""
        return [self.contains(k) for k in keys]

    def get(self, key: Key) -> bytes | None:
        """The payload of ``key`` as new bytes, or None on a miss."""
        size = self.size_of(key)
        if size is None:
            return None
        out = bytearray(size)
        n = self.get_into(key, out)
        return None if n is None else bytes(out[:n])

    def _verified(self, key: Key, value) -> memoryview | None:
        """The payload of a fetched entry (header + payload bytes), or None: an absent value is a
        counted miss; one that does not parse or fails its checksum is counted corrupt and removed."""
        if value is None:
            self.stats.add(misses=1)
            return None
        try:
            header, payload = decode(value, expected_key=bytes(key), max_length=self.max_entry_bytes,
                                     auth=self.auth, lossy_ok=self.serves_lossy)
        except CorruptEntry:
            self.stats.add(corrupt=1, misses=1)
            self.delete(key)
            return None
        self._note_read(header.stored)
        return payload

    @staticmethod
    def _note_read(stored_bytes: int) -> None:
        """Record the stored bytes of the verified read in flight on this thread (an ``auto``
        codec's read bandwidth, see ``_timed_get``)."""
        _GET_CLOCK.stored = stored_bytes

    def _length_from_header(self, key: Key, head) -> int | None:
        """Payload length from the first bytes of a stored entry (``size_of`` of a remote tier),
        or None: an absent value is None; a header that does not parse, names another key or
        announces more than ``max_entry_bytes`` is counted corrupt, removed, and None."""
        if not head:
            return None
        try:
            header = decode_header(head, self.max_entry_bytes, self.auth)
            if header.key != bytes(key):
                raise CorruptEntry("entry holds another key")
        except CorruptEntry:
            self.stats.add(corrupt=1)
            self.delete(key)
            return None
        return header.length

    def _deliver_value(self, key: Key, value, out) -> int | None:
        """Verify a fetched entry and copy its payload into ``out`` (a counted miss if bad)."""
        payload = self._verified(key, value)
        return None if payload is None else self._deliver(payload, out)

    def _deliver(self, payload: memoryview, out) -> int | None:
        """Copy a verified payload into the caller's buffer; count a hit (or, when ``out`` is too
        small, an error and a miss, leaving ``out`` untouched)."""
        dest = memoryview(out).cast("B")
        n = payload.nbytes
        if dest.nbytes < n:
            self.stats.add(errors=1, misses=1)
            return None
        dest[:n] = payload
        self.stats.add(hits=1, bytes_read=n)
        return n

    def _seal(self, key: Key, view: memoryview, dtype: str,
              shape: tuple[int, ...] | None) -> tuple[bytes, memoryview] | None:
        """(header, stored bytes) for a put: coded with the tier's codec when that shrinks it,
        tagged with its auth key; or None (counted as an error and a drop) when the key, dtype or
        shape cannot describe ``view``. InvalidKey for a key that is not a chunk key. Runs on
        the caller's thread: for a lower tier, the store's writer thread (never the engine's
        step)."""
        check_key(key)
        codec = self.codec
        try:
            sealed = seal(bytes(key), view, dtype, shape, self.auth, codec)
        except ValueError:
            self.stats.add(errors=1, dropped=1)
            return None
        _PUT_CLOCK.coded = codec is not None and sealed[1].nbytes != view.nbytes  # counted if the put lands
        if isinstance(codec, _AutoCodec):  # the transfer that follows is timed (see _timed_put)
            _PUT_CLOCK.pending = (codec.auto, sealed[1].nbytes)
            _PUT_CLOCK.sealed_at = time.perf_counter()
        return sealed

    def close(self) -> None:
        """Release resources. Further calls are not allowed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _AutoCodec:
    """The codec an ``auto`` tier hands to ``kvtier.entry.seal``: it codes when ``AutoChoice``
    says it pays, else returns None (stored raw)."""

    def __init__(self, auto):
        self.auto = auto
        self.id = auto.codec.id
        self.name = "auto"

    def encode(self, raw: memoryview, itemsize: int) -> bytes | None:
        return self.auto.encode(raw, itemsize)


_PUT_CLOCK = threading.local()  # (AutoChoice, stored bytes) of the put in flight on this thread


def _timed_put(put):
    """Wrap a tier's ``put``: a put that lands an entry its ``_seal`` coded counts in ``coded``;
    when the seal ran for an ``auto`` tier, the time from the seal's end to the put's return (the
    transfer, codec time excluded) feeds the tier's bandwidth. Other tiers pay two thread-local
    look-ups."""

    def timed(self, *args, **kwargs):
        _PUT_CLOCK.pending = None
        _PUT_CLOCK.coded = False
        result = put(self, *args, **kwargs)
        if result and _PUT_CLOCK.coded:
            self.stats.add(coded=1)
        _PUT_CLOCK.coded = False
        pending = getattr(_PUT_CLOCK, "pending", None)
        if pending is not None and result:
            auto, stored = pending
            auto.observe_put(stored, time.perf_counter() - _PUT_CLOCK.sealed_at)
        _PUT_CLOCK.pending = None
        return result

    timed.__doc__, timed.__name__, timed.__wrapped__ = put.__doc__, put.__name__, put
    return timed


_GET_CLOCK = threading.local()  # stored: bytes of the verified read in flight on this thread


def _decode_clock():
    """``kvtier.codecs.CLOCK`` (imported on the first read of an ``auto`` tier, not per read)."""
    global _CLOCK
    if _CLOCK is None:
        from kvtier.codecs import CLOCK

        _CLOCK = CLOCK
    return _CLOCK


_CLOCK = None
READ_SAMPLE = 4
PROBE_READS = 3  # reads of each of an auto tier's two probe entries (``Tier._probe_reads``)


def _timed_get(get_into):
    """Wrap a tier's ``get_into``: for an ``auto`` tier, a hit's time minus the time spent
    decoding feeds the tier's read bandwidth (stored bytes, from ``Tier._note_read``) and the
    measured cost of its kind of re-read, for one read in ``READ_SAMPLE`` of the kind the tier
    stores now and for every read of the other kind (its probes: the rarer side of the measured
    rule). The fit remembers ~30 transfers anyway, and queueing every read cost ~3% of a 1 MiB
    read from a memory-speed tier. Other tiers pay one attribute look-up."""

    def timed(self, *args, **kwargs):
        auto = getattr(self, "_auto", None)
        if auto is None:
            return get_into(self, *args, **kwargs)
        auto.reads += 1
        clock = _decode_clock()
        _GET_CLOCK.stored = 0
        clock.decode_s = 0.0
        start = time.perf_counter()
        result = get_into(self, *args, **kwargs)
        took = time.perf_counter() - start
        if result:
            decode_s = clock.decode_s
            if (decode_s > 0) != auto.coding or not auto.reads % READ_SAMPLE:
                auto.observe_get(_GET_CLOCK.stored, took - decode_s, result, decode_s)
        return result

    timed.__doc__, timed.__name__, timed.__wrapped__ = get_into.__doc__, get_into.__name__, get_into
    return timed


def check_file_modes(config: Any, where: str, no_shared_write: bool = False) -> None:
    """ConfigError (one line) for a file tier's ``mode`` that is not an octal permission string
    keeping owner read/write (nor, with ``no_shared_write``, granting group/other write), or a
    ``group`` unknown here: the shared check of the tiers that create files."""
    try:
        parse_mode(config.mode, no_shared_write=no_shared_write)
    except ValueError as exc:
        raise ConfigError(f"{where}.mode: {exc}") from exc
    try:
        resolve_group(config.group)
    except ValueError as exc:
        raise ConfigError(f"{where}.group: {exc}") from exc

"""The ``s3`` tier: one object per entry in an S3-compatible bucket, shared by many nodes.

Object ``prefix + key.hex()`` holds the entry header followed by the payload; readers verify the
checksum, so a truncated or foreign object is a counted miss (and is deleted).

Existence checks (``contains``, ``contains_many``; the engine's scheduler waits on them) never
list the bucket. Each key is answered from a bounded cache of recent answers (found or absent,
``lookup_cache_entries`` keys, trusted for ``lookup_cache_ttl_s``; this process's own puts,
deletes and reads update it), else by a HEAD request; the HEADs of one call run concurrently
(``lookup_workers``) and the call returns within ``lookup_timeout_s`` whatever the endpoint does:
a key whose HEAD has not answered by then is reported absent (and counted as an error). An object
another node wrote or deleted is seen within ``lookup_cache_ttl_s``. A cached key may still be
gone by the time it is read: that read is an ordinary miss.

Byte budget (payload bytes; a listing estimates them from object sizes with a one-dimensional
header, exact for the default shape): a listing of ``prefix`` sums object sizes. A background
thread re-lists every ``list_interval_s`` seconds (0: no background listing; the thread stops in
``close``); ``used_bytes`` never lists: it answers from a running total, the last listing plus
this process's puts and deletes since (its own changes made while a listing ran are kept). When
that total exceeds ``capacity``, the putting thread re-lists and deletes the objects with the
oldest LastModified (batched DeleteObjects) until ``low_watermark x capacity`` is reached.

Faults: every data call (``get_into``, ``get``, ``put``, ``delete``) returns within ``timeout_s``: requests run on a thread pool and
the caller stops waiting at the deadline (a late answer is dropped, never written into the
caller's buffer). Within it, botocore's per-attempt timeouts (``connect_timeout_s``,
``read_timeout_s``, both capped by the deadline) and retries (``standard`` mode,
``max_attempts``) apply. A fault is a counted error and a miss / False, never an exception. A
circuit breaker (``kvtier.tiers.breaker``) skips calls for ``backoff_ms`` (doubling to
``max_backoff_ms``) after connection-level faults or timeouts; after the window one call probes
the endpoint while the others fail fast.

Secrets (``secret_key``) stay out of repr and logs. All methods are thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from kvtier import entry, s3client
from kvtier.codecs import CodecName
from kvtier.config import Size
from kvtier.errors import ConfigError
from kvtier.tiers.base import Key, Tier
from kvtier.tiers.breaker import CircuitBreaker


@dataclass(frozen=True, kw_only=True)
class S3Config(s3client.S3Config):
    """Options of the ``s3`` tier: where and as whom (``endpoint_url``, ``region``,
    ``access_key``/``secret_key``, ``addressing``) as in ``kvtier.s3client.S3Config``, plus the
    tier's own. ``capacity``: object bytes kept under ``prefix`` by all nodes together.

    Deadlines: ``lookup_timeout_s`` bounds one existence check (``contains``/``contains_many``,
    ``size_of``); ``timeout_s`` one data call. ``connect_timeout_s``/``read_timeout_s``/
    ``max_attempts`` shape the attempts within a data call's deadline (a lookup makes one attempt).
    ``lookup_workers``: concurrent HEADs of one lookup. ``lookup_cache_entries`` /
    ``lookup_cache_ttl_s``: size and trust time of the cache of found/absent answers.
    ``list_interval_s``: period of the background budget listing (0: none);
    ``list_timeout_s``: deadline of one listing (``used_bytes``, eviction, ``keys``).
    ``codec``: ``none`` (default), ``lossless`` (``kvtier.codecs``; entries that shrink are
    stored coded) or ``auto`` (coded only when the break-even rule says it pays on this tier),
    or ``fp8`` (lossy, opt-in: 16/32-bit float KV as E4M3 with a power-of-two scale per 32
    elements, 0.52 x the bytes; the engine's key namespace records it).
    """

    bucket: str
    prefix: str = "kvtier/"
    region: str | None = "us-east-1"
    capacity: Size = Size(100 * 1024**3)
    low_watermark: float = 0.9
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    max_attempts: int = 3
    max_workers: int = 8
    lookup_timeout_s: float = 0.5
    timeout_s: float = 5.0
    lookup_workers: int = 16
    lookup_cache_entries: int = 65536
    lookup_cache_ttl_s: float = 2.0
    list_interval_s: float = 5.0
    list_timeout_s: float = 60.0
    backoff_ms: int = 500
    max_backoff_ms: int = 5000
    codec: CodecName = "none"


_ABSENT = object()  # the endpoint said: no such object
_FAULT = object()  # no usable answer (skipped, timed out, failed)


class _Answers:
    """A bounded, expiring map key -> found (True) / absent (False). Thread-safe.

    At most ``entries`` keys (the least recently set are dropped first); an answer older than
    ``ttl_s`` is forgotten, by ``clock`` (monotonic seconds). No global state: one per tier.
    """

    def __init__(self, entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self._entries, self._ttl = entries, ttl_s
        self._clock = clock
        self._map: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bool | None:
        """The cached answer for ``key``, or None when unknown or expired."""
        with self._lock:
            hit = self._map.get(key)
            if hit is None:
                return None
            if self._clock() >= hit[1]:
                del self._map[key]
                return None
            return hit[0]

    def set(self, key: bytes, found: bool) -> None:
        if not self._entries or not self._ttl:
            return
        with self._lock:
            self._map[key] = (found, self._clock() + self._ttl)
            self._map.move_to_end(key)
            while len(self._map) > self._entries:
                self._map.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)


def _start_every_thread(pool: ThreadPoolExecutor, workers: int) -> None:
    """Start all ``workers`` threads of ``pool`` now, on the calling thread (the one building the
    tier), so they keep its scheduling policy and niceness: started lazily, the first would be
    started by a store's lower-tier writer (its first put) and inherit the writer's lower
    priority (``writer_nice``, ``writer_idle``), and the pool also serves the engine's reads."""
    gate = threading.Event()
    try:
        futures = [pool.submit(gate.wait) for _ in range(workers)]  # each blocks: a new thread each
    finally:
        gate.set()
    wait(futures)


class S3Tier(Tier):
    """Objects in one bucket under ``prefix``; a shared tier with a listed byte budget."""

    Config = S3Config
    medium = "S3"
    kv_event_medium = "STORAGE"
    locality = "REMOTE"
    self_managed = True

    def __init__(self, config: S3Config, name: str = "s3"):
        super().__init__(config, name)
        import botocore.exceptions  # the kvtier[s3] extra; the registry says how to install it

        _validate(config, name)
        self.config = config
        self._exc = botocore.exceptions
        self._endpoint = s3client.endpoint_of(config)
        self._client = self._make_client(lookup=False)
        self._lookup_client = self._make_client(lookup=True)
        self._pool = ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=f"kvtier-{name}")
        self._lookup_pool = ThreadPoolExecutor(max_workers=config.lookup_workers,
                                               thread_name_prefix=f"kvtier-{name}-lookup")
        _start_every_thread(self._pool, config.max_workers)
        _start_every_thread(self._lookup_pool, config.lookup_workers)
        # a probe that never reports is given up after the longest a call can take
        self._breaker = CircuitBreaker(config.backoff_ms / 1000, config.max_backoff_ms / 1000,
                                       max(config.timeout_s, config.list_timeout_s) + 1.0)
        self._answers = _Answers(config.lookup_cache_entries, config.lookup_cache_ttl_s)
        self._lock = threading.Lock()  # guards the budget listing
        self._known: dict[bytes, tuple[int, float]] = {}  # key -> (object bytes, LastModified ts)
        self._known_bytes = 0  # sum of the sizes in _known, kept with it
        self._pending: dict[bytes, tuple[int, float] | None] | None = None  # own changes while listing
        self._listings = 0  # listings in flight
        self._listed_at = float("-inf")
        self._closed = False
        self._stop = threading.Event()
        if config.list_interval_s > 0:
            threading.Thread(target=_list_loop, name=f"kvtier-{name}-usage", daemon=True,
                             args=(weakref.ref(self), self._stop, config.list_interval_s)).start()

    def _make_client(self, lookup: bool):
        """A botocore client: data calls get ``max_attempts`` attempts each capped by
        ``timeout_s``; lookups one attempt capped by ``lookup_timeout_s``."""
        cfg = self.config
        if lookup:
            connect = read = cfg.lookup_timeout_s
            attempts, pool = 1, cfg.lookup_workers
        else:
            connect = min(cfg.connect_timeout_s, cfg.timeout_s)
            read = min(cfg.read_timeout_s, cfg.timeout_s)
            attempts, pool = cfg.max_attempts, cfg.max_workers
        # the entry carries its own checksum: skip botocore's extra CRC pass over the body
        return s3client.make_client(cfg, connect_timeout_s=connect, read_timeout_s=read, max_attempts=attempts,
                                    max_pool_connections=max(10, pool * 2), skip_checksums=True)

    def _obj(self, key: Key) -> str:
        return self.config.prefix + entry.check_key(key).hex()

    # -- fault handling ---------------------------------------------------------------------

    def _missing(self, exc: BaseException) -> bool:
        if isinstance(exc, self._exc.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return code in ("404", "NoSuchKey", "NotFound")
        return False

    def _within(self, pool: ThreadPoolExecutor, calls: Sequence[Callable[[], Any]],
                deadline_s: float) -> list[Any]:
        """Run ``calls`` on ``pool``; wait at most ``deadline_s`` for all of them.

        Returns per call its result, ``_ABSENT`` (the endpoint said the object does not exist)
        or ``_FAULT`` (skipped by the open breaker, timed out, or failed; each counted in
        ``stats.errors``, a skipped batch once). A call still running at the deadline is left to
        finish on its own; its result is dropped. The breaker hears once per batch: a network
        fault or a timeout opens it; else any answer (an error reply too) closes it; a batch that
        failed only on the caller's own errors releases a half-open probe.
        """
        if not calls:
            return []
        if self._closed or not self._breaker.allow():
            self.stats.add(errors=1)
            return [_FAULT] * len(calls)
        futures: list[Future] = [pool.submit(call) for call in calls]
        done, _late = wait(futures, timeout=deadline_s)
        out: list[Any] = []
        answered = network_fault = False
        for fut in futures:
            if fut not in done:
                fut.cancel()  # not started yet: never runs; running: its result is dropped
                network_fault = True
                out.append(_FAULT)
                continue
            exc = fut.exception()
            if exc is None:
                answered = True
                out.append(fut.result())
            elif self._missing(exc):
                answered = True
                out.append(_ABSENT)
            else:
                out.append(_FAULT)
                answered = answered or isinstance(exc, self._exc.ClientError)  # an error reply
                network_fault = network_fault or isinstance(exc, (self._exc.BotoCoreError, OSError))
        faults = sum(1 for r in out if r is _FAULT)
        if faults:
            self.stats.add(errors=faults)
        if network_fault:
            self._breaker.failure()
        elif answered:
            self._breaker.success()
        else:  # only the caller's own errors: no news about the endpoint
            self._breaker.abandon()
        return out

    def _one(self, call: Callable[[], Any], lookup: bool = False) -> Any:
        """``_within`` for a single call on the data pool (or the lookup pool)."""
        if lookup:
            return self._within(self._lookup_pool, [call], self.config.lookup_timeout_s)[0]
        return self._within(self._pool, [call], self.config.timeout_s)[0]

    # -- budget listing (never on the lookup path) -----------------------------------------

    def _refresh(self, force: bool = False) -> bool:
        """Re-list ``prefix`` when the listing is stale (or ``force``); False on a fault. This
        process's puts and deletes made while the listing ran win over what it saw."""
        if not force and time.monotonic() - self._listed_at < self.config.list_interval_s:
            return True
        with self._lock:
            self._listings += 1
            if self._pending is None:
                self._pending = {}
        try:
            listing = self._within(self._pool, [self._list], self.config.list_timeout_s)[0]
        finally:
            with self._lock:
                self._listings -= 1
                pending = dict(self._pending or {})
                if not self._listings:
                    self._pending = None
        if listing is _FAULT or listing is _ABSENT:
            return False
        total = sum(size for size, _ in listing.values())
        with self._lock:
            for key, value in pending.items():
                total -= listing.pop(key, (0, 0.0))[0]
                if value is not None:
                    listing[key] = value
                    total += value[0]
            self._known, self._known_bytes = listing, total
            self._listed_at = time.monotonic()
        return True

    def _change_locked(self, key: bytes, value: tuple[int, float] | None) -> None:
        """Record this process's put (``value``: size, time) or delete (None) of ``key`` in the
        budget listing and its total (the caller holds ``_lock``)."""
        old = self._known.pop(key, None) if value is None else self._known.get(key)
        self._known_bytes -= old[0] if old else 0
        if value is not None:
            self._known[key] = value
            self._known_bytes += value[0]
        if self._pending is not None:
            self._pending[key] = value

    def _list(self) -> dict[bytes, tuple[int, float]]:
        found: dict[bytes, tuple[int, float]] = {}
        plen = len(self.config.prefix)
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=self.config.prefix)
        for page in pages:
            for obj in page.get("Contents", ()):
                name = obj["Key"][plen:]
                if len(name) == 64:
                    try:
                        found[bytes.fromhex(name)] = (_payload(int(obj["Size"])), obj["LastModified"].timestamp())
                    except ValueError:
                        continue
        return found

    # -- Tier protocol ----------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    def used_bytes(self) -> int:
        """Payload bytes under ``prefix`` at the last listing, with this process's puts/deletes
        since: a counter, never a listing (the background thread re-lists)."""
        with self._lock:
            return max(0, self._known_bytes)

    def contains(self, key: Key) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[Key]) -> list[bool]:
        """Existence of each key: cached answers, else concurrent HEADs, all within
        ``lookup_timeout_s``. A key without an answer by then (a fault, a hung endpoint, the
        breaker open) is reported absent. Never lists the bucket."""
        keys = [bytes(k) for k in keys]
        names = [self._obj(k) for k in keys]  # InvalidKey before any request
        result = [self._answers.get(k) for k in keys]
        first: dict[bytes, int] = {}  # one HEAD per distinct unknown key
        for i, r in enumerate(result):
            if r is None:
                first.setdefault(keys[i], i)
        ask = list(first.values())
        if ask:
            bucket, head = self.config.bucket, self._lookup_client.head_object
            answers = self._within(self._lookup_pool,
                                   [lambda n=names[i]: head(Bucket=bucket, Key=n) for i in ask],
                                   self.config.lookup_timeout_s)
            found: dict[bytes, bool] = {}
            for i, answer in zip(ask, answers):
                found[keys[i]] = answer is not _FAULT and answer is not _ABSENT
                if answer is not _FAULT:  # a fault is unknown: not cached, asked again next time
                    self._answers.set(keys[i], found[keys[i]])
            result = [found[k] if r is None else r for k, r in zip(keys, result)]
        return [bool(r) for r in result]

    def size_of(self, key: Key) -> int | None:
        name = self._obj(key)

        def run():
            rng = f"bytes=0-{entry.MAX_HEADER_BYTES - 1}"
            resp = self._lookup_client.get_object(Bucket=self.config.bucket, Key=name, Range=rng)
            return resp["Body"].read()

        head = self._one(run, lookup=True)
        if head is _FAULT or head is _ABSENT:
            return None
        return self._length_from_header(key, head)  # bounded: a forged length is corrupt

    def _fetcher(self, key: Key) -> Callable[[], bytes]:
        name, bucket = self._obj(key), self.config.bucket
        limit = entry.MAX_HEADER_BYTES + self.max_entry_bytes

        def fetch() -> bytes:
            body = self._client.get_object(Bucket=bucket, Key=name)
            if body["ContentLength"] > limit:  # no entry is this large: corrupt, never read whole
                body["Body"].close()
                return b""
            return body["Body"].read()

        return fetch

    def get_into(self, key: Key, out) -> int | None:
        """Fetch (within ``timeout_s``), verify, then copy into ``out`` in the caller's thread;
        ``out`` is untouched on a miss and never written after this returns."""
        return self._deliver_value(key, self._value(key, self._one(self._fetcher(key))), out)

    def get(self, key: Key) -> bytes | None:
        payload = self._verified(key, self._value(key, self._one(self._fetcher(key))))
        if payload is None:
            return None
        self.stats.add(hits=1, bytes_read=payload.nbytes)
        return bytes(payload)

    def _value(self, key: Key, result: Any):
        """A fetched body, or None (a miss); an absent object is remembered as absent."""
        if result is _ABSENT:
            self._forget(key, absent=True)
            return None
        return None if result is _FAULT else result

    def _verified(self, key: Key, value) -> memoryview | None:
        payload = super()._verified(key, value)
        if payload is not None:
            self._answers.set(bytes(key), True)
        return payload

    def _forget(self, key: Key, absent: bool) -> None:
        """Drop ``key`` from the budget listing; remember it as absent when it is known to be."""
        with self._lock:
            self._change_locked(bytes(key), None)
        if absent:
            self._answers.set(bytes(key), False)

    def _upload(self, key: Key, data, dtype: str, shape: tuple[int, ...] | None):
        """(call that uploads, payload size), or None (counted) when the put cannot be made."""
        sealed = self._seal(key, memoryview(data).cast("B"), dtype, shape)
        if sealed is None:
            return None
        header, view = sealed  # view: the stored bytes (coded when the tier's codec shrinks them)
        if view.nbytes > self.config.capacity:
            self.stats.add(dropped=1)
            return None
        body, name, bucket = header + view.tobytes(), self._obj(key), self.config.bucket

        def run():
            self._client.put_object(Bucket=bucket, Key=name, Body=body)
            return True

        return run, view.nbytes

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Upload header + payload as one object (one PUT); True once the endpoint acknowledged it
        within ``timeout_s``. False (counted) otherwise; an upload still running at the deadline
        may land later, unacknowledged."""
        return self._put_all([(key, data, dtype, shape)])[0]

    def _put_all(self, items: Sequence[tuple[Key, object, str, tuple[int, ...] | None]]) -> list[bool]:
        uploads = [self._upload(*item) for item in items]
        ready = [i for i, u in enumerate(uploads) if u is not None]
        results = self._within(self._pool, [uploads[i][0] for i in ready], self.config.timeout_s)
        ok = [False] * len(items)
        over = False
        for i, result in zip(ready, results):
            if result is not True:
                self.stats.add(dropped=1)
                continue
            ok[i] = True
            key, size = bytes(items[i][0]), uploads[i][1]
            self.stats.add(puts=1, bytes_written=size)
            self._answers.set(key, True)
            with self._lock:
                self._change_locked(key, (size, time.time()))
                over = over or self._known_bytes > self.config.capacity
        if over:
            self._evict()
        return ok

    def _evict(self) -> None:
        """Re-list, then delete the oldest objects until under ``low_watermark x capacity``."""
        if not self._refresh(force=True):
            return
        with self._lock:
            total = self._known_bytes
            if total <= self.config.capacity:
                return
            goal = self.config.capacity * self.config.low_watermark
            victims = []
            for k, (size, _ts) in sorted(self._known.items(), key=lambda kv: kv[1][1]):
                if total <= goal:
                    break
                victims.append(k)
                total -= size
            for k in victims:
                self._change_locked(k, None)
        for k in victims:
            self._answers.set(k, False)
        batches = [[{"Key": self._obj(k)} for k in victims[start:start + 1000]]
                   for start in range(0, len(victims), 1000)]
        self._within(self._pool, [lambda batch=batch: self._client.delete_objects(
            Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True}) for batch in batches],
            self.config.timeout_s)
        self.stats.add(evictions=len(victims))

    def delete(self, key: Key) -> bool:
        """Delete the object (HEAD first when this process does not know it exists, since S3's
        DELETE succeeds either way); True when it existed. Both requests within ``timeout_s``."""
        name, bucket = self._obj(key), self.config.bucket
        end = time.monotonic() + self.config.timeout_s
        with self._lock:
            was_known = bytes(key) in self._known
            self._change_locked(bytes(key), None)
        if not was_known:  # perhaps written by another node since the last listing
            found = self._one(lambda: self._client.head_object(Bucket=bucket, Key=name))
            was_known = found is not _FAULT and found is not _ABSENT
        left = end - time.monotonic()
        if left <= 0:
            self.stats.add(errors=1)
            return False
        gone = self._within(self._pool, [lambda: self._client.delete_object(Bucket=bucket, Key=name)], left)[0]
        if gone is _FAULT:
            return False
        self._answers.set(bytes(key), False)
        # S3 DELETE succeeds whether or not the object existed; the HEAD/listing tells which it was.
        if was_known:
            self.stats.add(deletes=1)
        return was_known

    def keys(self) -> Iterator[Key]:
        """Keys under ``prefix`` from a fresh listing (empty on a fault)."""
        if not self._refresh(force=True):
            return iter(())
        with self._lock:
            return iter(list(self._known))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # the listing thread ends at its next wake-up (a listing in flight is not waited for)
        for pool in (self._pool, self._lookup_pool):
            pool.shutdown(wait=False, cancel_futures=True)  # a hung request must not block close
        for client in (self._client, self._lookup_client):
            try:
                client.close()
            except Exception:  # closing must not raise into the caller
                pass

    def __repr__(self) -> str:
        return (f"S3Tier(name={self.name!r}, endpoint={self._endpoint!r}, "
                f"bucket={self.config.bucket!r}, prefix={self.config.prefix!r})")


def _list_loop(ref: "weakref.ref[S3Tier]", stop: threading.Event, interval: float) -> None:
    """Re-list every ``interval`` seconds until ``stop`` is set or the tier is gone."""
    while not stop.wait(interval):
        tier = ref()
        if tier is None:
            return
        try:
            tier._refresh(force=True)
        except Exception:  # never kill the thread; the next round tries again
            tier.stats.add(errors=1)
        del tier


def _validate(config: S3Config, name: str) -> None:
    """ConfigError (one line naming the key and its valid range) for a bad value."""
    if not config.bucket:
        raise ConfigError(f"{name}.bucket: must not be empty")
    if not 0 < config.low_watermark <= 1:
        raise ConfigError(f"{name}.low_watermark: must be in (0, 1], got {config.low_watermark}")
    for key, lo, hi in (("max_workers", 1, 1024), ("max_attempts", 1, 20), ("lookup_workers", 1, 1024),
                        ("lookup_cache_entries", 0, 10_000_000)):
        value = getattr(config, key)
        if not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{name}.{key}: must be an integer in [{lo}, {hi}], got {value!r}")
    for key, hi in (("connect_timeout_s", 600.0), ("read_timeout_s", 600.0), ("lookup_timeout_s", 60.0),
                    ("timeout_s", 3600.0), ("list_timeout_s", 3600.0)):
        value = getattr(config, key)
        if not 0 < value <= hi:  # also rejects NaN
            raise ConfigError(f"{name}.{key}: must be in (0, {hi:g}] seconds, got {value!r}")
    for key in ("lookup_cache_ttl_s", "list_interval_s"):
        value = getattr(config, key)
        if not (math.isfinite(value) and 0 <= value <= 3600):
            raise ConfigError(f"{name}.{key}: must be in [0, 3600] seconds, got {value!r}")
    if not 1 <= config.backoff_ms <= config.max_backoff_ms <= 3_600_000:
        raise ConfigError(f"{name}.backoff_ms, max_backoff_ms: need 1 <= backoff_ms <= max_backoff_ms "
                          f"<= 3600000, got {config.backoff_ms}, {config.max_backoff_ms}")


def _payload(object_bytes: int) -> int:
    """Payload bytes of an entry object, taking its header as one-dimensional (the default shape)."""
    return max(0, object_bytes - entry.FIXED_BYTES - 8)

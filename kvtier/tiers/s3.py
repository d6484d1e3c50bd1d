"""The ``s3`` tier: one object per entry in an S3-compatible bucket, shared by many nodes.

Object ``prefix + key.hex()`` holds the entry header followed by the payload; readers verify the
checksum, so a truncated or foreign object is a counted miss (and is deleted).

Existence checks are answered from a known-keys cache: a listing of ``prefix`` (refreshed when
older than ``list_interval_s``) plus this process's own puts and deletes. So ``contains`` and
``contains_many`` cost no request while the cache is fresh; an object another node wrote is seen
within ``list_interval_s``. A cached key may still be gone by the time it is read: that read is
an ordinary miss.

Byte budget (payload bytes; a listing estimates them from object sizes with a one-dimensional
header, exact for the default shape): the listing also sums object sizes. When that sum plus this process's writes since
the listing exceeds ``capacity``, the tier re-lists and deletes the objects with the oldest
LastModified (batched DeleteObjects) until ``low_watermark x capacity`` is reached.

Faults: timeouts (``connect_timeout_s``/``read_timeout_s``), retries with backoff (botocore's
``standard`` mode, ``max_attempts``), then a counted error and a miss / False, never an
exception. A circuit breaker skips calls for ``backoff_ms`` (doubling to ``max_backoff_ms``)
after connection-level faults, so an unreachable endpoint costs one timeout per window.

``get_many_into``/``put_many`` run requests in parallel on a thread pool of ``max_workers``.
Secrets (``secret_key``) stay out of repr and logs. All methods are thread-safe.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Sequence
from urllib.parse import urlsplit

from kvtier import entry
from kvtier.config import Size
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.tiers.base import Key, Tier
from kvtier.tiers.breaker import CircuitBreaker


@dataclass(frozen=True)
class S3Config:
    """Options of the ``s3`` tier.

    ``endpoint_url``: the S3 endpoint (default: ``AWS_ENDPOINT_URL``, else AWS). ``access_key`` /
    ``secret_key``: credentials (default: boto3's chain: env, profile, role). ``addressing``:
    ``auto`` picks path-style for IP/localhost endpoints. ``capacity``: object bytes kept under
    ``prefix`` by all nodes together.
    """

    bucket: str
    endpoint_url: str | None = None
    prefix: str = "kvtier/"
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    addressing: Literal["auto", "path", "virtual"] = "auto"
    capacity: Size = Size(100 * 1024**3)
    low_watermark: float = 0.9
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_attempts: int = 3
    max_workers: int = 8
    list_interval_s: float = 5.0
    backoff_ms: int = 500
    max_backoff_ms: int = 5000


class S3Tier(Tier):
    """Objects in one bucket under ``prefix``; a shared tier with a listed byte budget."""

    Config = S3Config
    medium = "S3"
    self_managed = True

    def __init__(self, config: S3Config, name: str = "s3"):
        super().__init__(name)
        import botocore.exceptions  # the kvtier[s3] extra; the registry says how to install it

        if not config.bucket:
            raise ConfigError(f"{name}.bucket: must not be empty")
        if config.max_workers < 1 or config.max_attempts < 1:
            raise ConfigError(f"{name}: max_workers and max_attempts must be at least 1")
        if not 0 < config.low_watermark <= 1:
            raise ConfigError(f"{name}.low_watermark: must be in (0, 1], got {config.low_watermark}")
        self.config = config
        self._exc = botocore.exceptions
        self._endpoint = config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self._client = self._make_client()
        self._pool = ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=f"kvtier-{name}")
        self._breaker = CircuitBreaker(config.backoff_ms / 1000, config.max_backoff_ms / 1000)
        self._lock = threading.Lock()  # guards the known-keys cache
        self._known: dict[bytes, tuple[int, float]] = {}  # key -> (object bytes, LastModified ts)
        self._listed_at = float("-inf")
        self._written_since_list = 0
        self._closed = False

    def _make_client(self):
        import boto3
        from botocore.config import Config

        cfg = self.config
        style = cfg.addressing
        if style == "auto":
            style = "path" if _is_local(self._endpoint) else "auto"
        botocfg = Config(
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
            max_pool_connections=max(10, cfg.max_workers * 2),
            s3={"addressing_style": style},
            # the entry carries its own checksum; skip botocore's extra CRC pass over the body
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.session.Session().client(
            "s3", endpoint_url=self._endpoint, region_name=cfg.region, config=botocfg,
            aws_access_key_id=cfg.access_key, aws_secret_access_key=cfg.secret_key,
        )

    def _obj(self, key: Key) -> str:
        return self.config.prefix + bytes(key).hex()

    # -- fault handling ---------------------------------------------------------------------

    def _missing(self, exc: Exception) -> bool:
        if isinstance(exc, self._exc.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return code in ("404", "NoSuchKey", "NotFound")
        return False

    def _call(self, fn, default, absent=None):
        """Run ``fn()``: ``absent`` for a missing object, ``default`` (counted error) on a fault."""
        if self._closed or not self._breaker.allow():
            self.stats.add(errors=1)
            return default
        try:
            result = fn()
        except (self._exc.BotoCoreError, self._exc.ClientError, OSError) as exc:
            if self._missing(exc):
                self._breaker.success()
                return absent
            self.stats.add(errors=1)
            if not isinstance(exc, self._exc.ClientError):  # network-level: open the breaker
                self._breaker.failure()
            return default
        self._breaker.success()
        return result

    # -- known-keys cache -------------------------------------------------------------------

    def _refresh(self, force: bool = False) -> bool:
        """Re-list ``prefix`` when the cache is stale (or ``force``); False on a fault."""
        if not force and time.monotonic() - self._listed_at < self.config.list_interval_s:
            return True
        listing = self._call(self._list, None)
        if listing is None:
            return False
        with self._lock:
            self._known = listing
            self._listed_at = time.monotonic()
            self._written_since_list = 0
        return True

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
        """Payload bytes under ``prefix`` at the last listing, with this process's puts/deletes since."""
        self._refresh()
        with self._lock:
            return sum(size for size, _ in self._known.values())

    def contains(self, key: Key) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[Key]) -> list[bool]:
        """Existence from the known-keys cache (one listing when stale; all False on a fault)."""
        keys = [bytes(k) for k in keys]
        if not self._refresh():
            return [False] * len(keys)
        with self._lock:
            return [k in self._known for k in keys]

    def size_of(self, key: Key) -> int | None:
        def run():
            rng = f"bytes=0-{entry.MAX_HEADER_BYTES - 1}"
            resp = self._client.get_object(Bucket=self.config.bucket, Key=self._obj(key), Range=rng)
            return resp["Body"].read()

        head = self._call(run, None)
        if not head:
            return None
        try:
            return entry.decode_header(head).length
        except CorruptEntry:
            return None

    def _fetch(self, key: Key):
        resp = self._client.get_object(Bucket=self.config.bucket, Key=self._obj(key))
        return resp["Body"].read()

    def get_into(self, key: Key, out) -> int | None:
        """Fetch, verify, then copy into ``out``; ``out`` is untouched on a miss."""
        return self._deliver_value(key, self._call(lambda: self._fetch(key), None), out)

    def get_many_into(self, keys: Sequence[Key], outs: Sequence) -> list[int | None]:
        """``get_into`` for each (key, out) pair, ``max_workers`` requests in parallel."""
        return list(self._pool.map(self.get_into, keys, outs))

    def get(self, key: Key) -> bytes | None:
        payload = self._verified(key, self._call(lambda: self._fetch(key), None))
        if payload is None:
            return None
        self.stats.add(hits=1, bytes_read=payload.nbytes)
        return bytes(payload)

    def _verified(self, key: Key, value) -> memoryview | None:
        if value is None:  # gone: forget it in the listing cache too
            with self._lock:
                self._known.pop(bytes(key), None)
        return super()._verified(key, value)

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Upload header + payload as one object (one PUT); True once the endpoint acknowledged it."""
        view = memoryview(data).cast("B")
        header = self._header(key, view, dtype, shape)
        if header is None:
            return False
        size = view.nbytes
        if size > self.config.capacity:
            self.stats.add(dropped=1)
            return False
        body = header + view.tobytes()

        def run():
            self._client.put_object(Bucket=self.config.bucket, Key=self._obj(key), Body=body)
            return True

        if not self._call(run, False, absent=False):
            self.stats.add(dropped=1)
            return False
        self.stats.add(puts=1, bytes_written=view.nbytes)
        with self._lock:
            old = self._known.get(bytes(key), (0, 0.0))[0]
            self._known[bytes(key)] = (size, time.time())
            self._written_since_list += size - old
            over = sum(s for s, _ in self._known.values()) > self.config.capacity
        if over:
            self._evict()
        return True

    def put_many(self, items: Sequence[tuple[Key, object]]) -> list[bool]:
        """``put`` for each (key, data) pair, ``max_workers`` uploads in parallel."""
        return list(self._pool.map(lambda kv: self.put(kv[0], kv[1]), items))

    def _evict(self) -> None:
        """Re-list, then delete the oldest objects until under ``low_watermark x capacity``."""
        if not self._refresh(force=True):
            return
        with self._lock:
            total = sum(size for size, _ in self._known.values())
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
                self._known.pop(k, None)
        for start in range(0, len(victims), 1000):
            batch = [{"Key": self._obj(k)} for k in victims[start:start + 1000]]
            self._call(lambda batch=batch: self._client.delete_objects(
                Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True}), None)
        self.stats.add(evictions=len(victims))

    def delete(self, key: Key) -> bool:
        with self._lock:
            was_known = self._known.pop(bytes(key), None) is not None
        if not was_known:  # perhaps written by another node since the last listing
            was_known = bool(self._call(lambda: self._client.head_object(
                Bucket=self.config.bucket, Key=self._obj(key)), None, absent=None))
        ok = self._call(lambda: self._client.delete_object(Bucket=self.config.bucket, Key=self._obj(key)),
                        None, absent=None)
        if ok is None:
            return False
        # S3 DELETE succeeds whether or not the object existed; the cache tells which it was.
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
        self._pool.shutdown(wait=True)
        try:
            self._client.close()
        except Exception:  # closing must not raise into the caller
            pass

    def __repr__(self) -> str:
        return (f"S3Tier(name={self.name!r}, endpoint={self._endpoint!r}, "
                f"bucket={self.config.bucket!r}, prefix={self.config.prefix!r})")


def _payload(object_bytes: int) -> int:
    """Payload bytes of an entry object, taking its header as one-dimensional (the default shape)."""
    return max(0, object_bytes - entry.FIXED_BYTES - 8)


def _is_local(endpoint: str | None) -> bool:
    """True for endpoints on an IP address or localhost (no virtual-host DNS there)."""
    if not endpoint:
        return False
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False

"""The ``redis`` tier: entries in Redis/Valkey (standalone or Redis Cluster), shared by many nodes.

Each entry is one string value: the entry-format header followed by the payload
(``kvtier.entry``), stored under ``prefix + key`` (the raw 32-byte key). Readers verify the
checksum, so a torn or foreign value is a counted miss, never wrong bytes.

Byte budget (``capacity``): enforced by kvtier, not by Redis. Beside the data, three
bookkeeping keys in one hash slot (``{prefix}#sizes`` hash, ``{prefix}#order`` sorted set scored
by a shared write counter, ``{prefix}#total`` payload bytes) are updated by a small Lua script
pipelined with every SET, so all nodes sharing a prefix share one budget. When a put takes the
total over ``capacity``, the oldest *written* entries are popped by another script and deleted
(FIFO by write; reads do not reorder, so a hit costs no extra round trip). ``capacity = 0``
turns the bookkeeping off: then Redis' own ``maxmemory`` with ``maxmemory-policy allkeys-lru``
must bound memory (configure the server so). Entries that expire by ``ttl_s`` stay counted until
the budget pops them, which it does first since they are the oldest.

Faults: connection refused, timeouts and server errors are counted in ``stats.errors`` and turn
into misses / False, never into exceptions. Every call has a deadline: ``lookup_timeout_s`` for
the existence checks the engine's scheduler waits on (``contains``, ``contains_many``,
``size_of``, ``used_bytes``), ``timeout_s`` for data operations; a hung server (SIGSTOPped,
accepting and never answering) costs a caller at most that, never a timeout plus retries. The
two kinds run on separate connection pools, so a slow bulk transfer never holds up a lookup.
Only a connection the server dropped is re-dialled once (that fails fast); a timeout is not
retried. After a connection fault a circuit breaker (``kvtier.tiers.breaker``) skips calls
(counted as errors) for ``backoff_ms``, doubling up to ``max_backoff_ms`` while faults persist;
after the window one caller probes the server while the others keep failing fast, and its
success closes the breaker (reconnecting once the server is back).

Data path: a put hashes the payload once (xxh3) and sends ``header`` and the caller's buffer as
separate socket writes of one hand-packed RESP command (no concatenated copy); a get receives
the value from hiredis, verifies it, then copies the payload into the caller's buffer.

Thread-safety: all methods are thread-safe (two bounded connection pools, one for lookups and one
for data, ``max_connections`` each; further callers wait within their deadline).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

from kvtier import entry
from kvtier.codecs import CodecName
from kvtier.config import Size
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.tiers.base import Key, Tier
from kvtier.tiers.breaker import CircuitBreaker

# KEYS: sizes, order, total, seq. ARGV: member, nbytes. Returns the new total.
_ACCOUNT_PUT = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[1])
return redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - old)
"""

# KEYS: sizes, order, total. ARGV: member. Returns the bytes it un-counted (0 if untracked).
_ACCOUNT_DEL = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], tonumber(old))
return tonumber(old)
"""

# KEYS: sizes, order, total. ARGV: capacity, max victims. Pops the oldest members until the
# total fits; returns them (the caller deletes their data keys).
_ACCOUNT_EVICT = """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local cap = tonumber(ARGV[1])
local out = {}
while total > cap and #out < tonumber(ARGV[2]) do
  local m = redis.call('ZPOPMIN', KEYS[2])
  if #m == 0 then
    redis.call('SET', KEYS[3], 0)  -- counted bytes with nothing to evict: repair the drift
    break
  end
  local size = tonumber(redis.call('HGET', KEYS[1], m[1]) or '0')
  redis.call('HDEL', KEYS[1], m[1])
  total = redis.call('DECRBY', KEYS[3], size)
  out[#out + 1] = m[1]
end
return out
"""


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class RedisConfig:
    """Options of the ``redis`` tier.

    ``url``: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock`` or
    ``redis+cluster://host:port`` (same as ``cluster: true``). ``capacity``: payload bytes kvtier
    keeps under ``prefix`` across all nodes (0: rely on Redis maxmemory-policy allkeys-lru).
    ``ttl_s``: expire entries after this many seconds (0: never). ``password`` overrides the URL's.
    ``lookup_timeout_s``: deadline of one existence check or size query (the scheduler's path);
    ``timeout_s``: deadline of one data operation (get, put, delete, eviction, scan);
    ``connect_timeout_s``: the most a new connection may take (never more than the deadline).
    ``backoff_ms``/``max_backoff_ms``: the circuit breaker's first and longest window.
    ``codec``: ``none`` (default), ``lossless`` (``kvtier.codecs``; entries that shrink are
    stored coded) or ``auto`` (coded only when the break-even rule says it pays on this tier),
    or ``fp8`` (lossy, opt-in: 16/32-bit float KV as E4M3 with a power-of-two scale per 32
    elements, 0.52 x the bytes; the engine's key namespace records it).
    """

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    prefix: str = "kvtier:"
    capacity: Size = Size(4 * 1024**3)
    ttl_s: float = 0.0
    max_connections: int = 8
    connect_timeout_s: float = 1.0
    lookup_timeout_s: float = 0.5
    timeout_s: float = 2.0
    backoff_ms: int = 250
    max_backoff_ms: int = 2000
    password: str | None = None
    codec: CodecName = "none"

    def __repr__(self) -> str:  # secrets stay out of repr and logs
        return (
            f"RedisConfig(url={_redact(self.url)!r}, cluster={self.cluster}, prefix={self.prefix!r}, "
            f"capacity={self.capacity}, ttl_s={self.ttl_s}, max_connections={self.max_connections}, "
            f"lookup_timeout_s={self.lookup_timeout_s}, timeout_s={self.timeout_s}, "
            f"password={'***' if self.password else None})"
        )


class RedisTier(Tier):
    """Entries in Redis under ``prefix``; a shared tier with a kvtier-enforced byte budget."""

    Config = RedisConfig
    medium = "REDIS"
    kv_event_medium = "STORAGE"
    locality = "REMOTE"
    self_managed = True

    def __init__(self, config: RedisConfig, name: str = "redis"):
        super().__init__(config, name)
        import redis  # the kvtier[redis] extra; the registry's message says how to install it

        self._redis = redis
        self.config = config
        if config.max_connections < 1:
            raise ConfigError(f"{name}.max_connections: must be at least 1, got {config.max_connections}")
        if config.capacity < 0 or config.ttl_s < 0:
            raise ConfigError(f"{name}: capacity and ttl_s must not be negative")
        _check_deadlines(config, name)
        self._prefix = config.prefix.encode()
        tag = b"{" + self._prefix + b"}"  # one hash slot for the bookkeeping keys
        self._acct = (tag + b"#sizes", tag + b"#order", tag + b"#total", tag + b"#seq")
        self._ttl_ms = int(config.ttl_s * 1000)
        # a probe that never reports is given up after the longest any call can take
        probe_timeout = config.connect_timeout_s + max(config.timeout_s, config.lookup_timeout_s) + 1.0
        self._breaker = CircuitBreaker(config.backoff_ms / 1000, config.max_backoff_ms / 1000, probe_timeout)
        self._client, self._pool = self._connect(config, config.timeout_s)
        self._lookup, self._lookup_pool = self._connect(config, config.lookup_timeout_s)
        self._closed = False
        self._known_total = 0

    # -- connection -------------------------------------------------------------------------

    def _connect(self, config: RedisConfig, deadline: float):
        """A client (and its pool; None for a cluster) whose calls end within ``deadline``.

        The socket timeout is the deadline, a new connection may take at most the deadline, a
        caller waits for a free pooled connection at most the deadline, and only a dropped
        connection (ConnectionError, which fails fast) is retried once, never a timeout.
        """
        redis = self._redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        url = config.url
        cluster = config.cluster or url.startswith("redis+cluster://") or url.startswith("rediss+cluster://")
        url = url.replace("+cluster://", "://", 1)
        options = dict(
            socket_connect_timeout=min(config.connect_timeout_s, deadline),
            socket_timeout=deadline,
            # one silent retry re-dials a connection the server dropped; a timeout is not retried
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        if config.password is not None:
            options["password"] = config.password
        if cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(url, max_connections=config.max_connections, **options), None
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=config.max_connections, timeout=deadline, **options
        )
        return redis.Redis(connection_pool=pool), pool

    def _key(self, key: Key) -> bytes:
        return self._prefix + entry.check_key(key)

    def _fault(self, exc: BaseException) -> None:
        """Count a fault; open the breaker on connection-level ones."""
        self.stats.add(errors=1)
        if isinstance(exc, (self._redis.ConnectionError, self._redis.TimeoutError, OSError)):
            self._breaker.failure()

    def _skip(self) -> bool:
        """True (and counted) when the breaker is open or the tier is closed."""
        if self._closed or not self._breaker.allow():
            self.stats.add(errors=1)
            return True
        return False

    def _call(self, fn, default):
        """Run ``fn()`` with fault handling; ``default`` when skipped or failed.

        Every admitted call reports to the breaker: a connection fault or timeout opens it, any
        answer from the server (an error reply too) closes it, and a caller's own error raised
        before the server was asked (an invalid key) releases a half-open probe.
        """
        if self._skip():
            return default
        try:
            result = fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            self._fault(exc)
            return default
        except self._redis.RedisError as exc:  # the server answered, with an error
            self._breaker.success()
            self._fault(exc)
            return default
        except BaseException:
            self._breaker.abandon()
            raise
        self._breaker.success()
        return result

    # -- Tier protocol ----------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.config.capacity)

    def used_bytes(self) -> int:
        """Payload bytes counted under ``prefix`` by all nodes (last known value on a fault)."""
        if not self.config.capacity:
            return 0
        value = self._call(lambda: self._lookup.get(self._acct[2]), None)
        if value is not None:
            self._known_total = max(0, int(value))
        return self._known_total

    def contains(self, key: Key) -> bool:
        return bool(self._call(lambda: self._lookup.exists(self._key(key)), 0))

    def contains_many(self, keys: Iterable[Key]) -> list[bool]:
        """Existence of each key in one pipelined round trip, within ``lookup_timeout_s`` (all
        False on a fault or when the breaker is open)."""
        keys = list(keys)
        if not keys:
            return []

        def run():
            pipe = self._lookup.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            return [bool(n) for n in pipe.execute()]

        return self._call(run, [False] * len(keys))

    def size_of(self, key: Key) -> int | None:
        raw = self._call(lambda: self._lookup.getrange(self._key(key), 0, entry.MAX_HEADER_BYTES - 1), None)
        return self._length_from_header(key, raw)  # bounded: a forged length is corrupt

    def get_into(self, key: Key, out) -> int | None:
        """Copy the verified payload into ``out``; ``out`` is untouched on a miss."""
        value = self._call(lambda: self._client.get(self._key(key)), _FAULT)
        return self._deliver_value(key, value, out)

    def get(self, key: Key) -> bytes | None:
        """The payload as new bytes (one round trip), or None on a miss."""
        value = self._call(lambda: self._client.get(self._key(key)), _FAULT)
        payload = self._verified(key, value)
        if payload is None:
            return None
        self.stats.add(hits=1, bytes_read=payload.nbytes)
        return bytes(payload)

    def _verified(self, key: Key, value) -> memoryview | None:
        return super()._verified(key, None if value is _FAULT else value)

    def put(self, key: Key, data, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bool:
        """Store header + a copy of ``data`` (sent straight from the caller's buffer)."""
        sealed = self._seal(key, memoryview(data).cast("B"), dtype, shape)
        if sealed is None:
            return False
        header, view = sealed  # view: the stored bytes (coded when the tier's codec shrinks them)
        if self.config.capacity and view.nbytes > self.config.capacity:
            self.stats.add(dropped=1)
            return False
        send = self._put_cluster if self._pool is None else self._put_packed
        total = self._call(lambda: send(key, header, view), _FAULT)
        if total is _FAULT:
            self.stats.add(dropped=1)
            return False
        self.stats.add(puts=1, bytes_written=view.nbytes)
        if self.config.capacity and total is not None:
            self._known_total = int(total)
            if total > self.config.capacity:
                self._evict()
        return True

    def _set_tail(self) -> list[bytes]:
        return [b"PX", str(self._ttl_ms).encode()] if self._ttl_ms else []

    def _put_packed(self, key: Key, header: bytes, view: memoryview):
        """SET (and the bookkeeping script) as one hand-packed pipeline on one connection."""
        rkey = self._key(key)
        tail = self._set_tail()
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
            3 + len(tail), len(rkey), rkey, len(header) + view.nbytes)
        parts = [head + header, view, b"\r\n" + _bulk(*tail)]
        track = bool(self.config.capacity)
        if track:  # EVALSHA: the script body is not resent with every put
            parts.append(_pack(b"EVALSHA", _PUT_SHA, b"4", *self._acct, bytes(key),
                               str(view.nbytes).encode()))
        conn = self._pool.get_connection()
        try:
            conn.send_packed_command(parts)
            conn.read_response()
            if not track:
                return None
            try:
                return conn.read_response()
            except self._redis.exceptions.NoScriptError:  # a restarted server forgot the script
                pass
        except BaseException:
            conn.disconnect()  # the stream may be mid-reply: never reuse it
            raise
        finally:
            self._pool.release(conn)
        return self._client.eval(_ACCOUNT_PUT, 4, *self._acct, bytes(key), view.nbytes)

    def _put_cluster(self, key: Key, header: bytes, view: memoryview):
        rkey = self._key(key)
        self._client.set(rkey, header + view.tobytes(), px=self._ttl_ms or None)
        if not self.config.capacity:
            return None
        return self._client.eval(_ACCOUNT_PUT, 4, *self._acct, bytes(key), view.nbytes)

    def _evict(self) -> None:
        """Pop the oldest entries until the shared total fits ``capacity``; delete their data."""

        def run():
            victims = self._client.eval(_ACCOUNT_EVICT, 3, *self._acct[:3], self.config.capacity, 1024)
            if victims:
                pipe = self._client.pipeline(transaction=False)
                for member in victims:
                    pipe.delete(self._prefix + member)
                pipe.execute()
            return len(victims or ())

        n = self._call(run, 0)
        if n:
            self.stats.add(evictions=n)

    def delete(self, key: Key) -> bool:
        def run():
            removed = self._client.delete(self._key(key))
            if self.config.capacity:
                self._client.eval(_ACCOUNT_DEL, 3, *self._acct[:3], bytes(key))
            return bool(removed)

        removed = self._call(run, False)
        if removed:
            self.stats.add(deletes=1)
        return removed

    def keys(self) -> Iterator[Key]:
        """Keys under ``prefix`` (SCAN: a weakly consistent snapshot; empty on a fault)."""
        pattern = _glob_escape(self._prefix) + b"*"
        want = len(self._prefix) + 32

        def run():
            return [k[len(self._prefix):] for k in self._client.scan_iter(match=pattern, count=1000)
                    if len(k) == want and k.startswith(self._prefix)]

        return iter(self._call(run, []))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in (self._client, self._lookup):
            try:
                client.close()
            except Exception:  # closing a dead connection must not raise into the caller
                pass

    def __repr__(self) -> str:
        return f"RedisTier(name={self.name!r}, url={_redact(self.config.url)!r}, prefix={self.config.prefix!r})"


_PUT_SHA = hashlib.sha1(_ACCOUNT_PUT.encode()).hexdigest().encode()
_FAULT = object()  # marks "the call failed" apart from "the key is absent"


def _check_deadlines(config: RedisConfig, name: str) -> None:
    """ConfigError (one line: key and valid range) for a deadline or window out of range."""
    for key, value, hi in (("connect_timeout_s", config.connect_timeout_s, 60.0),
                           ("lookup_timeout_s", config.lookup_timeout_s, 60.0),
                           ("timeout_s", config.timeout_s, 600.0)):
        if not 0 < value <= hi:  # also rejects NaN
            raise ConfigError(f"{name}.{key}: must be in (0, {hi:g}] seconds, got {value!r}")
    if not 1 <= config.backoff_ms <= config.max_backoff_ms <= 3_600_000:
        raise ConfigError(f"{name}.backoff_ms, max_backoff_ms: need 1 <= backoff_ms <= max_backoff_ms "
                          f"<= 3600000, got {config.backoff_ms}, {config.max_backoff_ms}")


def _bulk(*args: bytes) -> bytes:
    """RESP bulk strings for small byte arguments."""
    return b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _pack(*args: bytes) -> bytes:
    """RESP encoding of a command whose arguments are all small bytes."""
    return b"*%d\r\n" % len(args) + _bulk(*args)


def _glob_escape(raw: bytes) -> bytes:
    """Escape Redis glob metacharacters so SCAN MATCH treats ``raw`` literally."""
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)

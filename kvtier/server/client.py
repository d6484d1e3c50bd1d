"""ServerStore: a ``KVStore`` (``kvtier.store.base``) that talks to a per-node ``kvtier serve``.

It implements the store primitives (``lookup``, ``read``, ``write``, ``delete``, ``take_events``,
``stats``, ``flush``, ``close``) over the server's protocol; ``get_into``/``get``/``put`` come
from ``KVStore``. Payloads are never sent over the socket: ``read`` hands ``consume`` read-only uint8 views of the
server's shared arena (valid during the call only; the pages are leased meanwhile), and
``write`` hands ``fill`` writable views of the arena pages the server reserved for the entry
(a direct write: one copy; see ``kvtier.server.server``), or of the shared staging area when
direct writes do not apply (a server without them, ``direct_writes=False``, an arena page size
that is not a multiple of the OS page, an arena this process cannot map writable, or, with
``write_protect``, no ``mprotect``).

The arena is mapped once, shared. Without direct writes it is mapped read-only: a stray write
of this process cannot corrupt what another engine reads. With them it is mapped writable, and
``read`` still hands out views through a read-only buffer (no view of them can be made
writable) and ``fill`` views of exactly the reserved pages; the
client sends ``commit`` only after ``fill`` returned, so no write of this client lands in an
entry after its commit. ``write_protect=True`` keeps the mapping read-only (``mprotect``) except
for the reserved pages during their ``fill``, so a stray write faults instead; it costs two
``mprotect`` calls per write (on the project's machines about 0.3 ms per 4 MiB written, as much
as half the copy). A direct write whose reserve-to-commit time reached the server's
``lease_timeout_s`` is aborted by the client itself (``lease_expired``) rather than committed.

Batches: ``read_many`` reads up to the server's ``batch_reads`` keys per ``get_many`` round trip
and gives their leases back in one ``release_many``; ``write_many`` writes runs of chunks that
fit the server's ``batch_writes`` and ``write_share`` as one ``reserve_arena_many`` and one
``commit`` (see ``kvtier.server.protocol``). Against a server whose hello names no batches,
both go one chunk at a time.

Trust: before saying hello (and sending its token) on a unix socket, the client checks the
server's peer credentials (``SO_PEERCRED``): its uid must be this process's effective uid or one
of ``allowed_uids``. Before mapping a shared-memory file it checks, on the opened descriptor,
that the file is a regular file owned by a trusted uid (on a unix socket: the server's own),
writable by nobody else, and as large as announced. A failed check raises ``UntrustedServer``
from the constructor; on a later reconnect it is logged and counted (``untrusted``), and the
client keeps serving misses.

Coded arenas: a server whose arena codes its entries (``codec: lossless``) leases a coded entry
as stored, with its codec, raw length and raw checksum, to clients that said in their hello
that they decode it (this client does where ``blosc2`` is installed). ``read`` then decodes the
leased pages into a buffer of its own (``get_into``: straight into the caller's buffer) before
the lease goes back, and hands that to ``consume``. The reply is not trusted: the codec must be
``lossless``, the raw length at most ``max_entry_bytes``, the leased bytes fewer than it, the
frame's own declared size equal to it before a byte is decoded, and the xxh3-64 of the decoded
bytes equal to the checksum. Any failure is a miss (``corrupt``), never an exception or a large
allocation, and the client deletes the key on the server (a garbled entry would miss for every
reader), unless the read outlasted its lease: then the pages may hold another entry, and it is a
``lease_expired`` miss that deletes nothing. A ``blosc2`` that is found but does not import is
this process's fault, not the entry's: coded entries are misses here (``undecodable``, logged
once) and nothing is deleted. Decoding costs this process a core for the read (Blosc2 LZ4 decodes ~2.4 GB/s on one).

Deadlines: every call has a total deadline, lock wait included: ``lookup_timeout`` for the calls
on the engine's scheduling path (``lookup``, ``take_events``), ``timeout`` for data transfer and
the rest (the time spent in the caller's own ``consume``/``fill`` is not counted). A call past its
deadline is answered as a miss (counted under ``timeouts``), the connection is dropped, and a
circuit breaker (``kvtier.tiers.breaker``) skips the server for a growing window; when it is
half-open, one call at a time probes the server again. So a hung (e.g. SIGSTOPped) server costs
each lookup at most ``lookup_timeout``, and the client recovers on its own once it answers.

Faults degrade, they do not raise: while the server is down, hung or restarting, ``read`` returns
None, ``write`` False and ``lookup`` 0, and each is counted (``stats()["client"]``). A restarted
server has new shared-memory files; the client maps them on reconnect. A server that refuses the
client (wrong token, protocol version mismatch) raises ``ServerRejected`` from the constructor, a
configuration mistake the operator must see; the same refusal on a later reconnect is logged and
counted. A read whose copy outlasted the server's lease timeout is a miss (``lease_expired``):
its pages may have been reused meanwhile.

Thread-safety: every method may be called from any thread; requests are serialised on one
connection.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import socket
import stat
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvtier.buffers import BufferTooSmall, Scratch, byte_view, gather_into
from kvtier.errors import ConfigError, CorruptEntry, KVTierError
from kvtier.keys import Key
from kvtier.server import protocol as P
from kvtier.store.base import KVStore, WriteItem
from kvtier.store.events import StoreEvent
from kvtier.tiers.breaker import CircuitBreaker

log = logging.getLogger(__name__)


class UntrustedServer(KVTierError):
    """The peer on the server address, or a file it named, is not one this client may trust."""


@dataclass(frozen=True)
class RemoteTier:
    """Name of one of the server's tiers (what ``TieredStore.tiers`` gives, for logs)."""

    name: str


@dataclass
class _ClientCounters:
    requests: int = 0
    errors: int = 0  # requests that failed on the connection
    unavailable: int = 0  # calls answered as a miss because the server was not reachable
    timeouts: int = 0  # calls that ran past their deadline (lock wait or server)
    reconnects: int = 0
    rejected: int = 0
    untrusted: int = 0  # connections refused by the peer-credential or file checks
    hits: int = 0
    misses: int = 0
    lease_expired: int = 0  # reads whose copy outlasted the server's lease (answered as a miss)
    writes: int = 0
    write_failures: int = 0
    direct_writes: int = 0  # writes that took the direct path (one copy into the arena)
    decoded: int = 0  # reads of coded arena entries decoded here
    corrupt: int = 0  # coded entries that failed the checks or did not decode (misses; deleted)
    undecodable: int = 0  # coded entries this process could not decode: its codec library does not load (misses)


@dataclass
class _Mapping:
    """The server's shared files as this process sees them."""

    server_id: str
    arena: np.ndarray  # read-only
    staging: np.ndarray
    tiers: list = field(default_factory=list)
    lease_timeout_s: float = math.inf
    writer: "_ArenaWriter | None" = None  # direct writes into the arena (None: staged writes)
    batch_items: int = 1  # the most chunks one batched direct write may hold (1: no batches)
    write_share: int = 0  # the most arena bytes one batch may hold (this connection's write share)
    page_size: int = 1  # the arena's page: the share counts each chunk in whole pages
    read_batch: int = 1  # the most keys one get_many should hold (1: the server takes no get_many)


class ServerStore(KVStore):
    """Client of a ``kvtier serve`` process (see the module docstring).

    address: ``unix:///path.sock`` or ``tcp://host:port``.
    token: the server's shared secret, if it has one.
    timeout: total deadline (s) of a data call (get/reserve/commit/delete/stats, and connecting).
    lookup_timeout: total deadline (s) of ``lookup`` and ``take_events`` (the scheduler's path).
    backoff, max_backoff: the circuit breaker's first and largest window (s) after a fault.
    connect_timeout: bound (s) of the connect itself, within the call's deadline.
    allowed_uids: uids besides this process's own that the server may run as.
    direct_writes: write straight into the server's arena where the server offers it (one copy);
        False: always through the staging area (two copies; the path before direct writes).
    write_protect: with direct writes, keep the arena mapping read-only except for the pages
        being filled (see the module docstring: safer, slower).
    max_entry_bytes: the largest raw entry this client decodes (a coded entry declaring more is
        corrupt: nothing is allocated for it).
    reply_poll_s: how long a call polls (spinning, yielding the CPU between polls) for the
        server's reply before it blocks; 0: it always blocks. A reply is due within a fraction
        of a millisecond; a blocked thread's wake-up costs ~0.1 ms where idle vCPUs halt. The
        client stops polling while its replies take longer than that on average (a busy
        server: the spin would only take a core from it) and resumes once they are fast again
        (``protocol.Poller``).
    """

    def __init__(self, address: str, token: str | None = None, timeout: float = 5.0,
                 backoff: float = 0.2, max_backoff: float = 2.0, connect_timeout: float = 1.0,
                 lookup_timeout: float = 0.25, allowed_uids: Sequence[int] = (), direct_writes: bool = True,
                 write_protect: bool = False, max_entry_bytes: int = 1024**3, reply_poll_s: float = 0.0005):
        for name, value in (("timeout", timeout), ("lookup_timeout", lookup_timeout),
                            ("connect_timeout", connect_timeout), ("backoff", backoff)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ServerStore {name}: {value!r} must be a positive number of seconds")
        if not (isinstance(reply_poll_s, (int, float)) and math.isfinite(reply_poll_s) and 0 <= reply_poll_s <= 0.1):
            raise ValueError(f"ServerStore reply_poll_s: {reply_poll_s!r} must be 0 to 0.1 seconds")
        self._poller = P.Poller(reply_poll_s)
        if not (isinstance(max_entry_bytes, int) and max_entry_bytes > 0):
            raise ValueError(f"ServerStore max_entry_bytes: {max_entry_bytes!r} must be a positive number of bytes")
        self._max_entry = max_entry_bytes
        self._decodes = _can_decode()
        self._codec_loaded = False  # the codec library imported here (checked at the first coded entry)
        self._scratch = Scratch()
        self.address = address
        self._family, self._where = P.parse_address(address)
        self._token = token
        self._direct = bool(direct_writes)
        self._write_protect = bool(write_protect)
        self._timeout = float(timeout)
        self._lookup_timeout = float(lookup_timeout)
        self._connect_timeout = float(connect_timeout)
        self._trusted = frozenset({os.geteuid(), *(int(u) for u in allowed_uids)})
        self._breaker = CircuitBreaker(backoff, max_backoff)
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._map: _Mapping | None = None
        self._counters = _ClientCounters()
        self._closed = False
        try:
            self._connect(time.monotonic() + self._timeout)
        except (P.ServerRejected, UntrustedServer):
            raise
        except (OSError, P.ProtocolError, KeyError, TypeError) as exc:
            log.warning("kvtier: cache server %s not reachable yet (%s); serving misses until it is", address, exc)
            self._breaker.failure()

    def __repr__(self) -> str:  # the token stays out
        return f"ServerStore({self.address!r}, connected={self.connected})"

    # ----------------------------------------------------------------------------- connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def tiers(self) -> list[RemoteTier]:
        """The server's tiers, fastest first (empty while not connected)."""
        m = self._map
        return list(m.tiers) if m is not None else []

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def _connect(self, deadline: float) -> None:
        """Connect, check the peer, say hello, map the shared files, all by ``deadline``.

        Raises OSError (TimeoutError past the deadline, ConnectionError when the server is busy),
        ProtocolError, ServerRejected or UntrustedServer.
        """
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, min(self._connect_timeout, deadline - time.monotonic())))
            sock.connect(self._where)
            peer_uid = None
            if self._family == socket.AF_UNIX:
                peer_uid = _peer_uid(sock)
                if peer_uid not in self._trusted:
                    raise UntrustedServer(
                        f"kvtier: the server on {self._where} runs as uid {peer_uid}, not as this process's uid "
                        f"{os.geteuid()} or an allowed uid ({sorted(self._trusted)}); not connecting")
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = {"op": "hello", "version": P.VERSION, "token": self._token}
            if self._decodes:
                hello["decodes"] = ["lossless"]
            P.send_by(sock, hello, deadline)
            reply = P.recv(sock, deadline=deadline)
            if reply is None:
                raise ConnectionError("server closed the connection during hello")
            if not reply.get("ok"):
                if reply.get("error") == P.BUSY:
                    raise ConnectionError(f"server busy: {reply.get('message')}")
                raise P.ServerRejected(str(reply.get("error")), str(reply.get("message")))
            if self._map is None or self._map.server_id != reply["server_id"]:
                owners = {peer_uid} if peer_uid is not None else self._trusted
                arena, writer = self._map_arena(reply, owners)
                self._map = _Mapping(
                    reply["server_id"], arena,
                    _map_file(reply["staging"]["path"], reply["staging"]["size"], owners, writable=True),
                    [RemoteTier(n) for n in reply.get("tiers", [])],
                    float(reply.get("lease_timeout_s", math.inf)),
                    writer,
                    *_batch_limits(reply),
                    _read_batch_limit(reply),
                )
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def _map_arena(self, reply: dict, owners) -> "tuple[np.ndarray, _ArenaWriter | None]":
        """The arena as read-only views and, where direct writes apply, its writer; else (logged
        once per mapping) a read-only mapping and no writer."""
        path, size = reply["arena"]["path"], reply["arena"]["size"]
        page = reply.get("page_size")
        if self._direct and reply.get("direct_writes") is True and isinstance(page, int) and page > 0:
            why = None
            if page % mmap.PAGESIZE:
                why = f"its page size {page} is not a multiple of the OS page ({mmap.PAGESIZE})"
            else:
                try:
                    writable = _map_file(path, size, owners, writable=True)
                    return _readonly(writable), _ArenaWriter(writable, self._write_protect)
                except (OSError, AttributeError) as exc:  # no write access, no mprotect
                    why = f"the arena cannot be mapped for writing ({exc})"
            log.info("kvtier: cache server %s: writes go through the staging area: %s", self.address, why)
        return _map_file(path, size, owners, writable=False), None

    def _ensure(self, deadline: float) -> bool:
        """Connected, reconnecting when the breaker allows; False (counted) if not."""
        if self._sock is not None:
            return True
        if self._closed or not self._breaker.allow():
            self._counters.unavailable += 1
            return False
        try:
            self._connect(deadline)
        except P.ServerRejected as exc:
            self._counters.rejected += 1
            log.warning("kvtier: %s", exc)
        except UntrustedServer as exc:
            self._counters.untrusted += 1
            log.warning("%s", exc)
        except TimeoutError:
            self._counters.timeouts += 1
        except (OSError, P.ProtocolError, KeyError, TypeError):
            pass
        else:
            self._breaker.success()
            self._counters.reconnects += 1
            log.info("kvtier: reconnected to cache server %s", self.address)
            return True
        self._counters.unavailable += 1
        self._breaker.failure()
        return False

    def _drop(self) -> None:
        """Forget a broken or late connection (the mapping stays until a new server id is seen)."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._counters.errors += 1
        self._breaker.failure()

    @contextmanager
    def _session(self, budget: float) -> Iterator[float | None]:
        """Hold the connection for one call: yields its deadline, or None (a counted timeout)
        when the lock could not be had within ``budget`` seconds."""
        deadline = time.monotonic() + budget
        if not self._lock.acquire(timeout=budget):
            self._counters.timeouts += 1
            yield None
            return
        try:
            yield deadline
        finally:
            self._lock.release()

    def _call(self, message: dict[str, Any], deadline: float, reply: bool = True) -> dict[str, Any] | None:
        """One request by ``deadline`` (lock held by the caller); None when the server is
        unavailable, late (the connection is then dropped) or answers an error."""
        if not self._ensure(deadline):
            return None
        self._counters.requests += 1
        try:
            sent = time.monotonic()
            P.send_by(self._sock, message, deadline)
            if not reply:
                return {"ok": True}
            self._poller.poll(self._sock, max(0.0, deadline - sent))
            answer = P.recv(self._sock, deadline=deadline)
            self._poller.observe(time.monotonic() - sent)
            if answer is None:
                raise ConnectionError("server closed the connection")
        except TimeoutError:
            self._counters.timeouts += 1
            self._drop()
            return None
        except (OSError, P.ProtocolError):
            self._drop()
            return None
        if not answer.get("ok"):
            log.warning("kvtier: cache server error on %s: %s", message.get("op"), answer.get("message"))
            self._counters.errors += 1
            return None
        return answer

    # ----------------------------------------------------------------------------- store API

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` the server holds in some tier (0 while unreachable or past
        ``lookup_timeout``)."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return 0
        with self._session(self._lookup_timeout) as deadline:
            answer = self._call({"op": "lookup", "keys": keys}, deadline) if deadline else None
        return int(answer["n"]) if answer is not None else 0

    def read(self, key: Key, consume: Callable[[list], None]) -> str | None:
        """Hand ``key``'s payload to ``consume`` as read-only views of the shared arena (of this
        client's decoded copy for a coded entry).

        Returns the name of the server tier it came from, or None on a miss or a fault (also when
        ``consume`` finished after the server's lease timeout: the pages may have changed under
        it, so what it copied must not be used). The views are valid only during the call. An
        exception from ``consume`` propagates (after the lease is released).
        """
        return self._read(key, consume, None)

    @property
    def reads_in_batches(self) -> bool:
        """Whether a batch of reads is one ``get_many`` round trip here (see ``read_many``): the
        server said so in its hello (not one from before batched reads, nor a client not yet
        connected)."""
        mapping = self._map
        return mapping is not None and mapping.read_batch > 1

    def read_many(self, keys: Sequence[Key], consume: Callable[[int, list], None]) -> list[str | None]:
        """``KVStore.read_many`` in batches of at most ``MAX_BATCH_ITEMS`` keys: one ``get_many``
        (a lease per hit), ``consume(i, views)`` for each raw hit (read-only views of the shared
        arena), then one ``release_many``. A batch whose copies outlasted the server's lease
        timeout is all misses (the pages may have changed under them, as in ``read``). Coded
        entries are read one at a time after their batch (``read``: decoded here). An exception
        from ``consume`` propagates after the batch's leases are released."""
        mapping = self._map
        step = mapping.read_batch if mapping is not None else 1
        if step <= 1:  # a server that takes no get_many (or none reached yet): one read per key
            return super().read_many(keys, consume)
        keys = [bytes(k) for k in keys]
        found: list[str | None] = [None] * len(keys)
        valid = [i for i, k in enumerate(keys) if P.is_key(k)]  # any other key is a miss, not the batch's end
        self._counters.misses += len(keys) - len(valid)
        for start in range(0, len(valid), step):
            index = valid[start : start + step]
            coded = self._read_batch([keys[i] for i in index], index, consume, found)
            for i in coded:
                found[i] = self._read(keys[i], lambda views, i=i: consume(i, views), None)
        return found

    def _read_batch(self, keys: list[bytes], index: list[int], consume: Callable[[int, list], None],
                    found: list[str | None]) -> list[int]:
        """One ``get_many`` of ``keys`` (the caller's indexes ``index``), recording hits in
        ``found``; the indexes of coded hits, left to ``read``. An item is a hit only with a
        tier name and an integer lease (anything else from the server is a miss)."""
        n = len(keys)
        with self._session(self._timeout) as deadline:
            if deadline is None:
                self._counters.misses += n
                return []
            started = time.monotonic()
            answer = self._call({"op": "get_many", "keys": keys}, deadline)
            items = answer.get("items") if answer is not None else None
            if not (isinstance(items, list) and len(items) == n and all(isinstance(it, dict) for it in items)):
                self._counters.misses += n
                if answer is not None:  # a reply this client cannot trust: its leases end with the connection
                    self._counters.errors += 1
                    self._drop()
                return []
            leases = [it["lease"] for it in items if type(it.get("lease")) is int]
            hits, coded = [], []
            copy_start = time.monotonic()
            try:
                for i, item in enumerate(items):
                    if not isinstance(item.get("tier"), str) or type(item.get("lease")) is not int:
                        if item.get("tier") is not None:  # a hit the reply does not vouch for
                            self._counters.errors += 1
                        continue
                    if item.get("codec") is not None:
                        coded.append(index[i])
                        continue
                    views = self._arena_views(item)
                    if views is not None:
                        consume(index[i], views)
                        hits.append(i)
            finally:
                copied = time.monotonic()
                if leases:
                    self._call({"op": "release_many", "leases": leases}, deadline + (copied - copy_start), reply=False)
            if hits and copied - started >= self._map.lease_timeout_s:
                self._counters.lease_expired += 1
                log.warning("kvtier: a batch of reads took %.1f s, past the server's %.1f s lease; treated as misses",
                            copied - started, self._map.lease_timeout_s)
                hits = []
            for i in hits:
                found[index[i]] = items[i]["tier"]
            self._counters.hits += len(hits)
            self._counters.misses += n - len(hits) - len(coded)
            return coded

    def get_into(self, key: Key, out: Any) -> int | None:
        """``KVStore.get_into``; a coded entry is decoded straight into ``out`` (no copy more)."""
        dst = byte_view(out)
        written = 0

        def consume(segments: list) -> None:
            nonlocal written
            written = gather_into(segments, dst)

        def decoded(n: int) -> None:
            nonlocal written
            written = n

        try:
            found = self._read(key, consume, (dst, decoded))
        except BufferTooSmall:
            self._count_error()
            return None
        return written if found is not None else None

    def _read(self, key: Key, consume: Callable[[list], None], into) -> str | None:
        """``read``; ``into`` = (buffer, callback): a coded entry is decoded into the buffer when
        it is large enough, and then the callback is told its size instead of calling ``consume``."""
        with self._session(self._timeout) as deadline:
            if deadline is None:
                self._counters.misses += 1
                return None
            started = time.monotonic()
            answer = self._call({"op": "get", "key": bytes(key)}, deadline)
            hit = answer is not None and isinstance(answer.get("tier"), str) and type(answer.get("lease")) is int
            if answer is not None and answer.get("tier") is not None and not hit:
                self._counters.errors += 1  # a hit the reply does not vouch for (no lease, no tier name)
            views = self._arena_views(answer) if hit else None
            if views is not None and answer.get("codec") is not None and not self._codec_ready():
                self._counters.undecodable += 1
                views = None  # this process's fault, not the entry's: a miss that deletes nothing
            if views is None:
                self._counters.misses += 1
                if answer is not None and type(answer.get("lease")) is int:
                    self._call({"op": "release", "lease": answer["lease"]}, deadline, reply=False)
                return None
            lease_timeout = self._map.lease_timeout_s
            copy_start = time.monotonic()
            direct, problem = False, None
            try:
                if answer.get("codec") is not None:
                    views, direct, problem = self._decode(answer, views, into)
                if not (problem or direct):
                    consume(views)
            finally:
                copied = time.monotonic()
                self._call({"op": "release", "lease": answer["lease"]}, deadline + (copied - copy_start), reply=False)
            # past the lease first: the pages may hold another entry by then, which is no sign
            # that the key's entry is garbled (a delete could remove a good one written since)
            if problem and copied - started < lease_timeout:
                log.warning("kvtier: cache server %s: a coded entry fails its checks (%s); a miss, and deleted",
                            self.address, problem)
                self._counters.corrupt += 1
                self._counters.misses += 1
                self._call({"op": "delete", "key": bytes(key)}, deadline + (copied - copy_start))
                return None
            if copied - started >= lease_timeout:
                self._counters.lease_expired += 1
                self._counters.misses += 1
                log.warning("kvtier: a read took %.1f s, past the server's %.1f s lease; treated as a miss",
                            copied - started, lease_timeout)
                return None
            self._counters.hits += 1
            return answer["tier"]

    def _codec_ready(self) -> bool:
        """Whether this process can decode coded entries: the codec library (found at start)
        imports. A failure is logged once, and later hellos no longer say that this client
        decodes (the server then answers coded entries as misses without a lease)."""
        if self._codec_loaded:
            return True
        from kvtier.codecs import get_codec

        try:
            get_codec("lossless", "kvtier client")
        except ConfigError as exc:
            if self._decodes:
                self._decodes = False
                log.warning("kvtier: cache server %s: cannot decode the server's coded entries (%s); they are "
                            "misses here", self.address, exc)
            return False
        self._codec_loaded = True
        return True

    def _decode(self, answer: dict, views: list[np.ndarray], into) -> tuple[list | None, bool, str | None]:
        """The raw bytes of a coded entry leased as ``views`` (see the module notes): (one
        read-only segment, False, None), or ([], True, None) when decoded into ``into``'s buffer
        (its callback told), or (None, False, the problem) when a check fails or it does not
        decode (the caller logs it)."""
        from kvtier.codecs import LOSSLESS_ID, decode_into
        from kvtier.entry import checksum

        codec, raw, digest = answer.get("codec"), answer.get("raw"), answer.get("checksum")
        stored = sum(int(v.size) for v in views)
        problem = None
        direct = False
        if codec != LOSSLESS_ID or isinstance(codec, bool):
            problem = f"codec {codec!r} is not one this client decodes"
        elif not (isinstance(raw, int) and not isinstance(raw, bool) and 0 < raw <= self._max_entry):
            problem = f"raw length {raw!r} outside 1..{self._max_entry}"
        elif not (isinstance(digest, int) and not isinstance(digest, bool) and 0 <= digest < 1 << 64):
            problem = f"checksum {digest!r} is not a 64-bit value"
        elif not 0 < stored < raw:
            problem = f"{stored} stored bytes for {raw} raw bytes"
        if problem is None:
            if len(views) == 1:
                src = views[0]
            else:
                src = self._scratch.get(stored, "coded")
                gather_into(views, src)
            direct = into is not None and into[0].size >= raw
            target = into[0][:raw] if direct else self._scratch.get(raw, "raw")
            try:
                decode_into(codec, memoryview(src), memoryview(target), 2)
                if checksum(target) != digest:
                    raise CorruptEntry("checksum of the decoded bytes does not match")
            except CorruptEntry as exc:
                problem = str(exc)
        if problem is not None:
            return None, False, problem
        self._counters.decoded += 1
        if direct:
            into[1](raw)
            return [], True, None
        return [_readonly(target)], False, None

    def _arena_views(self, answer: dict) -> list[np.ndarray] | None:
        """Read-only views of the extents a ``get`` answered; None (an error) when one lies
        outside the arena."""
        arena = self._map.arena
        views = []
        try:
            for off, length in answer["extents"]:
                if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 <= length
                        and off + length <= arena.size):
                    raise ValueError("extent outside the arena")
                views.append(arena[off : off + length])
        except (ValueError, TypeError, KeyError):
            self._counters.errors += 1
            return None
        return views

    def write(self, key: Key, nbytes: int, fill: Callable[[list], None], parent: Key | None = None,
              chunk_index: int = 0) -> bool:
        """Store a chunk: ``fill(segments)`` copies its ``nbytes`` into shared pages: the arena
        pages the server reserved for it (direct), or staging pages (see the module docstring).

        Returns True if the server holds the entry afterwards (also when it already did), False
        when it could not take it (no room, this client's write share used up, a delete of the key
        during the fill, a fault, the deadline, the write lease; counted). An exception from
        ``fill`` propagates after the reservation is given back.
        """
        with self._session(self._timeout) as deadline:
            self._counters.writes += 1
            if deadline is None or not self._ensure(deadline):
                self._counters.write_failures += 1
                return False
            request = {"key": bytes(key), "nbytes": int(nbytes),
                       "parent": bytes(parent) if parent is not None else None, "chunk_index": int(chunk_index)}
            writer = self._map.writer
            if writer is not None:
                return self._write_direct(writer, request, fill, deadline)
            return self._write_staged(request, fill, deadline)

    def write_many(self, items: Sequence[WriteItem]) -> list[bool]:
        """Store several chunks, for each what ``write`` would return. With direct writes and a
        server that takes batches, consecutive items go in batches of at most its ``batch_writes``
        chunks and ``write_share`` bytes: one reserve and one commit round trip per batch (see
        ``kvtier.server.protocol``); otherwise one ``write`` each. An exception from a ``fill``
        propagates after its batch's pages are given back (nothing of that batch is stored;
        earlier batches may be)."""
        results: list[bool] = []
        for batch in self._batches(items):
            results.extend(self._write_batch(batch) if len(batch) > 1 else self._write_each(batch))
        return results

    def _write_each(self, items: list[WriteItem]) -> list[bool]:
        """One ``write`` per item (a run the server does not take as one batch)."""
        return [self.write(i.key, i.nbytes, i.fill, i.parent, i.chunk_index) for i in items]

    def _batches(self, items: Sequence[WriteItem]) -> Iterator[list[WriteItem]]:
        """``items`` in order, cut into runs the server takes as one batch (the current
        mapping's limits; runs of one where it takes none)."""
        mapping = self._map  # read once: a reconnect or close may replace it meanwhile
        limit, share, page = (mapping.batch_items, mapping.write_share, mapping.page_size) \
            if mapping is not None else (1, 0, 1)
        batch: list[WriteItem] = []
        held = 0
        for item in items:
            pages = -(-item.nbytes // page) * page  # as the server counts it
            if batch and (len(batch) >= limit or held + pages > share):
                yield batch
                batch, held = [], 0
            batch.append(item)
            held += pages
        if batch:
            yield batch

    def _write_batch(self, batch: list[WriteItem]) -> list[bool]:
        """One ``reserve_arena_many``: fill every reserved item, then ``commit`` (lock held). A
        ``quota`` answer (the share changed under a reconnect) falls back to one write each."""
        n = len(batch)
        failed = [False] * n
        with self._session(self._timeout) as deadline:
            if deadline is None or not self._ensure(deadline):
                self._counters.writes += n
                self._counters.write_failures += n
                return failed
            writer = self._map.writer
            if writer is None or self._map.batch_items < n:  # reconnected to a server that takes no such batch
                return self._write_each(batch)
            request = {"op": "reserve_arena_many", "items": [
                {"key": bytes(i.key), "nbytes": int(i.nbytes),
                 "parent": bytes(i.parent) if i.parent is not None else None,
                 "chunk_index": int(i.chunk_index)} for i in batch]}
            started = time.monotonic()
            answer = self._call(request, deadline)
            if answer is not None and answer.get("status") == "quota":  # the share shrank under a reconnect
                return self._write_each(batch)
            self._counters.writes += n
            plan = _batch_plan(answer, writer.size, [i.nbytes for i in batch])
            if plan is None:
                self._counters.write_failures += n
                if answer is not None:  # a reply this client cannot trust: end whatever it reserved
                    self._counters.errors += 1
                    if isinstance(answer.get("lease"), int):
                        self._call({"op": "abort", "lease": answer["lease"]}, deadline, reply=False)
                    else:
                        self._drop()
                return failed
            statuses, extents = plan
            lease = answer.get("lease")
            if "ok" not in statuses:  # nothing reserved: every item held already or refused
                outcome = [st == "exists" for st in statuses]
                self._counters.write_failures += outcome.count(False)
                return outcome
            return self._fill_batch(writer, batch, statuses, extents, lease, deadline, started)

    def _fill_batch(self, writer: "_ArenaWriter", batch: list[WriteItem], statuses: list[str],
                    extents: list, lease: int, deadline: float, started: float) -> list[bool]:
        """Fill a reserved batch's items, then commit it (or abort it); per item, stored."""
        n = len(batch)
        reserved = [ext for ext in extents if ext is not None]
        opened: list = []
        fill_start = time.monotonic()
        try:
            for item, ext in zip(batch, extents):
                if ext is None:
                    continue
                try:
                    segments = writer.enable(ext)
                except OSError as exc:  # the kernel refused: the batch is dropped (a fill's own OSError propagates)
                    log.warning("kvtier: cannot write-enable the reserved arena pages (%s); batch dropped", exc)
                    for done in opened:
                        self._seal(writer, done)
                    self._counters.errors += 1
                    self._counters.write_failures += n
                    self._call({"op": "abort", "lease": lease}, deadline + (time.monotonic() - fill_start),
                               reply=False)
                    return [False] * n
                opened.append(ext)
                item.fill(segments)
        except BaseException:
            for ext in opened:
                self._seal(writer, ext)
            self._call({"op": "abort", "lease": lease}, deadline + (time.monotonic() - fill_start), reply=False)
            raise
        filled = time.monotonic()
        extended = deadline + (filled - fill_start)
        if not all(self._seal(writer, ext) for ext in reserved):
            self._counters.write_failures += n
            self._call({"op": "abort", "lease": lease}, extended, reply=False)
            return [False] * n
        if filled - started >= self._map.lease_timeout_s:
            self._counters.lease_expired += 1
            self._counters.write_failures += n
            log.warning("kvtier: a batched write took %.1f s, past the server's %.1f s lease; aborted",
                        filled - started, self._map.lease_timeout_s)
            self._call({"op": "abort", "lease": lease}, extended, reply=False)
            return [False] * n
        done = self._call({"op": "commit", "lease": lease}, extended)
        stored = done.get("stored") if done is not None else None
        if not (isinstance(stored, list) and len(stored) == n and all(isinstance(v, bool) for v in stored)):
            if done is not None:
                self._counters.errors += 1
            self._counters.write_failures += n
            return [False] * n
        self._counters.write_failures += stored.count(False)
        self._counters.direct_writes += sum(1 for st, ok in zip(statuses, stored) if st == "ok" and ok)
        return stored

    def _write_direct(self, writer: "_ArenaWriter", request: dict, fill: Callable[[list], None],
                      deadline: float) -> bool:
        """``reserve_arena``, ``fill`` into the arena pages (write-enabled meanwhile only), then
        ``commit``; the lease's timeout is checked here before committing (lock held)."""
        started = time.monotonic()
        answer = self._call({"op": "reserve_arena", **request}, deadline)
        status = answer.get("status") if answer is not None else None
        if status == "exists":
            return True
        extents = _extents(answer, writer.size, request["nbytes"]) if status == "ok" else None
        if extents is None:
            self._counters.write_failures += 1
            if status == "ok":  # extents outside the arena: a server this client cannot trust
                self._counters.errors += 1
                if isinstance(answer.get("lease"), int):
                    self._call({"op": "abort", "lease": answer["lease"]}, deadline, reply=False)
                else:
                    self._drop()  # no lease to abort: the connection's end aborts the write
            return False
        lease = answer["lease"]
        try:
            segments = writer.enable(extents)
        except OSError as exc:
            log.warning("kvtier: cannot write-enable the reserved arena pages (%s); write dropped", exc)
            self._counters.errors += 1
            self._counters.write_failures += 1
            self._call({"op": "abort", "lease": lease}, deadline, reply=False)
            return False
        fill_start = time.monotonic()
        try:
            fill(segments)
        except BaseException:
            self._seal(writer, extents)
            self._call({"op": "abort", "lease": lease}, deadline + (time.monotonic() - fill_start), reply=False)
            raise
        if not self._seal(writer, extents):
            self._counters.write_failures += 1
            self._call({"op": "abort", "lease": lease}, deadline + (time.monotonic() - fill_start), reply=False)
            return False
        filled = time.monotonic()
        extended = deadline + (filled - fill_start)
        if filled - started >= self._map.lease_timeout_s:
            self._counters.lease_expired += 1
            self._counters.write_failures += 1
            log.warning("kvtier: a write took %.1f s, past the server's %.1f s lease; aborted",
                        filled - started, self._map.lease_timeout_s)
            self._call({"op": "abort", "lease": lease}, extended, reply=False)
            return False
        done = self._call({"op": "commit", "lease": lease}, extended)
        if done is None or not done.get("stored"):
            self._counters.write_failures += 1
            return False
        self._counters.direct_writes += 1
        return True

    def _seal(self, writer: "_ArenaWriter", extents: list[tuple[int, int]]) -> bool:
        """Make a direct write's pages read-only again; False (logged, and this mapping's direct
        writes switched off: the pages cannot be protected) when the kernel refuses."""
        try:
            writer.disable(extents)
            return True
        except OSError as exc:
            log.error("kvtier: cannot write-protect the arena again (%s); direct writes off, staging from now",
                      exc)
            self._counters.errors += 1
            if self._map is not None and self._map.writer is writer:
                self._map.writer = None
            return False

    def _write_staged(self, request: dict, fill: Callable[[list], None], deadline: float) -> bool:
        """``reserve`` staging pages, ``fill`` them, ``commit`` (the server copies them into the
        store); lock held."""
        answer = self._call({"op": "reserve", **request}, deadline)
        if answer is not None and answer.get("status") == "exists":
            return True
        ok = answer is not None and answer.get("status") == "ok"
        segments = self._staging_views(answer, request["nbytes"]) if ok else None
        if segments is None:
            self._counters.write_failures += 1
            if answer is not None and answer.get("lease") is not None:
                self._call({"op": "abort", "lease": answer["lease"]}, deadline, reply=False)
            return False
        lease = answer["lease"]
        fill_start = time.monotonic()
        try:
            fill(segments)
        except BaseException:
            self._call({"op": "abort", "lease": lease}, deadline + (time.monotonic() - fill_start), reply=False)
            raise
        done = self._call({"op": "commit", "lease": lease}, deadline + (time.monotonic() - fill_start))
        if done is None or not done.get("stored"):
            self._counters.write_failures += 1
            return False
        return True

    def _staging_views(self, answer: dict, nbytes: int) -> list[np.ndarray] | None:
        """Writable views of the staging extents a ``reserve`` answered; None when one lies
        outside the staging area or they do not hold ``nbytes`` in all (``scatter`` refuses
        segments that do not hold the payload exactly)."""
        staging = self._map.staging
        views = []
        try:
            for off, length in answer["extents"]:
                if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 <= length
                        and off + length <= staging.size):
                    raise ValueError("extent outside the staging area")
                views.append(staging[off : off + length])
            if sum(v.size for v in views) != nbytes:
                raise ValueError("extents that do not hold the write")
        except (ValueError, TypeError, KeyError):
            self._counters.errors += 1
            return None
        return views

    def _count_error(self) -> None:
        self._counters.errors += 1

    def delete(self, key: Key) -> bool:
        """Remove ``key`` from every server tier; False when unreachable."""
        with self._session(self._timeout) as deadline:
            return deadline is not None and self._call({"op": "delete", "key": bytes(key)}, deadline) is not None

    def enable_events(self, maxlen: int = 100_000) -> None:
        """Nothing to do: the server always records events (bounded) for whoever asks."""

    def take_events(self) -> list[StoreEvent]:
        """The server's StoreEvents since anyone last asked
        (``[]`` while unreachable or past ``lookup_timeout``: this runs on every engine step)."""
        with self._session(self._lookup_timeout) as deadline:
            answer = self._call({"op": "events"}, deadline) if deadline else None
        if answer is None:
            return []
        return [StoreEvent(kind, bytes(key), medium) for kind, key, medium in answer["events"]]

    def stats(self) -> dict:
        """The server's stats (``{}`` while unreachable) plus this client's counters under "client"."""
        with self._session(self._timeout) as deadline:
            answer = self._call({"op": "stats"}, deadline) if deadline else None
        client = dict(self._counters.__dict__)
        stats = dict(answer["stats"]) if answer is not None else {}
        stats["client"] = client
        return stats

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the server's queued lower-tier writes are done; False on timeout or fault.

        The server waits at most ``protocol.MAX_FLUSH_S``; the call's deadline is that wait plus
        ``timeout`` of this client.
        """
        wait = min(max(float(timeout), 0.0), P.MAX_FLUSH_S)
        with self._session(wait + self._timeout) as deadline:
            answer = self._call({"op": "flush", "timeout": wait}, deadline) if deadline else None
        return bool(answer and answer["done"])

    def close(self) -> None:
        """Close the connection (the server gives back any lease it still held for us)."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._map = None

    def __enter__(self) -> "ServerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _can_decode() -> bool:
    """Whether this process can decode coded arena entries (blosc2 is installed; not imported
    here: it is imported by the first decode)."""
    import importlib.util

    return importlib.util.find_spec("blosc2") is not None


def _extents(answer: dict, size: int, nbytes: int) -> list[tuple[int, int]] | None:
    """The (offset, length) extents a ``reserve_arena`` answered, checked: an int lease, each
    extent inside the arena of ``size`` bytes and starting on an OS page (write protection is
    per OS page), ``nbytes`` in all. None when any check fails."""
    try:
        if not isinstance(answer["lease"], int):
            return None
        extents = [(off, length) for off, length in answer["extents"]]
    except (KeyError, TypeError, ValueError):
        return None
    total = 0
    for off, length in extents:
        if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 <= length
                and off + length <= size and off % mmap.PAGESIZE == 0):
            return None
        total += length
    return extents if total == nbytes else None


def _batch_limits(hello: dict) -> tuple[int, int, int]:
    """(most chunks, most arena bytes, arena page) of one batched direct write the server's
    hello reply allows; (1, 0, 1), no batches, for a server that names none (one before
    batches) or malformed limits."""
    items, share, page = hello.get("batch_writes"), hello.get("write_share"), hello.get("page_size")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (items, share, page)) \
            and items > 1 and share > 0 and page > 0:
        return min(items, P.MAX_BATCH_ITEMS), share, page
    return 1, 0, 1


def _read_batch_limit(hello: dict) -> int:
    """The most keys one ``get_many`` should hold, from the server's hello reply (at most
    ``MAX_BATCH_ITEMS``); 1, no batched reads, for a server that names none or nonsense."""
    limit = hello.get("batch_reads")
    return min(limit, P.MAX_BATCH_ITEMS) if type(limit) is int and limit > 1 else 1


def _batch_plan(answer: dict | None, size: int, sizes: list[int]) -> tuple[list[str], list] | None:
    """Each item's status and checked extents (None unless reserved) from a
    ``reserve_arena_many`` reply for items of ``sizes`` bytes; None when the reply is missing,
    malformed, has extents outside the arena of ``size`` bytes or off an OS page, of the wrong
    total, or overlapping another item's, or announces pages without a lease."""
    if answer is None or answer.get("status") != "ok":
        return None
    items = answer.get("items")
    if not isinstance(items, list) or len(items) != len(sizes):
        return None
    statuses: list[str] = []
    plan: list = []
    for item, nbytes in zip(items, sizes):
        status = item.get("status") if isinstance(item, dict) else None
        if status not in ("ok", "exists", "full"):
            return None
        extents = _extents({"lease": answer.get("lease"), "extents": item.get("extents")}, size, nbytes) \
            if status == "ok" else None
        if status == "ok" and extents is None:
            return None
        statuses.append(status)
        plan.append(extents)
    if "ok" in statuses and not isinstance(answer.get("lease"), int):
        return None
    spans = sorted((off, off + length) for extents in plan if extents for off, length in extents if length)
    if any(prev_end > start for (_, prev_end), (start, _) in zip(spans, spans[1:])):
        return None
    return statuses, plan


def _readonly(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` through a read-only buffer: neither it nor any view of it can be made
    writable (``flags.writeable = True`` raises), so what ``read`` hands out stays read-only."""
    return np.frombuffer(memoryview(array).toreadonly(), dtype=np.uint8) if array.size else array


def _libc_mprotect():
    """libc's ``mprotect`` through ctypes (AttributeError where there is none)."""
    fn = ctypes.CDLL(None, use_errno=True).mprotect
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


class _ArenaWriter:
    """The arena's shared writable mapping. With ``protect`` it is kept read-only (``mprotect``)
    except for the extents between ``enable`` and ``disable``; without, those two only hand out
    views. Used under the client's lock only."""

    def __init__(self, array: np.ndarray, protect: bool):
        self._array = array
        self.size = int(array.size)
        self._base = int(array.__array_interface__["data"][0]) if array.size else 0
        self._mprotect = _libc_mprotect() if protect else None
        self._protect(0, self.size, mmap.PROT_READ)

    def _protect(self, off: int, length: int, prot: int) -> None:
        """Set the protection of bytes [off, off + length) (whole OS pages; ``off`` is aligned);
        OSError when the kernel refuses. Nothing without write protection."""
        if self._mprotect is not None and length and self._mprotect(self._base + off, length, prot) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect: {os.strerror(err)}")

    def enable(self, extents: list[tuple[int, int]]) -> list[np.ndarray]:
        """Make ``extents`` writable; their writable views. OSError (nothing left writable) when
        the kernel refuses."""
        done = []
        try:
            for off, length in extents:
                self._protect(off, length, mmap.PROT_READ | mmap.PROT_WRITE)
                done.append((off, length))
        except OSError:
            self.disable(done)
            raise
        return [self._array[off : off + length] for off, length in extents]

    def disable(self, extents: list[tuple[int, int]]) -> None:
        """Make ``extents`` read-only again; OSError when the kernel refuses."""
        for off, length in extents:
            self._protect(off, length, mmap.PROT_READ)


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _map_file(path: str, size: int, owners: set | frozenset, writable: bool) -> np.ndarray:
    """Map a server's shared-memory file as a uint8 array (read-only unless ``writable``).

    Checked on the opened descriptor before mapping (no window for a swap): a regular file (no
    symlink followed), owned by one of ``owners``, not writable by group or others, at least
    ``size`` bytes. UntrustedServer otherwise (one line naming the file and the problem).
    """
    if not isinstance(path, str) or not isinstance(size, int) or size < 0:
        raise UntrustedServer(f"kvtier: the server named an invalid shared-memory file {path!r} ({size!r} bytes)")
    if not size:
        return np.empty(0, dtype=np.uint8)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise  # a server that went away meanwhile: transient, retried later
    except OSError as exc:
        raise UntrustedServer(f"kvtier: cannot open the server's shared-memory file {path}: "
                              f"{exc.strerror or exc}; not mapping it") from exc
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid not in owners:
            problem = f"belongs to uid {st.st_uid}, not the server's ({sorted(owners)})"
        elif st.st_mode & 0o022:
            problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
        elif st.st_size < size:
            problem = f"holds {st.st_size} bytes, fewer than the {size} announced"
        if problem:
            raise UntrustedServer(f"kvtier: shared-memory file {path} {problem}; not mapping it")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return np.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot), dtype=np.uint8)
    finally:
        os.close(fd)

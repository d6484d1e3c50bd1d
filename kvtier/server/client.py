"""ServerStore: a TieredStore look-alike that talks to a per-node ``kvtier serve``.

It offers the methods the vLLM connector uses on a TieredStore (``lookup``, ``read``, ``write``,
``take_events``, ``stats``, ``flush``, ``close``) plus ``get_into``/``get``/``put``/``delete``.
Payloads are never sent over the socket: ``read`` hands ``consume`` read-only uint8 views of the
server's shared arena (valid during the call only; the pages are leased meanwhile), and
``write`` hands ``fill`` writable views of the shared staging area.

Faults degrade, they do not raise: while the server is down or restarting, ``read`` returns
None, ``write`` False and ``lookup`` 0, and each is counted (``stats()["client"]``). The client
reconnects by itself on a later call once a short backoff has passed, and maps the new arena
(a restarted server has new shared-memory files). A server that refuses the client (wrong
token, protocol version mismatch) raises ``ServerRejected`` from the constructor, a configuration
mistake the operator must see; the same refusal on a later reconnect is logged and counted.

Thread-safety: every method may be called from any thread; requests are serialised on one
connection.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.server import protocol as P

log = logging.getLogger(__name__)

Key = bytes


@dataclass(frozen=True)
class RemoteTier:
    """Name of one of the server's tiers (what ``TieredStore.tiers`` gives, for logs)."""

    name: str


@dataclass
class _ClientCounters:
    requests: int = 0
    errors: int = 0  # requests that failed on the connection
    unavailable: int = 0  # calls answered as a miss because the server was not reachable
    reconnects: int = 0
    rejected: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_failures: int = 0


@dataclass
class _Mapping:
    """The server's shared files as this process sees them."""

    server_id: str
    arena: np.ndarray
    staging: np.ndarray
    tiers: list = field(default_factory=list)


class ServerStore:
    """Client of a ``kvtier serve`` process (see the module docstring)."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0,
                 backoff: float = 0.2, max_backoff: float = 2.0, connect_timeout: float = 1.0):
        self.address = address
        self._family, self._where = P.parse_address(address)
        self._token = token
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._backoff0 = backoff
        self._max_backoff = max_backoff
        self._backoff = backoff
        self._next_try = 0.0
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._map: _Mapping | None = None
        self._counters = _ClientCounters()
        self._closed = False
        try:
            self._connect()
        except P.ServerRejected:
            raise
        except OSError as exc:
            log.warning("kvtier: cache server %s not reachable yet (%s); serving misses until it is", address, exc)
            self._schedule_retry()

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

    def _connect(self) -> None:
        """Connect, say hello, map the shared files. Raises OSError or ServerRejected."""
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._connect_timeout)
            sock.connect(self._where)
            sock.settimeout(self._timeout)
            if self._family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            P.send(sock, {"op": "hello", "version": P.VERSION, "token": self._token})
            reply = P.recv(sock)
            if reply is None:
                raise ConnectionError("server closed the connection during hello")
            if not reply.get("ok"):
                raise P.ServerRejected(str(reply.get("error")), str(reply.get("message")))
            if self._map is None or self._map.server_id != reply["server_id"]:
                self._map = _Mapping(
                    reply["server_id"],
                    _map_file(reply["arena"]["path"], reply["arena"]["size"]),
                    _map_file(reply["staging"]["path"], reply["staging"]["size"]),
                    [RemoteTier(n) for n in reply.get("tiers", [])],
                )
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._backoff = self._backoff0

    def _schedule_retry(self) -> None:
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._max_backoff)

    def _ensure(self) -> bool:
        """Connected, reconnecting when the backoff allows; False (counted) if not."""
        if self._sock is not None:
            return True
        if self._closed or time.monotonic() < self._next_try:
            self._counters.unavailable += 1
            return False
        try:
            self._connect()
            self._counters.reconnects += 1
            log.info("kvtier: reconnected to cache server %s", self.address)
            return True
        except P.ServerRejected as exc:
            self._counters.rejected += 1
            log.warning("kvtier: %s", exc)
        except (OSError, P.ProtocolError, KeyError, TypeError):
            pass
        self._counters.unavailable += 1
        self._schedule_retry()
        return False

    def _drop(self) -> None:
        """Forget a broken connection (the mapping stays until a new server id is seen)."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._counters.errors += 1
        self._schedule_retry()

    def _call(self, message: dict[str, Any], reply: bool = True) -> dict[str, Any] | None:
        """One request (lock held by the caller); None when the server is unavailable."""
        if not self._ensure():
            return None
        self._counters.requests += 1
        try:
            P.send(self._sock, message)
            if not reply:
                return {"ok": True}
            answer = P.recv(self._sock)
            if answer is None:
                raise ConnectionError("server closed the connection")
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
        """How many leading ``keys`` the server holds in some tier (0 while unreachable)."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return 0
        with self._lock:
            answer = self._call({"op": "lookup", "keys": keys})
        return int(answer["n"]) if answer is not None else 0

    def read(self, key: Key, consume: Callable[[list], None]) -> str | None:
        """Hand ``key``'s payload to ``consume`` as read-only views of the shared arena.

        Returns the name of the server tier it came from, or None on a miss or a fault. The
        views are valid only during the call. An exception from ``consume`` propagates (after
        the lease is released).
        """
        with self._lock:
            answer = self._call({"op": "get", "key": bytes(key)})
            if answer is None or answer.get("tier") is None:
                self._counters.misses += 1
                return None
            arena = self._map.arena
            try:
                views = []
                for off, length in answer["extents"]:
                    view = arena[off : off + length]
                    view.flags.writeable = False
                    views.append(view)
                consume(views)
            finally:
                self._call({"op": "release", "lease": answer["lease"]}, reply=False)
            self._counters.hits += 1
            return answer["tier"]

    def write(self, key: Key, nbytes: int, fill: Callable[[list], None], parent: Key | None = None,
              chunk_index: int = 0) -> bool:
        """Store a chunk: ``fill(segments)`` copies its ``nbytes`` into shared staging pages.

        Returns True if the server holds the entry afterwards (also when it already did), False
        when it could not take it or is unreachable (counted). An exception from ``fill``
        propagates after the reservation is given back.
        """
        with self._lock:
            self._counters.writes += 1
            answer = self._call({"op": "reserve", "key": bytes(key), "nbytes": int(nbytes),
                                 "parent": bytes(parent) if parent is not None else None,
                                 "chunk_index": int(chunk_index)})
            if answer is None or answer["status"] == "full":
                self._counters.write_failures += 1
                return False
            if answer["status"] == "exists":
                return True
            staging = self._map.staging
            lease = answer["lease"]
            try:
                fill([staging[off : off + length] for off, length in answer["extents"]])
            except BaseException:
                self._call({"op": "abort", "lease": lease}, reply=False)
                raise
            done = self._call({"op": "commit", "lease": lease})
            if done is None or not done["stored"]:
                self._counters.write_failures += 1
                return False
            return True

    def get_into(self, key: Key, out) -> int | None:
        """Copy ``key``'s payload into the writable buffer ``out``; the byte count or None."""
        dst = np.frombuffer(out, dtype=np.uint8)
        written = [0]

        def consume(segments: list) -> None:
            pos = 0
            for seg in segments:
                if pos + seg.size > dst.size:
                    raise ValueError("output buffer too small for the entry")
                dst[pos : pos + seg.size] = seg
                pos += seg.size
            written[0] = pos

        return written[0] if self.read(key, consume) is not None else None

    def get(self, key: Key) -> bytes | None:
        """The payload of ``key`` as new bytes, or None."""
        chunks: list[bytes] = []
        found = self.read(key, lambda segs: chunks.extend(s.tobytes() for s in segs))
        return b"".join(chunks) if found is not None else None

    def put(self, key: Key, data, parent: Key | None = None, chunk_index: int = 0) -> bool:
        """Store a copy of the bytes-like ``data`` (see ``write``)."""
        src = np.frombuffer(data, dtype=np.uint8)

        def fill(segments: list) -> None:
            pos = 0
            for seg in segments:
                seg[:] = src[pos : pos + seg.size]
                pos += seg.size

        return self.write(key, src.size, fill, parent, chunk_index)

    def delete(self, key: Key) -> bool:
        """Remove ``key`` from every server tier; False when unreachable."""
        with self._lock:
            return self._call({"op": "delete", "key": bytes(key)}) is not None

    def enable_events(self, maxlen: int = 100_000) -> None:
        """Nothing to do: the server always records events (bounded) for whoever asks."""

    def take_events(self) -> list[tuple[str, Key, str]]:
        """The server's ("stored"|"removed", key, medium) events since anyone last asked."""
        with self._lock:
            answer = self._call({"op": "events"})
        if answer is None:
            return []
        return [(kind, bytes(key), medium) for kind, key, medium in answer["events"]]

    def stats(self) -> dict:
        """The server's stats (``{}`` while unreachable) plus this client's counters under "client"."""
        with self._lock:
            answer = self._call({"op": "stats"})
            client = dict(self._counters.__dict__)
        stats = dict(answer["stats"]) if answer is not None else {}
        stats["client"] = client
        return stats

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the server's queued lower-tier writes are done; False on timeout or fault."""
        with self._lock:
            answer = self._call({"op": "flush", "timeout": float(timeout)})
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


def _map_file(path: str, size: int) -> np.ndarray:
    """Map a server's shared-memory file read/write as a uint8 array."""
    if not size:
        return np.empty(0, dtype=np.uint8)
    fd = os.open(path, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    finally:
        os.close(fd)

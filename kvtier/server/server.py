"""The per-node cache server: one TieredStore shared by every engine on the node.

The store's top tier is a RAM tier whose arena is a shared-memory file; a client maps it and
copies entries straight out of it. Writes go through a second shared-memory file, the staging
area: the client copies a chunk there, the server copies it into the store on ``commit`` (the
store decides placement, eviction and write-through). The socket carries only control messages
(``kvtier.server.protocol``).

Leases: ``get`` pins the entry's arena pages until the client sends ``release`` (or its
connection ends); the store may evict the entry meanwhile, but its pages are not reused until
the lease is gone, so a client never reads bytes that changed under it.

Threading: one thread per connection; the store is thread-safe. ``close`` stops accepting,
closes every connection and the store, and removes the socket and shared-memory files.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import os
import socket
import socketserver
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import Size, build
from kvtier.errors import ConfigError
from kvtier.server import protocol as P
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.ram import RamConfig, RamTier

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "unix:///tmp/kvtier.sock"


@dataclass(frozen=True)
class ServeConfig:
    """Configuration of ``kvtier serve``.

    store: the StoreConfig dict; its first tier must be ``ram`` (the shared arena).
    listen: ``unix:///path.sock`` (mode 0600) or ``tcp://host:port`` (needs ``token``).
    token: shared secret clients present in ``hello``; required for TCP, optional for unix.
    metrics: ``host:port`` of the HTTP endpoint (``/metrics``, ``/healthz``); off when unset.
    staging: bytes of the shared write staging area (concurrent puts in flight).
    shm_dir: directory of the shared-memory files (a tmpfs such as /dev/shm).
    """

    store: StoreConfig = field(default_factory=StoreConfig)
    listen: str = DEFAULT_LISTEN
    token: str | None = field(default=None, repr=False)
    metrics: str | None = None
    staging: Size = Size(256 * 1024**2)
    shm_dir: str = "/dev/shm"

    def __post_init__(self):
        family, _ = P.parse_address(self.listen)
        if family == socket.AF_INET and not self.token:
            raise ConfigError("serve.token: a TCP listener requires a token")
        first = self.store.tiers[0]
        if first.get("type") != "ram":
            raise ConfigError("serve.store.tiers[0]: the server's top tier must be 'ram' (the shared arena)")
        if "shm_path" in first:
            raise ConfigError("serve.store.tiers[0].shm_path: set by the server; use serve.shm_dir")
        if self.metrics is not None:
            _parse_hostport(self.metrics, "serve.metrics")

    @classmethod
    def from_mapping(cls, mapping: dict | None) -> "ServeConfig":
        """Build from a YAML/JSON mapping (``store`` is a StoreConfig dict)."""
        return build(cls, mapping, "serve")


@dataclass
class _ServerCounters:
    connections: int = 0
    rejected: int = 0
    malformed: int = 0
    requests: int = 0
    gets: int = 0
    get_hits: int = 0
    lease_misses: int = 0  # a hit the arena could not hold long enough to lease (full arena)
    puts: int = 0
    put_stored: int = 0
    put_full: int = 0


class CacheServer:
    """The cache server. ``start()`` binds and serves in background threads; ``close()`` stops.

    Works as a context manager. Thread-safe.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        self.server_id = uuid.uuid4().hex
        _remove_stale(config.shm_dir)
        base = os.path.join(config.shm_dir, f"kvtier-{os.getpid()}-{self.server_id[:12]}")
        self.arena_path = base + "-arena"
        self.staging_path = base + "-staging"
        tiers = [dict(t) for t in config.store.tiers]
        tiers[0]["shm_path"] = self.arena_path
        self.store = TieredStore.from_config(dataclasses.replace(config.store, tiers=tiers))
        self.arena = self.store.tiers[0]
        if not isinstance(self.arena, RamTier) or self.arena.config.shm_path != self.arena_path:
            self.store.close()
            raise ConfigError("serve: the shared RAM tier could not start; see the warnings above")
        self.store.enable_events()
        page = int(self.arena.config.page_size)
        try:  # both files are reserved in full at start (OutOfSpace: one line, no SIGBUS later)
            self.staging = RamTier(RamConfig(capacity=config.staging, page_size=page, pin_memory=False,
                                             shm_path=self.staging_path), name="staging")
        except BaseException:
            self.store.close()  # removes the arena file too
            raise
        self._lock = threading.Lock()
        self._counters = _ServerCounters()
        self._lease_ids = itertools.count(1)
        self._server: socketserver.BaseServer | None = None
        self._metrics = None
        self._threads: list[threading.Thread] = []
        self._closed = False

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> "CacheServer":
        """Bind the control socket (and the metrics endpoint) and serve in background threads."""
        family, where = P.parse_address(self.config.listen)
        handler = _make_handler(self)
        if family == socket.AF_UNIX:
            if os.path.exists(where):
                os.unlink(where)  # a stale socket from a killed server
            old = os.umask(0o177)  # the socket is born 0600: no window with wider permissions
            try:
                self._server = _UnixServer(where, handler)
            finally:
                os.umask(old)
        else:
            self._server = _TcpServer(where, handler)
        t = threading.Thread(target=self._server.serve_forever, name="kvtier-serve", daemon=True)
        t.start()
        self._threads.append(t)
        if self.config.metrics:
            from kvtier.server.metrics import start_metrics

            self._metrics = start_metrics(self, *_parse_hostport(self.config.metrics, "serve.metrics"))
        log.info("kvtier serve: listening on %s, arena %d MiB at %s", self.address, self.arena.capacity_bytes >> 20,
                 self.arena_path)
        return self

    @property
    def address(self) -> str:
        """The address clients connect to (a TCP port of 0 is resolved to the bound one)."""
        if isinstance(self._server, _TcpServer):
            host, port = self._server.server_address[:2]
            return f"tcp://{host}:{port}"
        return self.config.listen

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the bound metrics endpoint, or None."""
        if self._metrics is None:
            return None
        host, port = self._metrics.server_address[:2]
        return f"{host}:{port}"

    def serve_forever(self) -> None:
        """Block until ``close`` is called (from a signal handler or another thread)."""
        for t in list(self._threads):
            t.join()

    def close(self) -> None:
        """Stop serving, close connections, close the store, remove the files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            family, where = P.parse_address(self.config.listen)
            if family == socket.AF_UNIX:
                try:
                    os.unlink(where)
                except FileNotFoundError:
                    pass
        self.store.close()
        self.staging.close()

    def __enter__(self) -> "CacheServer":
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------- operations

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def hello_reply(self) -> dict[str, Any]:
        return {
            "ok": True, "version": P.VERSION, "server_id": self.server_id,
            "arena": {"path": self.arena_path, "size": self.arena.capacity_bytes},
            "staging": {"path": self.staging_path, "size": self.staging.capacity_bytes},
            "page_size": int(self.arena.config.page_size),
            "tiers": [t.name for t in self.store.tiers],
        }

    def check_token(self, token: str | None) -> bool:
        """Constant-time comparison; a server without a token accepts any."""
        if not self.config.token:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.config.token.encode())

    def get(self, key: bytes, leases: dict) -> dict[str, Any]:
        """Serve ``key`` from the store (promoting a lower-tier hit) and lease its arena pages."""
        self.count(gets=1)
        tier = self.store.read(key, _ignore)
        if tier is None:
            return {"ok": True, "tier": None}
        borrow = self.arena.borrow(key)
        views = borrow.__enter__()
        if views is None:  # evicted again at once, or the arena could not take the promotion
            borrow.__exit__(None, None, None)
            self.count(lease_misses=1)
            return {"ok": True, "tier": None}
        lease = next(self._lease_ids)
        leases[lease] = borrow
        self.count(get_hits=1)
        extents = [[self.arena.offset_of(v), int(v.size)] for v in views]
        return {"ok": True, "tier": tier, "lease": lease, "extents": extents}

    def reserve(self, msg: dict, pending: dict) -> dict[str, Any]:
        """Reserve staging pages for a put (``exists`` when the arena already holds the key)."""
        self.count(puts=1)
        key = msg["key"]
        if self.arena.contains(key):
            return {"ok": True, "status": "exists"}
        lease = next(self._lease_ids)
        stage_key = lease.to_bytes(8, "little")
        views = self.staging.reserve(stage_key, msg["nbytes"])
        if views is None:
            self.count(put_full=1)
            return {"ok": True, "status": "full"}
        pending[lease] = (key, msg["nbytes"], msg["parent"], msg["chunk_index"], stage_key, views)
        extents = [[self.staging.offset_of(v), int(v.size)] for v in views]
        return {"ok": True, "status": "ok", "lease": lease, "extents": extents}

    def commit(self, lease: int, pending: dict) -> dict[str, Any]:
        """Copy a filled staging reservation into the store; free the staging pages."""
        item = pending.pop(lease, None)
        if item is None:
            return P.error(P.MALFORMED, f"commit: no open reservation {lease}")
        key, nbytes, parent, chunk_index, stage_key, views = item
        try:
            stored = self.store.write(key, nbytes, lambda segs: copy_segments(views, segs), parent, chunk_index)
        finally:
            self.staging.abort(stage_key)
        if stored:
            self.count(put_stored=1)
        return {"ok": True, "stored": bool(stored)}

    def abort(self, lease: int, pending: dict) -> None:
        item = pending.pop(lease, None)
        if item is not None:
            self.staging.abort(item[4])

    def stats(self) -> dict[str, Any]:
        """The store's stats plus the server's counters and open staging bytes."""
        stats = self.store.stats()
        with self._lock:
            stats["server"] = dict(self._counters.__dict__)
        stats["server"]["staging_used_bytes"] = self.staging.used_bytes()
        return stats


def copy_segments(src: list, dst: list) -> None:
    """Copy the concatenation of uint8 segments ``src`` into segments ``dst`` (same total)."""
    si = so = 0
    for seg in dst:
        pos = 0
        while pos < seg.size:
            s = src[si]
            n = min(seg.size - pos, s.size - so)
            seg[pos : pos + n] = s[so : so + n]
            pos += n
            so += n
            if so == s.size:
                si += 1
                so = 0


def _remove_stale(shm_dir: str) -> None:
    """Remove shared-memory files left by servers that were killed (their pid is gone)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "kvtier" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(shm_dir, name))
            except OSError:
                pass
        except PermissionError:  # another user's live server
            pass


def _ignore(segments) -> None:
    """A consume callback that copies nothing (the client copies from the arena itself)."""


def _parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


# ---------------------------------------------------------------------------------- connections


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class _TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _make_handler(server: CacheServer):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            _Connection(server, self.request).run()

    return Handler


class _Connection:
    """One client connection: handshake, then requests until the client goes away."""

    def __init__(self, server: CacheServer, sock: socket.socket):
        self.server = server
        self.sock = sock
        self.leases: dict[int, Any] = {}  # get leases: id -> borrow context
        self.pending: dict[int, tuple] = {}  # put reservations: id -> staging reservation
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self) -> None:
        server = self.server
        try:
            if not self._handshake():
                return
            server.count(connections=1)
            while True:
                msg = P.recv(self.sock)
                if msg is None:
                    return
                try:
                    op = P.validate(msg)
                except P.ProtocolError as exc:
                    server.count(malformed=1)
                    P.send(self.sock, P.error(exc.code, str(exc)))
                    continue
                server.count(requests=1)
                reply = self._dispatch(op, msg)
                if reply is not None:
                    P.send(self.sock, reply)
        except P.ProtocolError as exc:  # the stream is out of sync: answer once, then hang up
            server.count(malformed=1)
            self._try_send(P.error(exc.code, str(exc)))
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug must cost this connection, never the server
            log.exception("kvtier serve: connection failed")
        finally:
            self._cleanup()

    def _handshake(self) -> bool:
        server = self.server
        try:
            msg = P.recv(self.sock)
        except P.ProtocolError as exc:
            server.count(malformed=1, rejected=1)
            self._try_send(P.error(exc.code, str(exc)))
            return False
        if msg is None:
            return False
        if msg.get("op") != "hello":
            server.count(rejected=1)
            self._try_send(P.error(P.HELLO_FIRST, "the first request must be hello"))
            return False
        try:
            P.validate(msg)
        except P.ProtocolError as exc:
            server.count(malformed=1, rejected=1)
            self._try_send(P.error(exc.code, str(exc)))
            return False
        if msg["version"] != P.VERSION:
            server.count(rejected=1)
            self._try_send(P.error(P.BAD_VERSION, f"server speaks protocol version {P.VERSION}, client {msg['version']}"))
            return False
        if not server.check_token(msg["token"]):
            server.count(rejected=1)
            log.warning("kvtier serve: a client presented a wrong token")
            self._try_send(P.error(P.BAD_TOKEN, "wrong or missing token"))
            return False
        P.send(self.sock, server.hello_reply())
        return True

    def _dispatch(self, op: str, msg: dict) -> dict | None:
        server = self.server
        if op == "get":
            return server.get(msg["key"], self.leases)
        if op == "release":
            borrow = self.leases.pop(msg["lease"], None)
            if borrow is not None:
                borrow.__exit__(None, None, None)
            return None
        if op == "lookup":
            return {"ok": True, "n": server.store.lookup(msg["keys"])}
        if op == "reserve":
            return server.reserve(msg, self.pending)
        if op == "commit":
            return server.commit(msg["lease"], self.pending)
        if op == "abort":
            server.abort(msg["lease"], self.pending)
            return None
        if op == "delete":
            server.store.delete(msg["key"])
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "stats": server.stats()}
        if op == "events":
            events = [[kind, key, medium] for kind, key, medium in server.store.take_events()]
            return {"ok": True, "events": events}
        if op == "flush":
            return {"ok": True, "done": server.store.flush(timeout=min(float(msg["timeout"]), 60.0))}
        return P.error(P.MALFORMED, f"op {op!r} is not allowed after hello")

    def _try_send(self, reply: dict) -> None:
        try:
            P.send(self.sock, reply)
        except OSError:
            pass

    def _cleanup(self) -> None:
        """Give back what a vanished client still held."""
        for borrow in self.leases.values():
            borrow.__exit__(None, None, None)
        self.leases.clear()
        for lease in list(self.pending):
            self.server.abort(lease, self.pending)

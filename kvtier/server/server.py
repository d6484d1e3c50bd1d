"""The per-node cache server: one TieredStore shared by every engine on the node.

The store's top tier is a RAM tier whose arena is a shared-memory file; a client maps it and
copies entries straight out of it. The socket carries only control messages
(``kvtier.server.protocol``). Writes take one of two paths:

- Direct (``reserve_arena``, one copy): the store reserves arena pages for the entry (its
  ``write``, with the eviction and admission every write gets) and, from inside that write's
  ``fill``, the server answers their extents and waits for the client's next request on the
  connection. The client copies the payload into the pages through its own writable mapping;
  its ``commit`` ends the ``fill`` and the store publishes the entry and queues its lower-tier
  copies (a delete of the key that came meanwhile wins: nothing is published, ``stored: false``).
  Its ``abort``, a ``commit`` later than ``lease_timeout_s`` after the reserve reply
  (``lease_expired``), any other request (served as usual afterwards) or the connection's end
  raise out of ``fill``: the store frees the pages and nothing becomes visible. The entry's checksum, where a lower tier
  stores one, is computed by the server from the arena pages when it writes the entry down,
  after the commit, so it always matches the bytes the arena serves; the client sends none (a
  check of it would cost a pass over the payload, more than the copy this path removes).
- Staged (``reserve``, two copies; clients that cannot map the arena writable, and clients of
  before direct writes): the client copies a chunk into a second shared-memory file, the staging
  area, and the server copies it into the store on ``commit``.

Write leases: the pages of a direct write are never reused while the client that reserved them
may still be writing into them, because a late write would land in another entry. They return
to the arena at the client's ``commit``/``abort``, at its next request (which proves a
sequential client's copy is over; the write is aborted), or when its connection ends (a killed
client: at once). An expired lease is therefore refused at once but its pages come back only when
the client speaks again or goes away. A connection holds at most one direct write at a time (the
next request must end it; a batched write, ``reserve_arena_many``, is one such write), of at most
``client_staging_fraction`` x ``staging`` bytes of arena (each chunk counted in whole pages), and
all connections together hold at most ``staging`` bytes of arena in open direct writes: the same
bounds as the staging area, so a client holding reservations cannot take the arena from others.

Leases: ``get`` pins the entry's arena pages until the client sends ``release``, its connection
ends, or ``lease_timeout_s`` passes (then the server releases it; the hello reply names the
timeout, and a client whose copy took longer than that treats the read as a miss). The store may
evict the entry meanwhile, but its pages are not reused while the lease is held, so a client
never reads bytes that changed under it. A connection holds at most ``max_leases_per_client``
leases and at most ``client_staging_fraction`` of the staging area in open reservations, so one
client cannot starve the others. A staging reservation never expires while its connection is
open: its pages are reused only after ``commit``/``abort`` or the connection's end, because a
slow writer may still be copying into them (reusing them would store its bytes under another
client's key).

Admission: before ``hello`` a connection may send one frame of at most ``MAX_HELLO_FRAME`` bytes
within ``hello_timeout_s``; at most ``max_unauthenticated`` connections may be in that state and
at most ``max_connections`` open in all. Over a cap, a new connection gets a ``busy`` reply and
is closed without a thread.

The listen path (unix): its parent directory is created 0700 if missing, and refused when it is
not owned by the server's user (or root) or is writable by group or others. An existing socket
on the path is replaced only when nobody answers on it (a stale one); a live server there, or
anything that is not a socket, refuses the start with one line. ``close`` removes the socket only
if it is still the one this process bound (same inode).

Threading: one thread per admitted connection plus a lease reaper; the store is thread-safe.
``start`` returns once every listener (control socket, metrics) accepts connections. ``close``
stops accepting, shuts every connection down and closes the store, and removes the socket and
shared-memory files.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import os
import select
import socket
import socketserver
import stat
import struct
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtier.buffers import copy_segments, total_bytes
from kvtier.config import Size, build, out_of_range, ranged, secret, show, validate
from kvtier.errors import ConfigError, KVTierError
from kvtier.fileio import untrusted_dir
from kvtier.server import protocol as P
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.ram import ArenaTier, RamConfig, RamTier

log = logging.getLogger(__name__)

SYSTEM_SOCKET = "/run/kvtier/kvtier.sock"
# How often the accept loop looks for a shutdown request; close() waits up to this long
# (socketserver's default of 0.5 s made every stop of the server take that much longer).
SHUTDOWN_POLL_S = 0.05
_MAX_ADDRESS_CHARS = 1024  # a unix socket path is at most 107 bytes; a host:port far less


def default_listen() -> str:
    """The default control socket: ``/run/kvtier/kvtier.sock`` for root (a system service, the
    path a systemd ``RuntimeDirectory=kvtier`` gives), else ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``
    (a per-user 0700 directory), else ``/run/kvtier/kvtier.sock``. Never a world-writable
    directory such as /tmp, where any user could bind the path first."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.geteuid() != 0 and os.path.isabs(runtime):
        return f"unix://{os.path.join(runtime, 'kvtier', 'kvtier.sock')}"
    return f"unix://{SYSTEM_SOCKET}"


class ServeError(KVTierError):
    """The server cannot start as configured (listen path taken, unsafe directory, ...)."""


@dataclass(frozen=True)
class ServeConfig:
    """Configuration of ``kvtier serve``.

    store: the StoreConfig dict; its first tier must be ``ram`` (the shared arena).
    listen: ``unix:///path.sock`` (mode 0600, parent directory 0700) or ``tcp://host:port``
        (needs ``token``; port 0 binds a free port, reported in the ready line). Default:
        ``default_listen()``.
    token: shared secret clients present in ``hello``; required for TCP, optional for unix.
    metrics: ``host:port`` of the HTTP endpoint (``/metrics``, ``/healthz``); off when unset;
        port 0 binds a free port, reported in the ready line.
    staging: bytes of the shared write staging area (concurrent staged puts in flight), and the
        most arena bytes all open direct writes together may hold.
    shm_dir: directory of the shared-memory files (a tmpfs such as /dev/shm).
    max_connections: connections open at once (authenticated or not); more are refused (busy).
    max_unauthenticated: connections at once that have not yet completed hello.
    hello_timeout_s: a new connection must complete hello within this many seconds.
    lease_timeout_s: a ``get`` lease not released within this many seconds is released by the
        server (the pinned pages, maybe of a deleted entry, return to the arena).
    max_leases_per_client: leases one connection may hold; a ``get`` beyond it is a miss.
    client_staging_fraction: share (0, 1] of ``staging`` one connection may hold in open
        reservations (staged, or one direct write); a reservation beyond it answers ``quota``.
    metrics_max_connections: metrics connections served at once (one thread each); more are
        answered 503 at once and closed.
    metrics_request_timeout_s: the whole of one metrics request (reading it, answering it)
        must fit in this many seconds, however slowly its bytes arrive; then it is closed.
    commit_poll_s: how long a connection's thread polls (spinning, yielding the CPU between
        polls) for a direct write's commit before it blocks; 0: it always blocks. The poll is
        timed to end where the client's fill is expected to end (at the rate of the connection's
        previous fills), so a core spins at most this long per direct write. Worth it where a
        blocked thread wakes slowly (virtual machines whose idle vCPUs halt: ~0.1 ms a wake-up).
    request_poll_s: how long a connection's thread polls for the client's next request after it
        answers one, while that client's requests have come back to back (the moving average
        of the gaps within this budget: a put or get loop, a batch's reads); a client that pauses
        between requests (an engine between steps) turns it off. 0: it always blocks.

    Ranges are declared on the fields (``kvtier.config.ranged``) and checked by ``validate``,
    cross-field rules by ``check``: one ConfigError line ``serve.KEY: ...``.
    """

    store: StoreConfig = field(default_factory=StoreConfig)
    listen: str = field(default_factory=default_listen)
    token: str | None = secret(None)
    metrics: str | None = None
    staging: Size = Size(256 * 1024**2)
    shm_dir: str = "/dev/shm"
    max_connections: int = ranged(256, ge=1, le=65536)
    max_unauthenticated: int = ranged(32, ge=1, le=65536)
    hello_timeout_s: float = ranged(5.0, ge=0.01, le=300.0)
    lease_timeout_s: float = ranged(30.0, ge=0.01, le=86400.0)
    max_leases_per_client: int = ranged(64, ge=1, le=1 << 20)
    client_staging_fraction: float = ranged(0.25, gt=0.0, le=1.0)
    metrics_max_connections: int = ranged(8, ge=1, le=1024)
    metrics_request_timeout_s: float = ranged(5.0, gt=0.0, le=300.0)
    commit_poll_s: float = ranged(0.002, ge=0.0, le=0.1)
    request_poll_s: float = ranged(0.0002, ge=0.0, le=0.01)

    def __post_init__(self):
        validate(self, "serve")  # a config built by hand is checked as one built from a file

    def check(self, where: str) -> None:
        """The checks across fields (``validate`` calls it after the declared ranges)."""
        if len(self.listen) > _MAX_ADDRESS_CHARS:
            raise ConfigError(f"{where}.listen: longer than {_MAX_ADDRESS_CHARS} characters, got {show(self.listen)}")
        try:
            family, _ = P.parse_address(self.listen)
        except ConfigError as exc:
            raise ConfigError(f"{where}.listen: {exc}") from exc
        if family == socket.AF_INET and not self.token:
            raise ConfigError(f"{where}.token: a TCP listener requires a token")
        if self.max_unauthenticated > self.max_connections:
            raise out_of_range(f"{where}.max_unauthenticated", self.max_unauthenticated,
                               f"[1, max_connections={self.max_connections}]")
        first = self.store.tiers[0]
        if not issubclass(first.tier_class, ArenaTier):
            raise ConfigError(f"{where}.store.tiers[0]: the server's top tier must be 'ram' (the shared arena)")
        if first.tier_class.shared_file(first.config) is not None:
            raise ConfigError(f"{where}.store.tiers[0].shm_path: set by the server; use {where}.shm_dir")
        if self.store.lossy_codec():
            raise ConfigError(f"{where}.store.tiers: codec {self.store.lossy_codec()!r} is lossy, and the server's "
                              "clients cannot fold it into their key namespace; valid codecs here: none, lossless, "
                              "auto (configure fp8 on an engine's own tiers)")
        if self.metrics is not None:
            _parse_hostport(self.metrics, f"{where}.metrics")

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
    refused_busy: int = 0  # connections refused at the connection caps
    hello_timeouts: int = 0  # connections closed for not completing hello in time
    leases_expired: int = 0  # get leases released by the server after lease_timeout_s
    lease_quota: int = 0  # gets answered as a miss because the client held too many leases
    put_quota: int = 0  # reserves refused because the client held its staging share
    direct_puts: int = 0  # chunks of reserve_arena and reserve_arena_many requests (also counted in puts)
    direct_batches: int = 0  # reserve_arena_many requests (batches of direct writes)
    get_batches: int = 0  # get_many requests (each of its keys also counted in gets)
    direct_aborted: int = 0  # direct writes aborted (abort, connection end, refused commit)
    write_leases_expired: int = 0  # direct-write commits refused: past lease_timeout_s
    direct_abandoned: int = 0  # direct writes ended by a request other than their commit/abort
    coded_unreadable: int = 0  # gets of coded entries by clients that cannot decode them (misses)


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
        top = config.store.tiers[0]
        tiers = [top.with_config(top.tier_class.share_at(top.config, self.arena_path)), *config.store.tiers[1:]]
        self.store = TieredStore.from_config(dataclasses.replace(config.store, tiers=tiers))
        self.arena = self.store.tiers[0]
        if not isinstance(self.arena, ArenaTier) or type(self.arena).shared_file(self.arena.config) != self.arena_path:
            self.store.close()
            raise ConfigError("serve: the shared RAM tier could not start; see the warnings above")
        self.store.enable_events()
        self.arena.set_element_dtype(self.store.config.element_dtype)  # a coded arena shuffles by its width
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
        self._stop = threading.Event()
        self._conns: set[_Connection] = set()  # admitted connections (guarded by _lock)
        self._unauthenticated = 0  # admitted connections that have not completed hello
        self._socket_ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self._staging_quota = max(1, int(self.staging.capacity_bytes * config.client_staging_fraction))
        self._direct_cap = self.staging.capacity_bytes  # arena bytes all open direct writes may hold
        self._direct_open = 0  # arena bytes held by open direct writes now (guarded by _lock)
        self._warned_quota = False
        self._warned_coded = False

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> "CacheServer":
        """Bind the control socket and the metrics endpoint, serve in background threads, and
        return once every listener accepts connections.

        Raises ServeError (one line) when the unix listen path is unsafe or taken: a parent
        directory writable by others or owned by another user, a live server answering there,
        or something other than a socket at the path.
        """
        family, where = P.parse_address(self.config.listen)
        handler = _make_handler(self)
        backlog = min(socket.SOMAXCONN, max(128, self.config.max_connections))
        if family == socket.AF_UNIX:
            _check_socket_dir(where)
            _claim_socket_path(where)
            old = os.umask(0o177)  # the socket is born 0600: no window with wider permissions
            try:
                self._server = _UnixServer(where, handler, self._admit, backlog)
            except OSError as exc:
                raise ServeError(f"serve.listen: cannot bind {where}: {exc.strerror or exc}") from exc
            finally:
                os.umask(old)
            st = os.lstat(where)
            self._socket_ident = (st.st_dev, st.st_ino)
        else:
            try:
                self._server = _TcpServer(where, handler, self._admit, backlog)
            except OSError as exc:
                raise ServeError(f"serve.listen: cannot bind {self.config.listen}: {exc.strerror or exc}") from exc
        t = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), name="kvtier-serve", daemon=True)
        t.start()
        self._threads.append(t)
        reaper = threading.Thread(target=self._reap_leases, name="kvtier-lease-reaper", daemon=True)
        reaper.start()
        if self.config.metrics:
            from kvtier.server.metrics import start_metrics

            try:
                self._metrics = start_metrics(self.stats, *_parse_hostport(self.config.metrics, "serve.metrics"),
                                              max_connections=self.config.metrics_max_connections,
                                              request_timeout_s=self.config.metrics_request_timeout_s)
            except OSError as exc:
                raise ServeError(f"serve.metrics: cannot bind {self.config.metrics}: {exc.strerror or exc}") from exc
        self._wait_ready()
        log.info("kvtier serve: listening on %s, arena %d MiB at %s", self.address, self.arena.arena_bytes >> 20,
                 self.arena_path)
        return self

    def _wait_ready(self, timeout: float = 10.0) -> None:
        """Return once the control socket takes a connection and ``/healthz`` answers; ServeError
        naming the listener otherwise."""
        family, where = P.parse_address(self.address)
        if family == socket.AF_INET:
            where = (_loopback_for(where[0]), where[1])
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.01, deadline - time.monotonic()))
                    s.connect(where)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ServeError(f"serve.listen: {self.address} does not accept connections ({exc})") from exc
                time.sleep(0.01)
        if self._metrics is not None:
            host, port = self._metrics.server_address[:2]
            url = f"http://{_loopback_for(host)}:{port}/healthz"
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=max(0.01, deadline - time.monotonic())) as r:
                        r.read()
                    break
                except OSError as exc:
                    if time.monotonic() >= deadline:
                        raise ServeError(f"serve.metrics: {url} does not answer ({exc})") from exc
                    time.sleep(0.01)

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
        """Stop serving, shut connections down, close the store, remove the files.

        The unix socket is removed only if the path still holds the socket this process bound
        (same device and inode): a socket another server bound there since is left alone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        self._stop.set()
        if self._metrics is not None:
            self._metrics.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            family, where = P.parse_address(self.config.listen)
            if family == socket.AF_UNIX and self._socket_ident is not None:
                _unlink_if_same(where, self._socket_ident)
        for conn in conns:
            conn.shutdown()
        self.store.close()
        self.staging.close()

    # ----------------------------------------------------------------------------- admission

    def _admit(self, sock: socket.socket) -> "_Connection | None":
        """Take a new connection under the caps, or refuse it (``busy`` reply, closed; None)."""
        with self._lock:
            full = (self._closed or len(self._conns) >= self.config.max_connections
                    or self._unauthenticated >= self.config.max_unauthenticated)
            if not full:
                conn = _Connection(self, sock)
                self._conns.add(conn)
                self._unauthenticated += 1
                return conn
            self._counters.refused_busy += 1
        try:  # best effort, never blocking the accept loop
            sock.send(P.encode(P.error(P.BUSY, "server at its connection limit; retry later")), socket.MSG_DONTWAIT)
        except OSError:
            pass
        return None

    def _authenticated(self) -> None:
        with self._lock:
            self._unauthenticated -= 1

    def _leave(self, conn: "_Connection", authenticated: bool) -> None:
        with self._lock:
            self._conns.discard(conn)
            if not authenticated:
                self._unauthenticated -= 1

    def _reap_leases(self) -> None:
        """Release get leases older than ``lease_timeout_s`` until the server closes."""
        interval = min(1.0, self.config.lease_timeout_s / 4)
        while not self._stop.wait(interval):
            with self._lock:
                conns = list(self._conns)
            now = time.monotonic()
            expired = sum(conn.expire_leases(now) for conn in conns)
            if expired:
                self.count(leases_expired=expired)

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
            "arena": {"path": self.arena_path, "size": self.arena.arena_bytes},
            "staging": {"path": self.staging_path, "size": self.staging.capacity_bytes},
            "page_size": int(self.arena.config.page_size),
            "tiers": [t.name for t in self.store.tiers],
            "lease_timeout_s": float(self.config.lease_timeout_s),
            "direct_writes": True,
            "arena_codec": getattr(self.arena.config, "codec", "none"),
            "batch_reads": min(P.MAX_BATCH_ITEMS, self.config.max_leases_per_client),  # get_many's keys
            "batch_writes": P.MAX_BATCH_ITEMS,
            "write_share": self._staging_quota,  # arena bytes, each chunk counted in whole pages
        }

    def check_token(self, token: str | None) -> bool:
        """Constant-time comparison; a server without a token accepts any."""
        if not self.config.token:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.config.token.encode())

    def get(self, key: bytes, leases: dict, decodes: bool = False) -> dict[str, Any]:
        """Serve ``key`` from the store (promoting a lower-tier hit) and lease its arena pages.

        ``leases`` maps lease id -> (borrow context, expiry instant); a client already holding
        ``max_leases_per_client`` gets a miss (counted). A coded entry (a coded arena) is leased
        as stored, its codec, raw length and raw checksum in the reply, to a client that said in
        its hello that it ``decodes`` it; any other client gets a miss (``coded_unreadable``):
        it would take the coded bytes for KV.
        """
        self.count(gets=1)
        if len(leases) >= self.config.max_leases_per_client:
            self.count(lease_quota=1)
            return {"ok": True, "tier": None}
        tier = self.store.read(key, _ignore)
        if tier is None:
            return {"ok": True, "tier": None}
        borrow = self.arena.borrow_stored(key)
        stored = borrow.__enter__()
        if stored is None:  # evicted again at once, or the arena could not take the promotion
            borrow.__exit__(None, None, None)
            self.count(lease_misses=1)
            return {"ok": True, "tier": None}
        if stored.codec and not decodes:
            borrow.__exit__(None, None, None)
            self.count(coded_unreadable=1)
            if not self._warned_coded:
                self._warned_coded = True
                log.warning("kvtier serve: a client that cannot decode coded arena entries (an older client, or "
                            "one without blosc2) read a coded entry: answered as a miss (counted as "
                            "coded_unreadable); upgrade it or set the arena's codec to none")
            return {"ok": True, "tier": None}
        lease = next(self._lease_ids)
        leases[lease] = (borrow, time.monotonic() + self.config.lease_timeout_s)
        self.count(get_hits=1)
        extents = _extents_of(self.arena, stored.segments)
        reply = {"ok": True, "tier": tier, "lease": lease, "extents": extents}
        if stored.codec:
            reply.update(codec=stored.codec, raw=stored.length, checksum=stored.checksum)
        return reply

    def reserve(self, msg: dict, pending: dict) -> dict[str, Any]:
        """Reserve staging pages for a put (``exists`` when the arena already holds the key,
        ``quota`` when this connection's open reservations would exceed its staging share)."""
        self.count(puts=1)
        key = msg["key"]
        if self.arena.contains(key):
            return {"ok": True, "status": "exists"}
        held = sum(item[1] for item in pending.values())
        if held + msg["nbytes"] > self._staging_quota:
            self.count(put_quota=1)
            if msg["nbytes"] > self._staging_quota and not self._warned_quota:
                self._warned_quota = True  # a chunk that can never fit: the operator must see it once
                log.warning("kvtier serve: a %d-byte chunk exceeds one client's staging share of %d bytes; raise "
                            "serve.staging or serve.client_staging_fraction", msg["nbytes"], self._staging_quota)
            return {"ok": True, "status": "quota"}
        lease = next(self._lease_ids)
        stage_key = lease.to_bytes(8, "little")
        views = self.staging.reserve(stage_key, msg["nbytes"])
        if views is None:
            self.count(put_full=1)
            return {"ok": True, "status": "full"}
        pending[lease] = (key, msg["nbytes"], msg["parent"], msg["chunk_index"], stage_key, views)
        extents = _extents_of(self.staging, views)
        return {"ok": True, "status": "ok", "lease": lease, "extents": extents}

    def reserve_arena(self, conn: "_Connection", msg: dict) -> tuple[dict[str, Any] | None, tuple | None]:
        """A direct write (see the module notes): reserve arena pages through ``store.write``,
        answer their extents from its ``fill`` and wait there for the client's next request.

        Returns (reply, follow). ``reply`` answers the request that ended the write: the reserve
        itself when no pages were reserved (``exists``, ``full``, ``quota``), the commit
        (``stored``, or ``lease_expired``), a malformed request's error, or None (an abort, or a
        request to serve as usual). ``follow`` is that other request as (op, message), for the
        caller to serve next, or None. The connection's end propagates (ConnectionError/OSError)
        after the store has freed the pages.
        """
        self.count(puts=1, direct_puts=1)
        key, nbytes = msg["key"], msg["nbytes"]
        if self.arena.contains(key):
            return {"ok": True, "status": "exists"}, None
        held = self.arena.footprint(nbytes)  # whole pages, as the arena holds them
        if not self._hold_direct(held):
            return {"ok": True, "status": "quota"}, None
        write = _DirectWrite(self, conn, next(self._lease_ids))
        outcome: list[bool] = []
        ended = self._run_direct(held, lambda: outcome.append(
            self.store.write(key, nbytes, write.fill, msg["parent"], msg["chunk_index"])))
        if ended is not None:
            return ended
        stored = outcome[0]
        if not write.reserved:  # the store answered without reserving: held already, or no room
            if not stored:
                self.count(put_full=1)
            return {"ok": True, "status": "exists" if stored else "full"}, None
        if stored:
            self.count(put_stored=1)
        return {"ok": True, "stored": bool(stored)}, None

    def reserve_arena_many(self, conn: "_Connection", msg: dict) -> tuple[dict[str, Any] | None, tuple | None]:
        """A batched direct write (``_DirectBatch``; see the module notes); (reply, follow) as
        ``reserve_arena``. The reserve reply itself when nothing was reserved (``quota``, or
        every item ``exists``/``full``); the commit's ``stored`` is per item."""
        items = msg["items"]
        self.count(puts=len(items), direct_puts=len(items), direct_batches=1)
        total = sum(self.arena.footprint(item["nbytes"]) for item in items)  # whole pages, as the arena holds them
        if not self._hold_direct(total):
            return {"ok": True, "status": "quota"}, None
        batch = _DirectBatch(self, conn, next(self._lease_ids), items)
        ended = self._run_direct(total, batch.run)
        if ended is not None:
            return ended
        failed = batch.status.count("full")
        if failed:
            self.count(put_full=failed)
        if not batch.reserved:
            return {"ok": True, "status": "ok", "items": [{"status": st} for st in batch.status]}, None
        self.count(put_stored=sum(1 for st, ok in zip(batch.status, batch.stored) if st == "ok" and ok))
        return {"ok": True, "stored": batch.stored}, None

    def _run_direct(self, held: int, run: Callable[[], Any]) -> tuple | None:
        """Run a direct write (``run``: its ``store.write`` calls) whose ``held`` arena bytes
        ``_hold_direct`` counted, and uncount them after. (reply, follow) of the request that
        ended it without its commit (``_WriteEnded``), else None; anything else propagates
        (the connection's end), counted as an abort."""
        try:
            run()
        except _WriteEnded as ended:
            self.count(direct_aborted=1)
            return ended.reply, ended.follow
        except BaseException:
            self.count(direct_aborted=1)
            raise
        finally:
            with self._lock:
                self._direct_open -= held
        return None

    def _hold_direct(self, nbytes: int) -> bool:
        """Count ``nbytes`` (the arena bytes a write holds: whole pages) against the direct-write
        bounds (one client's share, all clients' ``staging`` bytes); False (counted as
        ``put_quota``) when it does not fit."""
        with self._lock:
            if nbytes <= self._staging_quota and self._direct_open + nbytes <= self._direct_cap:
                self._direct_open += nbytes
                return True
            self._counters.put_quota += 1
        if nbytes > self._staging_quota and not self._warned_quota:
            self._warned_quota = True  # a chunk that can never fit: the operator must see it once
            log.warning("kvtier serve: a %d-byte chunk exceeds one client's write share of %d bytes; raise "
                        "serve.staging or serve.client_staging_fraction", nbytes, self._staging_quota)
        return False

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

    def flush(self, timeout: float) -> bool:
        """Wait until the store's queued lower-tier writes and then the arena's coder are done
        (``timeout`` seconds in all); False on timeout. The writes first: a write-through copy
        pins its entry, which the coder then codes after it."""
        deadline = time.monotonic() + timeout
        flushed = self.store.flush(timeout=timeout)
        return self.arena.drain(max(0.0, deadline - time.monotonic())) and flushed

    def stats(self) -> dict[str, Any]:
        """The store's stats plus the server's counters and open staging bytes."""
        stats = self.store.stats()
        with self._lock:
            stats["server"] = dict(self._counters.__dict__)
            conns = list(self._conns)
            stats["server"]["connections_open"] = len(conns)
            stats["server"]["unauthenticated_open"] = self._unauthenticated
        stats["server"]["leases_open"] = sum(len(c.leases) for c in conns)
        stats["server"]["staging_used_bytes"] = self.staging.used_bytes()
        with self._lock:
            stats["server"]["direct_write_bytes_open"] = self._direct_open
        return stats


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


def _check_socket_dir(path: str) -> None:
    """Create the socket's parent directory 0700 if missing; ServeError unless it is a directory
    owned by this user (or root) that neither group nor others can write."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        try:
            os.makedirs(parent, mode=0o700)
        except OSError as exc:
            raise ServeError(f"serve.listen: cannot create the socket directory {parent}: "
                             f"{exc.strerror or exc}") from exc
    problem = untrusted_dir(os.stat(parent), "server")  # the rule the disk tier applies too
    if problem:
        raise ServeError(f"serve.listen: the socket directory {parent} {problem}, so another user could bind the "
                         f"path first; use a directory of your own only this user can write (default listen: "
                         f"{default_listen()})")


def _claim_socket_path(path: str) -> None:
    """Make ``path`` free for bind: absent, or a stale socket (removed). ServeError when a server
    answers there or the path is anything but a socket (never deleted)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else (
            "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a socket")
        raise ServeError(f"serve.listen: {path} exists and is {kind}, not a socket; kvtier does not delete it: "
                         f"remove it yourself or choose another listen path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: a socket left by a killed server
        except OSError as exc:
            raise ServeError(f"serve.listen: cannot check whether a server answers on {path}: "
                             f"{exc.strerror or exc}") from exc
        else:
            pid = _peer_pid(probe)
            raise ServeError(f"serve.listen: a server{f' (pid {pid})' if pid else ''} is already answering on {path}; "
                             f"stop it first or choose another listen path")
    _unlink_if_same(path, (st.st_dev, st.st_ino))


def _peer_pid(sock: socket.socket) -> int:
    """The peer's pid of a connected unix socket (0 when the platform cannot tell)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid
    except (OSError, AttributeError):
        return 0


def _unlink_if_same(path: str, ident: tuple[int, int]) -> None:
    """Remove ``path`` only if it is still the file ``ident`` = (st_dev, st_ino)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _loopback_for(host: str) -> str:
    """An address to reach a listener bound to ``host`` from this machine."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _extents_of(tier: ArenaTier, segments: list) -> list[list[int]]:
    """The [offset, length] extents of ``segments`` (views of ``tier``'s arena, in order), with
    runs of adjacent pages merged into one: fewer, larger copies for the client and a smaller
    reply."""
    extents: list[list[int]] = []
    for view in segments:
        off, length = tier.offset_of(view), int(view.size)
        if extents and extents[-1][0] + extents[-1][1] == off:
            extents[-1][1] += length
        else:
            extents.append([off, length])
    return extents


def _ignore(segments) -> None:
    """A consume callback that copies nothing (the client copies from the arena itself)."""


class _WriteEnded(Exception):
    """Raised out of a direct write's ``fill`` so the store frees its pages; ``reply`` answers
    the request that ended it (None: an abort, which has no reply), or ``follow`` = (op, message)
    is that request, to be served as usual once the write is unwound."""

    def __init__(self, reply: dict[str, Any] | None, follow: tuple | None = None):
        super().__init__("direct write ended without a commit")
        self.reply = reply
        self.follow = follow


class _DirectWrite:
    """One direct write's ``fill``: announce the reserved pages, wait for the client's verdict.

    Runs on the connection's thread, outside the store lock (``TieredStore.write`` runs ``fill``
    after releasing it). Returning publishes the entry; raising frees the pages.
    """

    def __init__(self, server: CacheServer, conn: "_Connection", lease: int):
        self.server = server
        self.conn = conn
        self.lease = lease
        self.reserved = False  # fill ran: the store reserved pages

    def fill(self, segments: list) -> None:
        """Send the reserve reply with the segments' arena extents, then wait for the verdict
        (``_await_commit``)."""
        self.reserved = True
        extents = _extents_of(self.server.arena, segments)
        _await_commit(self.server, self.conn, self.lease,
                      {"ok": True, "status": "ok", "lease": self.lease, "extents": extents}, total_bytes(segments))


class _DirectBatch:
    """A batched direct write: one ``store.write`` per item, each nested in the previous one's
    ``fill``, so every item's pages stay reserved while the client fills them all; the innermost
    level announces the batch and waits for its verdict (``_await_commit``). A raise there
    unwinds every level: the store frees every page, nothing is published. Runs on the
    connection's thread, outside the store lock.
    """

    def __init__(self, server: CacheServer, conn: "_Connection", lease: int, items: list[dict]):
        self.server = server
        self.conn = conn
        self.lease = lease
        self.items = items
        self.status: list[str] = ["full"] * len(items)
        self.extents: list[list | None] = [None] * len(items)
        self.stored: list[bool] = [False] * len(items)

    @property
    def reserved(self) -> bool:
        """Whether some item's pages were reserved (the batch was announced under its lease)."""
        return "ok" in self.status

    def run(self, i: int = 0) -> None:
        """Write items ``i`` onwards (see the class notes); ``stored`` holds the outcomes."""
        if i == len(self.items):
            if self.reserved:
                answer = [{"status": st, "extents": ext} if st == "ok" else {"status": st}
                          for st, ext in zip(self.status, self.extents)]
                nbytes = sum(item["nbytes"] for item, st in zip(self.items, self.status) if st == "ok")
                _await_commit(self.server, self.conn, self.lease,
                              {"ok": True, "status": "ok", "lease": self.lease, "items": answer}, nbytes)
            return
        item = self.items[i]
        if self.server.arena.contains(item["key"]):
            self.status[i], self.stored[i] = "exists", True
            self.run(i + 1)
            return
        filled = False

        def fill(segments: list) -> None:
            nonlocal filled
            filled = True
            self.status[i] = "ok"
            self.extents[i] = _extents_of(self.server.arena, segments)
            self.run(i + 1)

        stored = self.server.store.write(item["key"], item["nbytes"], fill, item["parent"], item["chunk_index"])
        self.stored[i] = bool(stored)
        if not filled:  # nothing reserved: held already, no room, not admitted, or being written
            self.status[i] = "exists" if stored else "full"
            self.run(i + 1)


def _await_commit(server: CacheServer, conn: "_Connection", lease: int, announce: dict, nbytes: int) -> None:
    """Send a direct write's reserve reply ``announce`` (``nbytes`` for the client to fill),
    then read the client's next request: ``lease``'s commit in time returns; anything else
    raises ``_WriteEnded`` (or the connection's error), carrying a request that is neither this
    lease's commit nor its abort as ``follow``. The wait has no timeout: the pages must stay
    reserved while the client may still write into them (see the module notes)."""
    sock = conn.sock
    P.send(sock, announce)
    announced = time.monotonic()
    deadline = announced + server.config.lease_timeout_s
    woke = conn.await_fill(nbytes, server.config.commit_poll_s)
    msg = P.recv(sock)
    arrived = time.monotonic()
    conn.observe_fill(nbytes, arrived - announced)
    conn.poller.observe(max(0.0, arrived - woke))  # how long the commit took past the expected fill
    if msg is None:
        raise ConnectionError("client closed the connection during a direct write")
    try:
        op = P.validate(msg)
    except P.ProtocolError as exc:
        server.count(malformed=1)
        raise _WriteEnded(P.error(exc.code, str(exc))) from exc
    server.count(requests=1)
    if op in ("commit", "abort") and msg["lease"] == lease:
        if op == "abort":
            raise _WriteEnded(None)
        if time.monotonic() > deadline:
            server.count(write_leases_expired=1)
            raise _WriteEnded(P.error(P.LEASE_EXPIRED, f"commit: write lease {lease} expired (more than "
                                      f"{server.config.lease_timeout_s:g} s after its reserve); aborted"))
        return
    server.count(direct_abandoned=1)
    raise _WriteEnded(None, (op, msg))


def _parse_hostport(value: str, what: str) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` (an empty host: 127.0.0.1); ConfigError (one line) unless
    the port is a number in 0..65535 (0: any free port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{what}: expected HOST:PORT, got {show(value)}")
    if int(port) > 65535:
        raise ConfigError(f"{what}: port {int(port)} is out of range 0..65535 (0: any free port)")
    return host or "127.0.0.1", int(port)


# ---------------------------------------------------------------------------------- connections


class _Admitting:
    """socketserver mix-in: ``admit(sock)`` decides in the accept loop, before any thread exists,
    whether a connection is served; the admitted ``_Connection`` travels to the handler."""

    daemon_threads = True

    def __init__(self, address, handler, admit, backlog: int):
        self._admit = admit
        self._admitted: dict[int, _Connection] = {}
        self.request_queue_size = backlog
        super().__init__(address, handler)

    def verify_request(self, request, client_address) -> bool:
        conn = self._admit(request)
        if conn is None:
            return False
        self._admitted[id(request)] = conn
        return True

    def process_request(self, request, client_address) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: give the slot back
            conn = self._admitted.pop(id(request), None)
            if conn is not None:
                conn.server._leave(conn, authenticated=False)
            raise

    def take_connection(self, request) -> "_Connection":
        return self._admitted.pop(id(request))


class _UnixServer(_Admitting, socketserver.ThreadingUnixStreamServer):
    pass


class _TcpServer(_Admitting, socketserver.ThreadingTCPServer):
    allow_reuse_address = True


def _make_handler(server: CacheServer):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.server.take_connection(self.request).run()

    return Handler


class _Connection:
    """One client connection: handshake, then requests until the client goes away.

    ``leases`` and ``pending`` are touched by the connection's thread and the lease reaper, both
    under ``lock``.
    """

    def __init__(self, server: CacheServer, sock: socket.socket):
        self.server = server
        self.sock = sock
        self.lock = threading.Lock()
        self.leases: dict[int, tuple[Any, float]] = {}  # get leases: id -> (borrow context, expiry)
        self.pending: dict[int, tuple] = {}  # put reservations: id -> staging reservation
        self.authenticated = False
        self.decodes = False  # the client decodes coded arena entries (said so in its hello)
        self.fill_rate = 0.0  # bytes/s of this client's direct-write fills (moving average; 0: none yet)
        self.poller = P.Poller(server.config.commit_poll_s)  # polls for commits while they come in time
        self.request_poller = P.Poller(server.config.request_poll_s)  # polls for requests that come back to back
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def await_fill(self, nbytes: int, poll_s: float) -> float:
        """Wait, without reading, until the client's request after a direct write's announce
        may be near: blocked (``poll``) through the part of a fill of ``nbytes`` expected to
        take longer than half of ``poll_s``, then polling for at most ``poll_s`` while polls
        pay (``self.poller``; otherwise nothing here). Returns early once the socket is
        readable; the caller's blocking read does the rest. Returns the instant the blocked
        part is planned to end (``time.monotonic``), polling or not: the poller learns from the
        time between it and the request."""
        start = time.monotonic()
        if poll_s <= 0:
            return start
        ahead = nbytes / self.fill_rate - poll_s / 2 if self.fill_rate > 0 else 0.0
        ahead = max(0.0, min(ahead, self.server.config.lease_timeout_s))  # past the lease the commit is refused
        if not self.poller.polling:
            return start + ahead
        if ahead > 0:
            poller = select.poll()  # not select.select: a descriptor may be past FD_SETSIZE
            poller.register(self.sock, select.POLLIN)
            if poller.poll(ahead * 1000.0):
                return start + ahead
        self.poller.poll(self.sock)
        return start + ahead

    def observe_fill(self, nbytes: int, seconds: float) -> None:
        """Fold one fill (announce to the next request) into ``fill_rate``."""
        if nbytes > 0 and seconds > 0:
            rate = nbytes / seconds
            self.fill_rate = rate if self.fill_rate <= 0 else 0.5 * (self.fill_rate + rate)

    def expire_leases(self, now: float) -> int:
        """Release the get leases whose expiry has passed; how many were released."""
        with self.lock:
            expired = [lease for lease, (_, until) in self.leases.items() if until <= now]
            for lease in expired:
                self.leases.pop(lease)[0].__exit__(None, None, None)
        return len(expired)

    def shutdown(self) -> None:
        """Wake the connection's thread (server closing): its next receive sees the end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def run(self) -> None:
        server = self.server
        try:
            if not self._handshake():
                return
            self.authenticated = True
            server._authenticated()
            self.sock.settimeout(None)  # an engine may stay idle between requests for hours
            server.count(connections=1)
            follow = None  # a request that ended a direct write, to serve next
            answered = None  # when the last reply was sent (time.monotonic), or None
            while True:
                if follow is not None:
                    (op, msg), follow = follow, None
                else:
                    msg = self._next_request(answered)
                    if msg is None:
                        return
                    try:
                        op = P.validate(msg)
                    except P.ProtocolError as exc:
                        server.count(malformed=1)
                        P.send(self.sock, P.error(exc.code, str(exc)))
                        answered = time.monotonic()  # a reply too: the next gap counts from it
                        continue
                    server.count(requests=1)
                if op == "reserve_arena":  # waits for the client: never under the lease lock
                    reply, follow = server.reserve_arena(self, msg)
                elif op == "reserve_arena_many":
                    reply, follow = server.reserve_arena_many(self, msg)
                else:
                    with self.lock:
                        reply = self._dispatch(op, msg)
                if reply is not None:
                    P.send(self.sock, reply)
                answered = time.monotonic() if follow is None else None
        except P.ProtocolError as exc:  # the stream is out of sync: answer once, then hang up
            server.count(malformed=1)
            self._try_send(P.error(exc.code, str(exc)))
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug must cost this connection, never the server
            log.exception("kvtier serve: connection failed")
        finally:
            self._cleanup()
            server._leave(self, self.authenticated)

    def _next_request(self, answered: float | None) -> dict | None:
        """The client's next request (None at the stream's end). Right after a reply
        (``answered``), polled for while ``request_poller`` says requests come back to back,
        which learns from the gap between the reply and the request (at most
        ``request_poll_s`` of spinning per request)."""
        if answered is not None:
            self.request_poller.poll(self.sock)  # nothing when it is off (a pausing client, or a budget of 0)
        msg = P.recv(self.sock)
        if answered is not None:
            # a gap counts at most twice the budget: one pause (a client's other work between two
            # loops) must not outweigh the back-to-back requests around it for the next dozen
            self.request_poller.observe(min(time.monotonic() - answered, 2 * self.request_poller.budget))
        return msg

    def _handshake(self) -> bool:
        """One small hello frame within the hello deadline; True when the client is accepted."""
        server = self.server
        deadline = time.monotonic() + server.config.hello_timeout_s
        try:
            msg = P.recv(self.sock, max_frame=P.MAX_HELLO_FRAME, deadline=deadline)
        except P.ProtocolError as exc:
            server.count(malformed=1, rejected=1)
            self._try_send(P.error(exc.code, str(exc)))
            return False
        except TimeoutError:
            server.count(hello_timeouts=1, rejected=1)
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
        self.decodes = P.decodes_lossless(msg)
        P.send_by(self.sock, server.hello_reply(), time.monotonic() + server.config.hello_timeout_s)
        return True

    def _dispatch(self, op: str, msg: dict) -> dict | None:
        server = self.server
        if op == "get":
            return server.get(msg["key"], self.leases, self.decodes)
        if op == "get_many":
            server.count(get_batches=1)
            answers = [server.get(key, self.leases, self.decodes) for key in msg["keys"]]
            return {"ok": True, "items": [{k: v for k, v in a.items() if k != "ok"} for a in answers]}
        if op in ("release", "release_many"):
            for lease in msg["leases"] if op == "release_many" else (msg["lease"],):
                held = self.leases.pop(lease, None)
                if held is not None:
                    held[0].__exit__(None, None, None)
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
            return {"ok": True, "done": server.flush(min(float(msg["timeout"]), P.MAX_FLUSH_S))}
        return P.error(P.MALFORMED, f"op {op!r} is not allowed after hello")

    def _try_send(self, reply: dict) -> None:
        try:
            self.sock.settimeout(1.0)  # an error reply to a peer that does not read is dropped
            P.send(self.sock, reply)
        except OSError:
            pass

    def _cleanup(self) -> None:
        """Give back what a vanished client still held."""
        with self.lock:
            for borrow, _ in self.leases.values():
                borrow.__exit__(None, None, None)
            self.leases.clear()
            for lease in list(self.pending):
                self.server.abort(lease, self.pending)

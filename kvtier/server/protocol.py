"""The cache server's control protocol: length-prefixed msgpack maps over a stream socket.

Payloads never travel here: they sit in shared-memory files both sides map (the server's RAM
arena for reads and direct writes, a staging area for staged writes); messages carry only keys,
offsets and lengths.

Framing: a 4-byte big-endian length, then one msgpack map (no extension types, no pickle).
A request is ``{"op": NAME, ...fields}``; a reply is ``{"ok": True, ...}`` or
``{"ok": False, "error": CODE, "message": TEXT}``. Requests on one connection are answered in
order; ``release`` and ``abort`` have no reply (they only give something back).

The first request on a connection must be ``hello`` with the client's ``version`` and, where the
server has one, its ``token``; anything else closes the connection with an error reply. Before
``hello`` is accepted the server reads at most ``MAX_HELLO_FRAME`` bytes and waits at most its
hello deadline: an unauthenticated peer can make it allocate nothing larger and hold nothing
longer. A server at its connection cap answers ``busy`` and closes.

Direct writes (a server whose hello reply has ``direct_writes: true``): ``reserve_arena``
reserves arena pages under a write lease and answers their extents; the client copies the payload
into them through its own writable mapping of the arena. The next request on that connection
ends the write: the lease's ``commit`` makes the entry visible (``stored`` says whether it did: a
delete of the key meanwhile wins, ``stored: false``), unless it arrives more than
``lease_timeout_s`` after the reserve reply (refused: ``lease_expired``, aborted). Anything else
(its ``abort``, another op, a commit of another lease id) aborts the write, nothing becomes
visible, and that request is then served as usual (a commit of an unknown lease is
``malformed``). A commit carries no extents: the server publishes exactly the pages it reserved. Older clients keep
using ``reserve`` (staging), which is unchanged.

Batched direct writes (a server whose hello reply has ``batch_writes: N``, the most items one
batch may hold, and ``write_share``, the most bytes one connection may hold in open writes):
``reserve_arena_many`` reserves pages for up to N chunks under one write lease and answers each
item's status and extents; the client fills them all and ends the batch as it ends a single
direct write. Its ``commit`` answers ``stored`` per item (an item answered ``exists`` is
``true``, one answered ``full`` is ``false``); an abort, a late commit or another request frees
every page of the batch. A batch whose chunks, each counted in whole arena pages
(``page_size``), exceed ``write_share`` is answered ``quota`` and reserves nothing (a single
``reserve_arena`` is counted the same way). Two round trips per batch instead of per chunk:
what a step's saves need where a round trip costs as much as copying a chunk. A key twice in
one batch: the second is ``full`` (the first is being written).

Coded arena entries (a server whose arena has ``codec: lossless``; ``arena_codec`` in the hello
reply): a client that lists ``"lossless"`` in its hello's optional ``decodes`` may get a reply
with ``codec`` (``kvtier.codecs`` id, 1: lossless), ``raw`` (the entry's raw bytes) and
``checksum`` (xxh3-64 of the raw bytes): ``extents`` then hold the coded bytes, which the client
decodes into its own buffer (the frame's declared size must equal ``raw``, bounded by the
client's own entry limit, before a byte is decoded; the checksum is verified after). A client
that does not list it (every client before coded arenas) is answered a miss for a coded entry,
never its coded bytes. The protocol version is unchanged: the field is optional both ways.

Batched reads (a server whose hello reply has ``batch_reads: N``, the most keys one batch should
hold: ``MAX_BATCH_ITEMS`` or its per-connection lease cap if smaller): ``get_many`` answers up to
``MAX_BATCH_ITEMS`` keys in one round trip, each as ``get`` would (a hit holds a lease; the
lease cap applies to the batch: a key past it is a miss), and ``release_many`` gives a batch's
leases back in one message. Against a server that names none, a client reads one key at a time.

Every key field (``lookup.keys[i]``, ``get.key``, ``get_many.keys[i]``, ``reserve.key``, ``reserve.parent``,
``reserve_arena.key``, ``reserve_arena.parent``, ``delete.key``) is a chunk key of exactly ``KEY_BYTES`` bytes; any other length is a
``malformed`` error reply and the connection goes on.

======== ======================================== ===============================================
op       request fields                           reply fields
======== ======================================== ===============================================
hello    version:int, token:str|None,             version, server_id, arena{path,size},
         decodes:[str] (optional)                 staging{path,size}, page_size, tiers[str],
                                                  lease_timeout_s, direct_writes:bool,
                                                  arena_codec:str, batch_reads:int,
                                                  batch_writes:int, write_share:int
lookup   keys:[bytes]                             n (leading keys present in some tier)
get      key:bytes                                tier (str|None), lease:int, extents[[off,len]]
                                                  (a lease is released by the server after
                                                  ``lease_timeout_s`` from hello's reply);
                                                  a coded entry adds codec:int, raw:int,
                                                  checksum:int (see below)
get_many keys:[bytes] (1..MAX_BATCH_ITEMS)        items[{tier, lease, extents, ...}]: each key
                                                  answered as ``get`` answers it, in order
release  lease:int                                (none)
release_ leases:[int]                             (none)
many
reserve  key, nbytes:int, parent:bytes|None,      status ("ok"|"exists"|"full"|"quota"), lease, extents
         chunk_index:int                          (offsets in the staging area)
reserve_ key, nbytes, parent, chunk_index         status ("ok"|"exists"|"full"|"quota"), lease,
arena    (as reserve)                             extents (offsets in the arena); the next request
                                                  ends it (see above)
reserve_ items:[{key, nbytes, parent,            status ("ok"|"quota"); when some item was
arena_   chunk_index}] (1..MAX_BATCH_ITEMS)       reserved, lease; items[{status ("ok"|"exists"|
many                                              "full"), extents (status ok)}], in order; the
                                                  next request ends it, as reserve_arena's
commit   lease:int                                stored:bool; for a batch lease stored:[bool]
                                                  per item (error: lease_expired)
abort    lease:int                                (none)
delete   key:bytes                                (empty)
stats    -                                        stats (the store's stats dict + server counters)
events   -                                        events[[kind, key, medium]] (taken: each event
                                                  goes to one asker)
flush    timeout:float (>= 0; capped at 60 s)     done:bool
======== ======================================== ===============================================
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from typing import Any

import msgpack

from kvtier.errors import KVTierError
from kvtier.keys import KEY_BYTES

VERSION = 1
MAX_FRAME = 8 * 1024 * 1024  # a lookup of 200k keys fits; anything larger is malformed
MAX_HELLO_FRAME = 4096  # a hello (version + token) is tiny; more before authentication is hostile
MAX_BATCH_ITEMS = 64  # chunks one reserve_arena_many may reserve
MAX_FLUSH_S = 60.0  # the server waits at most this long in one flush, whatever was asked
_LEN = struct.Struct(">I")
_RECV_CHUNK = 256 * 1024  # a frame's buffer grows with the bytes that arrive, never ahead of them

# op -> {field: accepted types}; every listed field is required
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"version": (int,), "token": (str, type(None))},
    "lookup": {"keys": (list,)},
    "get": {"key": (bytes,)},
    "get_many": {"keys": (list,)},
    "release": {"lease": (int,)},
    "release_many": {"leases": (list,)},
    "reserve": {"key": (bytes,), "nbytes": (int,), "parent": (bytes, type(None)), "chunk_index": (int,)},
    "reserve_arena": {"key": (bytes,), "nbytes": (int,), "parent": (bytes, type(None)),
                      "chunk_index": (int,)},
    "reserve_arena_many": {"items": (list,)},
    "commit": {"lease": (int,)},
    "abort": {"lease": (int,)},
    "delete": {"key": (bytes,)},
    "stats": {},
    "events": {},
    "flush": {"timeout": (int, float)},
}
NO_REPLY = frozenset({"release", "release_many", "abort"})

# error codes
BAD_TOKEN = "bad_token"
BAD_VERSION = "version_mismatch"
MALFORMED = "malformed"
HELLO_FIRST = "hello_first"
BUSY = "busy"  # the server is at its connection cap: try again later
LEASE_EXPIRED = "lease_expired"  # a direct write committed after its lease ran out (aborted)

# fields that carry a chunk key (a list of keys for lookup); ``None`` allowed where listed
_KEY_FIELDS: dict[str, tuple[str, ...]] = {"get": ("key",), "reserve": ("key", "parent"),
                                           "reserve_arena": ("key", "parent"), "delete": ("key",)}


class ProtocolError(KVTierError):
    """A frame or message that does not follow the protocol (``code`` names the kind)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ServerRejected(KVTierError):
    """The server refused this client (wrong token, protocol version mismatch, bad request)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"kvtier server rejected the request ({code}): {message}")
        self.code = code


def encode(message: dict[str, Any]) -> bytes:
    """One frame: length prefix + msgpack map."""
    body = msgpack.packb(message, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message (blocking)."""
    sock.sendall(encode(message))


def recv(sock: socket.socket, max_frame: int = MAX_FRAME, deadline: float | None = None) -> dict[str, Any] | None:
    """Read one message; None on a clean end of stream before a frame starts.

    ``max_frame`` bounds the announced length (checked before any body byte is read or any
    buffer allocated); ``deadline`` (a ``time.monotonic()`` instant) bounds the whole read, however
    slowly the bytes trickle in: past it, TimeoutError. Without a deadline the socket's own
    timeout applies per receive. Raises ProtocolError for an oversized frame or a body that is not
    a msgpack map, and ConnectionError when the stream ends inside a frame.
    """
    head = _recv_exact(sock, _LEN.size, allow_eof=True, deadline=deadline)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > max_frame:
        raise ProtocolError(MALFORMED, f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    body = _recv_exact(sock, length, allow_eof=False, deadline=deadline)
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(MALFORMED, f"frame is not msgpack ({type(exc).__name__})") from exc
    if not isinstance(message, dict):
        raise ProtocolError(MALFORMED, "a message must be a msgpack map")
    return message


def poll_readable(sock: socket.socket, spin_s: float) -> bool:
    """Poll ``sock`` without blocking for up to ``spin_s`` seconds (yielding the CPU between
    polls); True as soon as a byte or the stream's end can be read, False when the time ran out.

    A caller about to block on a reply that is due within microseconds spins here first: a
    blocked thread's wake-up costs ~0.1 ms on a virtual machine whose idle vCPU halts, more than
    the work being waited for. The socket's timeout is restored before returning.
    """
    if spin_s <= 0:
        return False
    timeout = sock.gettimeout()
    end = time.perf_counter() + spin_s
    sock.settimeout(0.0)
    try:
        while True:
            try:
                sock.recv(1, socket.MSG_PEEK)
                return True
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= end:
                    return False
                os.sched_yield()
    finally:
        sock.settimeout(timeout)


class Poller:
    """When to poll (``poll_readable``) before a blocking read, learned from the waits seen.

    Polling pays only where the awaited message comes within the budget; where it comes later
    (the peer's cores are busy: many clients, a slow tier's writers) the spin only takes a core
    from the peer. So it polls while the moving average of the recent waits stays within the
    budget, stops once the average exceeds it, and resumes once it falls under half of it. One
    per connection, used under that connection's lock (not thread-safe).
    """

    def __init__(self, budget_s: float):
        self.budget = float(budget_s)
        self.average = 0.0  # seconds; 0: no wait seen yet
        self.polling = self.budget > 0

    def poll(self, sock: socket.socket, limit_s: float = math.inf) -> bool:
        """``poll_readable`` for up to the budget (and ``limit_s``) when polling is on."""
        return self.polling and poll_readable(sock, min(self.budget, limit_s))

    def observe(self, waited_s: float) -> None:
        """Fold one wait (the request, or the end of an expected fill, to the message) in."""
        if self.budget <= 0:
            return
        self.average = waited_s if self.average <= 0 else 0.8 * self.average + 0.2 * waited_s
        if self.polling and self.average > self.budget:
            self.polling = False
        elif not self.polling and self.average < self.budget / 2:
            self.polling = True


def validate(message: dict[str, Any]) -> str:
    """Check a request against ``SCHEMA``; return its op. Raises ProtocolError(MALFORMED)."""
    op = message.get("op")
    fields = SCHEMA.get(op) if isinstance(op, str) else None
    if fields is None:
        raise ProtocolError(MALFORMED, f"unknown op {op!r}; valid ops: {', '.join(SCHEMA)}")
    for name, types in fields.items():
        value = message.get(name)
        if name not in message or not isinstance(value, types) or isinstance(value, bool):
            want = "|".join(t.__name__ for t in types)
            raise ProtocolError(MALFORMED, f"{op}: field {name!r} must be {want}")
    if op in ("get_many", "release_many"):
        (field,) = SCHEMA[op]
        if not 1 <= len(message[field]) <= MAX_BATCH_ITEMS:
            raise ProtocolError(MALFORMED, f"{op}: {field} must hold 1 to {MAX_BATCH_ITEMS} entries, "
                                           f"got {len(message[field])}")
    if op in ("lookup", "get_many"):
        for i, key in enumerate(message["keys"]):
            _check_key(key, f"{op}: keys[{i}]")
    if op == "release_many" and not all(isinstance(x, int) and not isinstance(x, bool) for x in message["leases"]):
        raise ProtocolError(MALFORMED, "release_many: leases must be integers")
    for name in _KEY_FIELDS.get(op, ()):
        if message[name] is not None:
            _check_key(message[name], f"{op}: field {name!r}")
    if op in ("reserve", "reserve_arena"):
        _check_write(message, op)
    if op == "reserve_arena_many":
        items = message["items"]
        if not 1 <= len(items) <= MAX_BATCH_ITEMS:
            raise ProtocolError(MALFORMED, f"{op}: items must hold 1 to {MAX_BATCH_ITEMS} chunks, got {len(items)}")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ProtocolError(MALFORMED, f"{op}: items[{i}] must be a map")
            for name, types in SCHEMA["reserve_arena"].items():
                value = item.get(name)
                if name not in item or not isinstance(value, types) or isinstance(value, bool):
                    want = "|".join(t.__name__ for t in types)
                    raise ProtocolError(MALFORMED, f"{op}: items[{i}] field {name!r} must be {want}")
            for name in _KEY_FIELDS["reserve_arena"]:
                if item[name] is not None:
                    _check_key(item[name], f"{op}: items[{i}] field {name!r}")
            _check_write(item, f"{op}: items[{i}]")
    if op == "flush" and not (math.isfinite(message["timeout"]) and message["timeout"] >= 0):
        raise ProtocolError(MALFORMED, "flush: timeout must be a finite, non-negative number of seconds")
    return op


def _check_write(fields: dict[str, Any], what: str) -> None:
    """A write's ``nbytes`` and ``chunk_index`` are not negative (ProtocolError otherwise)."""
    if fields["nbytes"] < 0:
        raise ProtocolError(MALFORMED, f"{what}: nbytes must not be negative")
    if fields["chunk_index"] < 0:
        raise ProtocolError(MALFORMED, f"{what}: chunk_index must not be negative")


def decodes_lossless(hello: dict[str, Any]) -> bool:
    """Whether a hello's optional ``decodes`` lists ``"lossless"`` (anything malformed: no)."""
    decodes = hello.get("decodes")
    return isinstance(decodes, list) and "lossless" in [d for d in decodes if isinstance(d, str)]


def is_key(key: Any) -> bool:
    """Whether ``key`` is a chunk key as the protocol carries it: bytes of exactly ``KEY_BYTES``."""
    return isinstance(key, bytes) and len(key) == KEY_BYTES


def _check_key(key: Any, what: str) -> None:
    if not is_key(key):
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ProtocolError(MALFORMED, f"{what} must be a {KEY_BYTES}-byte chunk key, got {got}")


def error(code: str, message: str) -> dict[str, Any]:
    """An error reply."""
    return {"ok": False, "error": code, "message": message}


def _recv_exact(sock: socket.socket, n: int, allow_eof: bool, deadline: float | None = None) -> bytes | None:
    """Exactly ``n`` bytes; the buffer grows only as bytes arrive (a peer that announces much and
    sends little costs little). None on EOF before the first byte when ``allow_eof``."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed while reading a frame")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(buf), _RECV_CHUNK))
        if not chunk:
            if not buf and allow_eof:
                return None
            raise ConnectionError("connection closed inside a frame")
        buf += chunk
    return bytes(buf)


def send_by(sock: socket.socket, message: dict[str, Any], deadline: float) -> None:
    """Send one message, giving up (TimeoutError) once ``deadline`` (``time.monotonic()``) passes."""
    data = memoryview(encode(message))
    while data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed while sending a frame")
        sock.settimeout(remaining)
        sent = sock.send(data)
        data = data[sent:]


def parse_address(address: str) -> tuple[int, Any]:
    """``unix:///path`` -> (AF_UNIX, path); ``tcp://host:port`` -> (AF_INET, (host, port)).

    Raises KVTierError (a ConfigError) naming the accepted forms.
    """
    from kvtier.errors import ConfigError

    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path:
            raise ConfigError(f"server address {address!r}: empty socket path")
        return socket.AF_UNIX, path
    if address.startswith("tcp://"):
        rest = address[len("tcp://"):]
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ConfigError(f"server address {address!r}: expected tcp://HOST:PORT")
        return socket.AF_INET, (host.strip("[]"), int(port))
    raise ConfigError(f"server address {address!r}: expected unix:///path.sock or tcp://HOST:PORT")

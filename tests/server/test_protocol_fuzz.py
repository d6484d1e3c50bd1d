"""Property-based fuzzing of the server protocol against a real ``kvtier serve`` process.

Thousands of generated inputs per run: raw bytes and frames of any announced length before
``hello``, and msgpack maps with known and unknown ops and fields of every msgpack type (right
and wrong) after it, plus garbage frames mid-session. Properties: every input gets an answer or a
clean hang-up within the deadline (no hang), the server process never dies and never logs a
traceback (no crash), its resident memory stays bounded, and a good client is served afterwards.

``KVTIER_FUZZ_EXAMPLES`` scales the number of examples (default 1: about 4,000 inputs in all).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.keys import KEY_BYTES
from kvtier.server import ServerStore
from kvtier.server import protocol as P

SCALE = float(os.environ.get("KVTIER_FUZZ_EXAMPLES", "1"))
REPLY_TIMEOUT_S = 10.0  # generous on a loaded 2-core machine; a hang is minutes, not seconds
PING = {"op": "stats"}  # never generated, so its reply marks the end of a fuzzed message's replies
OPS = [op for op in P.SCHEMA if op != "stats"]


def _examples(n: int) -> int:
    return max(10, int(n * SCALE))


def _settings(examples: int):
    return settings(max_examples=_examples(examples), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError("VmRSS")


# any msgpack value the server might be handed (bounded so a frame stays well under MAX_FRAME)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=80),
    st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES),  # a well-formed key: deeper code paths
    st.integers(min_value=0, max_value=1 << 22),  # plausible sizes, leases, indexes
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)
field_names = st.sampled_from(["key", "keys", "lease", "nbytes", "parent", "chunk_index", "timeout",
                               "version", "token"]) | st.text(max_size=12)
messages = st.builds(
    lambda op, fields: {**fields, "op": op},
    st.sampled_from(OPS) | st.text(max_size=12) | scalars,
    st.dictionaries(field_names, values, max_size=5),
)
# well-typed requests with random contents: they exercise the store, leases and quotas
typed = st.one_of(
    st.builds(lambda k: {"op": "get", "key": k}, st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)),
    st.builds(lambda ks: {"op": "lookup", "keys": ks},
              st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=8)),
    st.builds(lambda k, n, i: {"op": "reserve", "key": k, "nbytes": n, "parent": None, "chunk_index": i},
              st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), st.integers(0, 3 << 20), st.integers(0, 2**63)),
    st.builds(lambda k, n, i: {"op": "reserve_arena", "key": k, "nbytes": n, "parent": None, "chunk_index": i},
              st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), st.integers(0, 3 << 20), st.integers(0, 2**63)),
    st.builds(lambda op, lease: {"op": op, "lease": lease}, st.sampled_from(["commit", "abort", "release"]),
              st.integers(-(2**63), 2**64 - 1)),
    st.builds(lambda k: {"op": "delete", "key": k}, st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES)),
    st.builds(lambda t: {"op": "flush", "timeout": t}, st.floats(allow_nan=True) | st.integers(-5, 1000)),
)


def _frame(body: bytes, announced: int | None = None) -> bytes:
    return struct.pack(">I", len(body) if announced is None else announced) + body


raw_inputs = st.one_of(
    st.binary(max_size=200),  # bytes with no framing at all
    st.builds(_frame, st.binary(max_size=300), st.integers(0, 2**32 - 1)),  # any announced length
    st.builds(lambda m: _frame(msgpack.packb(m, use_bin_type=True)), messages),  # maps before hello
    st.builds(lambda v: _frame(msgpack.packb(v, use_bin_type=True)), values),  # not even a map
    st.builds(lambda t, v: _frame(msgpack.packb({"op": "hello", "version": v, "token": t}, use_bin_type=True)),
              st.text(max_size=30) | st.none() | st.integers(-(2**63), 2**63),
              st.integers(-3, 3) | st.text(max_size=3)),
)


def _drain_until_eof(s: socket.socket) -> None:
    """Read until the server closes; every complete frame it sent must be a reply map."""
    s.settimeout(REPLY_TIMEOUT_S)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        if len(data) < 4 + n:
            break
        reply = msgpack.unpackb(data[4 : 4 + n], raw=False)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        data = data[4 + n :]


@pytest.fixture
def fuzz_server(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "16MiB", "page_size": "64KiB"}], staging="8MiB",
                         hello_timeout_s=3.0, lease_timeout_s=2.0, max_unauthenticated=64)
    yield server
    assert server.proc.poll() is None, "the server died"
    log = server.output()
    assert "Traceback" not in log and "connection failed" not in log, log[-3000:]
    with ServerStore(server.address) as good:  # a good client is served afterwards
        payload = np.arange(200_000, dtype=np.uint32).view(np.uint8)
        assert good.put(b"\x42" * KEY_BYTES, payload)
        assert good.get(b"\x42" * KEY_BYTES) == payload.tobytes()


def test_fuzz_before_hello(fuzz_server):
    """Anything a stranger sends before hello ends in a reply and a hang-up or, for a valid hello,
    in a session, all within the deadline, at no lasting memory cost."""
    pid = fuzz_server.proc.pid
    rss0 = _rss_kib(pid)
    sent = [0]

    @_settings(1500)
    @given(data=raw_inputs)
    def run(data: bytes) -> None:
        sent[0] += 1
        family, where = P.parse_address(fuzz_server.address)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(REPLY_TIMEOUT_S)
            s.connect(where)
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)  # the server sees the end of what we had to say
            except (BrokenPipeError, ConnectionResetError):
                pass  # it already hung up on us
            _drain_until_eof(s)

    started = time.monotonic()
    run()
    assert time.monotonic() - started < 120
    assert sent[0] >= _examples(1500)
    assert _rss_kib(pid) - rss0 < 64 * 1024, "server memory grew by more than 64 MiB"


class _Session:
    """An authenticated connection that reconnects when the server hangs up on it."""

    def __init__(self, address: str):
        self.address = address
        self.sock: socket.socket | None = None
        self.hangups = 0
        self.exchanges = 0

    def ensure(self) -> socket.socket:
        if self.sock is None:
            family, where = P.parse_address(self.address)
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.settimeout(REPLY_TIMEOUT_S)
            self.sock.connect(where)
            P.send(self.sock, {"op": "hello", "version": P.VERSION, "token": None})
            assert P.recv(self.sock)["ok"]
        return self.sock

    def exchange(self, payload: bytes) -> None:
        """Send ``payload`` then a ping; every reply up to the ping's must be a reply map, and the
        ping's must come (or the server hangs up: then reconnect)."""
        s = self.ensure()
        self.exchanges += 1
        try:
            s.sendall(payload + P.encode(PING))
            while True:
                reply = P.recv(s)
                if reply is None:
                    raise ConnectionError("hung up")
                assert isinstance(reply.get("ok"), bool), reply
                if "stats" in reply:
                    return
                if not reply["ok"]:
                    assert reply["error"] in (P.MALFORMED, P.HELLO_FIRST, P.BAD_VERSION), reply
        except (ConnectionError, BrokenPipeError):
            self.hangups += 1
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def test_fuzz_after_hello(fuzz_server):
    """After hello, maps of any shape and any field types, well-typed requests with random
    contents and garbage frames: every one answered (or the stream hung up on when it is out of
    sync) within the deadline, the session usable again, memory bounded."""
    pid = fuzz_server.proc.pid
    rss0 = _rss_kib(pid)
    session = _Session(fuzz_server.address)
    inputs = st.one_of(
        st.builds(lambda m: P.encode(m) if _packable(m) else b"", messages),
        st.builds(P.encode, typed),
        st.builds(_frame, st.binary(max_size=100)),  # garbage body: out of sync, hang-up expected
    )

    @_settings(2500)
    @given(payload=inputs)
    def run(payload: bytes) -> None:
        session.exchange(payload)

    started = time.monotonic()
    try:
        run()
    finally:
        session.close()
    assert time.monotonic() - started < 120
    assert session.exchanges >= _examples(2500)
    assert 0 < session.hangups < session.exchanges  # garbage frames cost the session; the rest does not
    assert _rss_kib(pid) - rss0 < 64 * 1024, "server memory grew by more than 64 MiB"


def _packable(message: dict) -> bool:
    try:
        msgpack.packb(message, use_bin_type=True)
        return True
    except (TypeError, ValueError, OverflowError):
        return False

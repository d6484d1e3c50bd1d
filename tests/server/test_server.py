"""The per-node cache server, as real ``kvtier serve`` processes, through ServerStore."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
import urllib.request

import msgpack
import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.server import ServeConfig, ServerRejected, ServerStore
from kvtier.server import protocol as P


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8)


def _raw(address: str) -> socket.socket:
    family, where = P.parse_address(address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(where)
    return s


# ----------------------------------------------------------------------------- protocol


def test_frames_round_trip_and_reject_garbage():
    msg = {"op": "lookup", "keys": [b"\x00" * 32, b"\xff" * 32]}
    a, b = socket.socketpair()
    with a, b:
        P.send(a, msg)
        assert P.recv(b) == msg
        assert P.validate(msg) == "lookup"
        a.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
        with pytest.raises(P.ProtocolError):
            P.recv(b)
    for bad in ({"op": "nope"}, {"op": "get", "key": "str"}, {"op": "lookup", "keys": [1]},
                {"op": "reserve", "key": b"k", "nbytes": -1, "parent": None, "chunk_index": 0}):
        with pytest.raises(P.ProtocolError):
            P.validate(bad)


def test_config_rules():
    with pytest.raises(ConfigError, match="token"):
        ServeConfig.from_mapping({"listen": "tcp://127.0.0.1:7300"})
    with pytest.raises(ConfigError, match="ram"):
        ServeConfig.from_mapping({"store": {"tiers": [{"type": "disk", "path": "/tmp/x"}]}})
    with pytest.raises(ConfigError, match="valid keys"):
        ServeConfig.from_mapping({"listne": "unix:///tmp/x.sock"})
    cfg = ServeConfig.from_mapping({"listen": "tcp://127.0.0.1:7300", "token": "s3cret"})
    assert "s3cret" not in repr(cfg)


# ----------------------------------------------------------------------------- data path


def test_put_lookup_get_bit_exact_through_shared_memory(make_server):
    server = make_server()
    mode = stat.S_IMODE(os.stat(server.address[len("unix://"):]).st_mode)
    assert mode == 0o600
    with ServerStore(server.address) as a, ServerStore(server.address) as b:
        sizes = [1, 65536, 3 * 65536 + 17, 4 << 20]
        for i, n in enumerate(sizes):
            assert a.put(_key(i), _payload(i, n), parent=_key(i - 1) if i else None, chunk_index=i)
        assert b.lookup([_key(i) for i in range(len(sizes))] + [_key(99)]) == len(sizes)
        assert b.lookup([_key(99), _key(0)]) == 0
        for i, n in enumerate(sizes):  # another client reads what the first wrote
            got = b.get(_key(i))
            assert got == _payload(i, n).tobytes()
        out = np.empty(4 << 20, dtype=np.uint8)
        assert b.get_into(_key(3), out) == 4 << 20 and np.array_equal(out, _payload(3, 4 << 20))
        assert b.read(_key(99), lambda segs: None) is None
        assert a.put(_key(0), _payload(0, 1))  # already there: acknowledged, not copied again
        events = b.take_events()
        assert {k for kind, k, _ in events if kind == "stored"} == {_key(i) for i in range(len(sizes))}
        assert a.take_events() == []  # each event goes to one asker
        stats = a.stats()
        assert stats["hits"] >= len(sizes) and stats["server"]["put_stored"] == len(sizes)
        assert stats["client"]["errors"] == 0
        # views handed to consume are read-only and segment sizes are whole arena pages
        seen = []
        assert b.read(_key(3), lambda segs: seen.extend(segs)) == "ram"
        assert all(not s.flags.writeable for s in seen) and sum(s.size for s in seen) == 4 << 20


def test_lower_tier_hit_is_promoted_before_answering(make_server, tmp_path):
    tiers = [{"type": "ram", "capacity": "2MiB", "page_size": "64KiB", "policy": "lru"},
             {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"}]
    server = make_server(tiers=tiers)
    with ServerStore(server.address) as c:
        for i in range(6):  # 6 x 512 KiB through a 2 MiB arena: the first ones go to disk
            assert c.put(_key(i), _payload(i, 512 << 10))
        assert c.flush(timeout=20)
        assert c.lookup([_key(i) for i in range(6)]) == 6
        assert c.read(_key(0), lambda segs: None) == "disk"
        assert c.get(_key(0)) == _payload(0, 512 << 10).tobytes()  # now served from the arena
        assert c.read(_key(0), lambda segs: None) == "ram"
        assert c.stats()["promotions"] >= 1


def test_lease_keeps_pages_while_the_entry_is_replaced(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "1MiB", "page_size": "64KiB"}])
    with ServerStore(server.address) as reader, ServerStore(server.address) as writer:
        assert writer.put(_key(0), _payload(0, 512 << 10))
        seen = []

        def consume(segs):
            # while we hold the lease, another engine fills the arena (evicting our key)
            for i in range(1, 4):
                writer.put(_key(i), _payload(i, 256 << 10))
            seen.append(b"".join(s.tobytes() for s in segs))

        assert reader.read(_key(0), consume) == "ram"
        assert seen[0] == _payload(0, 512 << 10).tobytes()


# ----------------------------------------------------------------------------- rejections


def test_bad_token_version_and_malformed_rejected_while_others_are_served(make_server):
    server = make_server(listen="tcp://127.0.0.1:0", token="right-token")  # the ready line names the port
    good = ServerStore(server.address, token="right-token")
    assert good.put(_key(1), _payload(1, 100_000))

    with pytest.raises(ServerRejected, match="bad_token"):
        ServerStore(server.address, token="wrong-token")
    with pytest.raises(ServerRejected, match="bad_token"):
        ServerStore(server.address)

    with _raw(server.address) as s:
        P.send(s, {"op": "hello", "version": P.VERSION + 1, "token": "right-token"})
        reply = P.recv(s)
        assert reply["error"] == P.BAD_VERSION and str(P.VERSION) in reply["message"]
    with _raw(server.address) as s:  # garbage instead of a frame
        s.sendall(struct.pack(">I", 5) + b"\xc1garb")
        assert P.recv(s)["error"] == P.MALFORMED
    with _raw(server.address) as s:  # an absurd frame length
        s.sendall(struct.pack(">I", 0xFFFFFFFF))
        assert P.recv(s)["error"] == P.MALFORMED
    with _raw(server.address) as s:  # a request before hello
        P.send(s, {"op": "get", "key": _key(1)})
        assert P.recv(s)["error"] == P.HELLO_FIRST
    with _raw(server.address) as s:  # after a good hello, a bad field: an error, and the session goes on
        P.send(s, {"op": "hello", "version": P.VERSION, "token": "right-token"})
        assert P.recv(s)["ok"]
        s.sendall(P.encode({"op": "get", "key": 12345}))
        assert P.recv(s)["error"] == P.MALFORMED
        P.send(s, {"op": "lookup", "keys": [_key(1)]})
        assert P.recv(s) == {"ok": True, "n": 1}
        s.sendall(struct.pack(">I", 2) + msgpack.packb([1]))  # not a map
        assert P.recv(s)["error"] == P.MALFORMED

    assert good.get(_key(1)) == _payload(1, 100_000).tobytes()  # the good client never noticed
    server_stats = good.stats()["server"]
    assert server_stats["rejected"] >= 4 and server_stats["malformed"] >= 3
    assert "right-token" not in server.log.read_text()
    good.close()


# ----------------------------------------------------------------------------- faults


def test_server_killed_then_restarted_client_misses_then_reconnects(make_server):
    server = make_server()
    client = ServerStore(server.address, backoff=0.05, max_backoff=0.2)
    assert client.put(_key(1), _payload(1, 300_000))
    assert client.read(_key(1), lambda segs: None) == "ram"

    server.kill()
    assert client.read(_key(1), lambda segs: None) is None
    assert client.write(_key(2), 10, lambda segs: None) is False
    assert client.lookup([_key(1)]) == 0
    assert client.take_events() == []
    counters = client.stats()["client"]
    assert counters["errors"] + counters["unavailable"] >= 3

    server.start()  # a new process: new arena, empty RAM tier
    deadline = time.monotonic() + 20
    while not client.put(_key(1), _payload(1, 300_000)):  # poll until the backoff lets it reconnect
        assert time.monotonic() < deadline, "client did not reconnect"
        time.sleep(0.05)
    assert client.get(_key(1)) == _payload(1, 300_000).tobytes()  # the new arena is mapped
    assert client.stats()["client"]["reconnects"] >= 1
    client.close()


def test_client_starts_while_server_is_down(tmp_path):
    client = ServerStore(f"unix://{tmp_path}/absent.sock", backoff=0.01)
    assert client.lookup([_key(0)]) == 0 and client.read(_key(0), lambda s: None) is None
    assert client.stats()["client"]["unavailable"] >= 2
    client.close()


# ----------------------------------------------------------------------------- metrics


def test_metrics_and_healthz(make_server):
    server = make_server()
    with ServerStore(server.address) as c:
        c.put(_key(5), _payload(5, 70_000))
        c.get(_key(5))
        c.read(_key(6), lambda s: None)
    base = f"http://{server.metrics_address}"  # bound as port 0, reported in the ready line
    assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["kvtier_store_hits_total"]) >= 1
    assert float(lines["kvtier_store_misses_total"]) >= 1
    assert float(lines['kvtier_tier_bytes_written_total{tier="ram"}']) >= 70_000
    assert 'kvtier_tier_errors_total{tier="ram"}' in lines
    assert 'kvtier_tier_queue_depth{tier="ram"}' in lines
    assert float(lines["kvtier_server_connections_total"]) >= 1

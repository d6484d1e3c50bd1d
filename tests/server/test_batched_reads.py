"""Batched reads from the cache server: ``get_many`` + ``release_many`` (``ServerStore.read_many``).

Real ``kvtier serve`` processes and real clients; raw frames where a test plays a client or a
server that misbehaves. The rules under test: each key is answered as ``get`` answers it, in
one round trip for up to ``MAX_BATCH_ITEMS`` keys; every lease of the batch is given back in one
message, also when the caller's ``consume`` raises; a batch whose copies outlasted the lease is
all misses; coded entries are decoded (read one at a time); the per-connection lease cap holds
for a batch; a malformed batch is refused in one line and the connection goes on.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.keys import KEY_BYTES
from kvtier.server import ServerStore
from kvtier.server import protocol as P
from kvtier.store import TieredStore
from tests.server.test_direct_write import _ask, _key, _payload, _raw, _server_stats, _wait

MiB = 1 << 20
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]


def _collect(out: dict):
    def consume(i: int, segments) -> None:
        out[i] = b"".join(bytes(s) for s in segments)
    return consume


def test_a_batch_of_reads_is_one_round_trip_and_gives_every_lease_back(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        for i in (0, 2, 3):
            assert c.put(_key(i), _payload(i, 65536 * (i + 1) - 7))
        before = c.stats()
        got: dict = {}
        assert c.read_many([_key(i) for i in range(5)], _collect(got)) == ["ram", None, "ram", "ram", None]
        assert sorted(got) == [0, 2, 3] and all(got[i] == _payload(i, 65536 * (i + 1) - 7).tobytes() for i in got)
        after = c.stats()
        assert after["client"]["requests"] - before["client"]["requests"] == 3  # get_many, release_many, stats
        assert after["client"]["hits"] - before["client"]["hits"] == 3
        assert after["client"]["misses"] - before["client"]["misses"] == 2
        assert after["server"]["get_batches"] - before["server"]["get_batches"] == 1
        assert after["server"]["leases_open"] == 0
        assert c.read_many([], _collect({})) == []


def test_more_keys_than_one_batch_go_in_several(make_server):
    server = make_server(tiers=ARENA_8M, max_leases_per_client=P.MAX_BATCH_ITEMS)
    keys = [_key(i) for i in range(P.MAX_BATCH_ITEMS + 6)]
    with ServerStore(server.address) as c:
        assert c.put_many([(k, bytes([i % 251]) * 1000) for i, k in enumerate(keys)]) == [True] * len(keys)
        got: dict = {}
        assert c.read_many(keys, _collect(got)) == ["ram"] * len(keys)
        assert all(got[i] == bytes([i % 251]) * 1000 for i in range(len(keys)))
        stats = c.stats()["server"]
        assert stats["get_batches"] == 2 and stats["leases_open"] == 0


def test_a_consume_that_raises_propagates_and_the_leases_come_back(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        for i in range(3):
            assert c.put(_key(i), _payload(i, MiB))

        def consume(i, segments):
            if i == 1:
                raise RuntimeError("injected copy failure")

        with pytest.raises(RuntimeError, match="injected"):
            c.read_many([_key(i) for i in range(3)], consume)
        assert c.stats()["server"]["leases_open"] == 0
        assert c.delete(_key(1)) and c.put(_key(1), _payload(9, MiB))  # its pages are free to reuse
        assert c.get(_key(1)) == _payload(9, MiB).tobytes()


def test_a_batch_that_outlasts_its_lease_is_all_misses(make_server):
    server = make_server(tiers=ARENA_8M, lease_timeout_s=0.3)
    with ServerStore(server.address) as c:
        for i in range(2):
            assert c.put(_key(i), _payload(i, 65536))
        assert c.read_many([_key(0), _key(1)], lambda i, segs: time.sleep(0.25)) == [None, None]
        client = c.stats()["client"]
        assert client["lease_expired"] == 1 and client["hits"] == 0
        got: dict = {}
        assert c.read_many([_key(0), _key(1)], _collect(got)) == ["ram", "ram"]  # in time: hits


def test_the_lease_cap_holds_for_a_batch_and_the_client_batches_within_it(make_server):
    """The server's cap answers a key past it a miss; its hello names the cap (``batch_reads``),
    so the client's batches stay within it and every stored key is a hit."""
    server = make_server(tiers=ARENA_8M, max_leases_per_client=4)
    keys = [_key(i) for i in range(6)]
    with ServerStore(server.address) as c:
        assert c._map.read_batch == 4
        assert c.put_many([(k, b"x" * 4096) for k in keys]) == [True] * 6
        assert c.read_many(keys, lambda i, segs: None) == ["ram"] * 6
        stats = c.stats()["server"]
        assert stats["get_batches"] == 2 and stats["lease_quota"] == 0 and stats["leases_open"] == 0
    s = _raw(server.address)
    try:
        reply = _ask(s, {"op": "get_many", "keys": keys})
        assert [item["tier"] for item in reply["items"]] == ["ram"] * 4 + [None] * 2
        P.send(s, {"op": "release_many", "leases": [item["lease"] for item in reply["items"][:4]]})
    finally:
        s.close()
    assert _server_stats(server.address)["server"]["lease_quota"] == 2


def test_coded_entries_in_a_batch_are_decoded_one_at_a_time(make_server):
    pytest.importorskip("blosc2")
    tiers = [{"type": "ram", "capacity": "16MiB", "page_size": "16KiB", "policy": "lru", "codec": "lossless"}]
    server = make_server(tiers=tiers)
    kv = [(np.arange(MiB // 2, dtype=np.uint16) * (i + 1) % 509).astype(np.uint16).view(np.uint8) for i in range(3)]
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(i), kv[i]) for i in range(3)]) == [True] * 3
        assert c.flush(30) and c.stats()["tiers"][0]["codec"]["entries_coded"] == 3
        got: dict = {}
        assert c.read_many([_key(0), _key(7), _key(1), _key(2)], _collect(got)) == ["ram", None, "ram", "ram"]
        assert got == {0: kv[0].tobytes(), 2: kv[1].tobytes(), 3: kv[2].tobytes()}
        assert c.stats()["client"]["decoded"] == 3 and c.stats()["server"]["leases_open"] == 0


@pytest.mark.parametrize("message, words", [
    ({"op": "get_many", "keys": []}, "1 to 64"),
    ({"op": "get_many", "keys": [b"k" * KEY_BYTES] * (P.MAX_BATCH_ITEMS + 1)}, "1 to 64"),
    ({"op": "get_many", "keys": [b"short"]}, f"{KEY_BYTES}-byte chunk key"),
    ({"op": "get_many", "keys": "x"}, "field 'keys'"),
    ({"op": "release_many", "leases": []}, "1 to 64"),
    ({"op": "release_many", "leases": [1, "2"]}, "leases must be integers"),
    ({"op": "release_many", "leases": [True]}, "leases must be integers"),
])
def test_a_malformed_batch_read_is_refused_and_the_connection_goes_on(make_server, message, words):
    server = make_server(tiers=ARENA_8M)
    s = _raw(server.address)
    try:
        reply = _ask(s, message)
        assert not reply["ok"] and reply["error"] == P.MALFORMED and words in reply["message"], reply
        assert _ask(s, {"op": "lookup", "keys": [_key(1)]}) == {"ok": True, "n": 0}
    finally:
        s.close()


def test_raw_get_many_answers_each_key_as_get_and_release_many_frees_them(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _payload(1, MiB))
    s = _raw(server.address)
    try:
        reply = _ask(s, {"op": "get_many", "keys": [_key(1), _key(2), _key(1)]})
        first, missing, again = reply["items"]
        assert first["tier"] == "ram" and missing == {"tier": None} and again["tier"] == "ram"
        assert first["lease"] != again["lease"] and first["extents"] == again["extents"]
        assert _server_stats(server.address)["server"]["leases_open"] == 2
        P.send(s, {"op": "release_many", "leases": [first["lease"], again["lease"], 987654]})  # no reply; unknown ids ignored
        assert _ask(s, {"op": "lookup", "keys": [_key(1)]})["n"] == 1
        assert _server_stats(server.address)["server"]["leases_open"] == 0
    finally:
        s.close()


def test_a_forged_batch_reply_is_all_misses_and_the_connection_is_dropped(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), b"y" * 4096)
        real_call = c._call
        forged = [{"items": [{"tier": "ram", "lease": 5, "extents": [[0, 4096]]}]},  # one answer for two keys
                  {"items": "nope"}, {"items": [1, 2]}]

        def call(message, deadline, reply=True):
            answer = real_call(message, deadline, reply)
            if message["op"] == "get_many" and forged:
                return {"ok": True, **forged.pop(0)}
            return answer

        monkeypatch.setattr(c, "_call", call)
        for _ in range(3):
            assert c.read_many([_key(1), _key(2)], lambda i, segs: pytest.fail("consumed a forged reply")) == [None] * 2
        assert c.stats()["client"]["errors"] >= 3
        got: dict = {}
        # the circuit breaker skips the server for a while after the drops
        _wait(lambda: c.read_many([_key(1)], _collect(got)) == ["ram"], 15, "the client's reconnect")
        assert got[0] == b"y" * 4096
    _wait(lambda: _server_stats(server.address)["server"]["leases_open"] == 0, 10, "every lease released")


def test_the_default_read_many_is_one_read_per_key(tmp_path):
    store = TieredStore.from_config({"tiers": [{"type": "ram", "capacity": "4MiB"}]})
    try:
        assert not store.reads_in_batches
        assert store.put(_key(1), b"a" * 100)
        got: dict = {}
        assert store.read_many([_key(0), _key(1)], _collect(got)) == [None, "ram"] and got == {1: b"a" * 100}
    finally:
        store.close()

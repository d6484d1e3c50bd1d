"""A coded server arena (issue 27: ``codec: lossless`` on ``kvtier serve``'s RAM tier).

Real ``kvtier serve`` processes and real clients. The rules under test: entries written raw
(direct or staged) are coded by the server in the background and read back bit-exact by
clients that decode; the arena then holds more entries than a raw one of the same capacity; a
client that did not say it decodes (every client before coded arenas) gets a miss, never coded
bytes; a garbled coded entry, or a forged ``get`` reply, is a counted miss (and the key is
deleted), never wrong KV and never a large allocation; a lease on a coded entry keeps its pages
through a delete.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.server import ServerStore
from kvtier.server import protocol as P
from kvtier.server.server import ServeConfig

from tests.tiers.test_ram_coded import _key, _kv

from .test_direct_write import _ask, _raw, _wait

pytest.importorskip("blosc2")

MiB = 1 << 20



def _arena(capacity: str = "16MiB", codec: str = "lossless", page: str = "16KiB") -> list[dict]:
    return [{"type": "ram", "capacity": capacity, "page_size": page, "policy": "lru", "codec": codec}]


def _coded(client: ServerStore) -> dict:
    return client.stats()["tiers"][0]["codec"]


def test_entries_are_coded_by_the_server_and_read_back_bit_exact(make_server):
    server = make_server(tiers=_arena())
    with ServerStore(server.address) as direct, ServerStore(server.address, direct_writes=False) as staged:
        for i in range(4):
            assert (direct if i % 2 else staged).put(_key(i), _kv(i))
        assert direct.flush(30)
        state = _coded(direct)
        assert state["codec"] == "lossless" and state["entries_coded"] == 4 and state["pending"] == 0
        out = np.empty(MiB, dtype=np.uint8)
        for i in range(4):
            assert staged.get_into(_key(i), out) == MiB and np.array_equal(out, _kv(i))  # decoded into out
            assert direct.get(_key(i)) == _kv(i).tobytes()  # decoded into the client's buffer
            seen = []
            assert direct.read(_key(i), lambda segs: seen.extend(segs)) == "ram"
            assert all(not s.flags.writeable for s in seen)
        small = np.zeros(100, dtype=np.uint8)
        assert direct.get_into(_key(0), small) is None  # too small a buffer: a miss, as for raw entries
        assert direct.stats()["client"]["decoded"] >= 8 and direct.stats()["client"]["corrupt"] == 0


def test_a_coded_arena_holds_more_entries_than_a_raw_one_of_the_same_capacity(make_server):
    held = {}
    for codec in ("none", "lossless"):
        server = make_server(tiers=_arena("8MiB", codec))
        with ServerStore(server.address) as c:
            for i in range(16):
                assert c.put(_key(i), _kv(i))
                assert c.flush(30)  # writes at an engine's pace: the coder keeps up
            held[codec] = sum(_key(i) in c for i in range(16))
            for i in range(16):  # whatever it holds reads back exactly
                got = c.get(_key(i))
                assert got is None or got == _kv(i).tobytes()
    assert held["none"] == 8 and held["lossless"] > held["none"]


def test_a_client_that_does_not_decode_gets_a_miss_never_coded_bytes(make_server):
    server = make_server(tiers=_arena())
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _kv(1)) and c.put(_key(2), _kv(2, 1000))  # 1000 bytes: too small to code
        assert c.flush(30)
        s = _raw(server.address)  # an older client: its hello has no "decodes"
        try:
            assert _ask(s, {"op": "get", "key": _key(1)}) == {"ok": True, "tier": None}
            raw = _ask(s, {"op": "get", "key": _key(2)})
            assert raw["tier"] == "ram" and "codec" not in raw  # raw entries are served as before
            assert _ask(s, {"op": "lookup", "keys": [_key(1)]})["n"] == 1
        finally:
            s.close()
        assert c.stats()["server"]["coded_unreadable"] == 1
        assert c.get(_key(1)) == _kv(1).tobytes()  # a client that decodes still gets it


def _garble_through_the_mapping(client: ServerStore, address: str, key: bytes) -> None:
    """Overwrite a coded entry's stored bytes through a client's writable arena mapping (what a
    buggy or hostile direct-write client of the same user can do)."""
    s = _raw_decoding(address)
    try:
        reply = _ask(s, {"op": "get", "key": key})
        assert reply["codec"] == 1
        off, length = reply["extents"][0]
        writable = client._map.writer._array
        writable[off + 4 : off + 8] = np.frombuffer((64 * MiB).to_bytes(4, "little"), dtype=np.uint8)  # raw length lies
        writable[off + length // 2 : off + length // 2 + 4096] = 0x5A
        P.send(s, {"op": "release", "lease": reply["lease"]})
    finally:
        s.close()


def _raw_decoding(address: str):
    import socket

    family, where = P.parse_address(address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(where)
    P.send(s, {"op": "hello", "version": P.VERSION, "token": None, "decodes": ["lossless"]})
    assert P.recv(s)["ok"]
    return s


def test_a_garbled_coded_entry_is_a_counted_miss_and_is_deleted(make_server):
    server = make_server(tiers=_arena())
    with ServerStore(server.address) as writer, ServerStore(server.address) as reader:
        assert writer.put(_key(1), _kv(1)) and writer.put(_key(2), _kv(2))
        assert writer.flush(30)
        _garble_through_the_mapping(writer, server.address, _key(1))
        out = np.full(MiB, 7, dtype=np.uint8)
        assert reader.get_into(_key(1), out) is None
        assert reader.stats()["client"]["corrupt"] == 1
        assert reader.lookup([_key(1)]) == 0  # deleted: it would miss for every reader
        assert reader.get(_key(2)) == _kv(2).tobytes()  # the neighbour is untouched


@pytest.mark.parametrize("forge", [
    {"codec": 2}, {"codec": 77}, {"codec": True}, {"raw": 0}, {"raw": 1 << 40}, {"raw": -5},
    {"raw": MiB // 4}, {"checksum": -1}, {"checksum": 1 << 64}, {"checksum": 12345}, {"extents_cut": 100},
])
def test_a_forged_get_reply_is_a_counted_miss_without_a_large_allocation(make_server, monkeypatch, forge):
    server = make_server(tiers=_arena())
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _kv(1)) and c.flush(30)
        real = c._call

        def forged_call(message, deadline, reply=True):  # fault injection: the server's reply lies
            answer = real(message, deadline, reply)
            if message.get("op") == "get" and answer and answer.get("codec"):
                answer = dict(answer)
                cut = forge.get("extents_cut")
                if cut:
                    off, length = answer["extents"][-1]
                    answer["extents"] = answer["extents"][:-1] + [[off, length - cut]]
                answer.update({k: v for k, v in forge.items() if k != "extents_cut"})
            return answer

        monkeypatch.setattr(c, "_call", forged_call)
        allocated = []
        scratch_get = c._scratch.get
        monkeypatch.setattr(c._scratch, "get", lambda size, slot="io": allocated.append(size) or scratch_get(size, slot))
        assert c.get(_key(1)) is None
        assert c.stats()["client"]["corrupt"] == 1
        assert all(size <= MiB for size in allocated)


def test_a_lease_on_a_coded_entry_keeps_its_pages_through_a_delete(make_server):
    server = make_server(tiers=_arena("4MiB"))
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _kv(1)) and c.flush(30)
        s = _raw_decoding(server.address)
        try:
            reply = _ask(s, {"op": "get", "key": _key(1)})
            assert reply["codec"] == 1
            arena = c._map.arena
            before = b"".join(bytes(arena[o : o + n]) for o, n in reply["extents"])
            assert c.delete(_key(1))
            for i in range(2, 12):  # the arena turns over: the leased pages are not reused
                c.put(_key(i), _kv(i))
                c.flush(30)
            assert b"".join(bytes(arena[o : o + n]) for o, n in reply["extents"]) == before
            P.send(s, {"op": "release", "lease": reply["lease"]})
        finally:
            s.close()
        _wait(lambda: c.stats()["server"]["leases_open"] == 0, what="the lease's release")


def test_fp8_stays_refused_by_serve_and_lossless_on_the_arena_is_taken():
    with pytest.raises(Exception) as info:
        ServeConfig.from_mapping({"listen": "unix:///tmp/x.sock", "store": {"tiers": _arena(codec="fp8")}})
    assert "\n" not in str(info.value) and "lossless" in str(info.value)
    config = ServeConfig.from_mapping({"listen": "unix:///tmp/x.sock", "store": {"tiers": _arena()}})
    assert config.store.tiers[0].config.codec == "lossless"


def test_a_coded_arena_over_an_fs_tier_demotes_and_promotes_raw_bytes(make_server, tmp_path):
    tiers = _arena("4MiB") + [{"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB"}]
    server = make_server(tiers=tiers)
    with ServerStore(server.address) as c:
        for i in range(10):  # more than the arena holds: the oldest go down to fs only
            assert c.put(_key(i), _kv(i))
            assert c.flush(30)
        tiers_seen = set()
        for i in reversed(range(10)):  # newest first: the arena's own before promotions evict them
            got = []
            tiers_seen.add(c.read(_key(i), lambda segs: got.append(b"".join(bytes(s) for s in segs))))
            assert got == [_kv(i).tobytes()]  # from fs (written from decoded bytes) or the arena
        assert tiers_seen == {"ram", "fs"}
        assert c.stats()["client"]["corrupt"] == 0

"""Direct writes into the server's arena (issue 25, item 3): ``reserve_arena`` -> fill -> commit.

Every test runs real ``kvtier serve`` processes (``make_server``) and real clients: the
``ServerStore``, or raw protocol frames where a test plays a client that misbehaves. The rules
under test are the ones ``kvtier.server.server`` states: a reservation is invisible until its
commit; abort, a refused commit, any other request, or the connection's end free its pages and
publish nothing; a commit past the lease is refused; a delete during the fill wins; one
connection holds one direct write, of at most its share, and all together at most ``staging``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.keys import KEY_BYTES
from kvtier.server import ServerStore
from kvtier.server import client as C
from kvtier.server import protocol as P

REPO = Path(kvtier.__file__).resolve().parent.parent
MiB = 1 << 20
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * (KEY_BYTES // 4)


def _payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8)


def _raw(address: str, timeout: float = 10.0) -> socket.socket:
    """A raw protocol connection that has said hello."""
    family, where = P.parse_address(address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(where)
    P.send(s, {"op": "hello", "version": P.VERSION, "token": None})
    reply = P.recv(s)
    assert reply and reply["ok"] and reply["direct_writes"] is True, reply
    return s


def _ask(s: socket.socket, message: dict) -> dict:
    P.send(s, message)
    reply = P.recv(s)
    assert reply is not None
    return reply


def _reserve(s: socket.socket, key: bytes, nbytes: int) -> dict:
    return _ask(s, {"op": "reserve_arena", "key": key, "nbytes": nbytes, "parent": None, "chunk_index": 0})


def _server_stats(address: str) -> dict:
    with ServerStore(address) as c:
        return c.stats()


def _wait(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def _arena_whole(address: str, n: int = 8, size: int = MiB) -> None:
    """The whole arena (n x size bytes) takes new entries with no eviction: no page leaked."""
    with ServerStore(address) as c:
        before = c.stats()["evictions"]
        for i in range(n):
            assert c.put(_key(1000 + i), _payload(1000 + i, size))
        assert c.lookup([_key(1000 + i) for i in range(n)]) == n
        assert c.stats()["evictions"] == before, "a page stayed held: the arena could not take its capacity"
        for i in range(n):
            assert c.delete(_key(1000 + i))


# ----------------------------------------------------------------------------- data path


def test_direct_write_round_trip_is_bit_exact_and_takes_the_direct_path(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "32MiB", "page_size": "64KiB"}])
    sizes = [1, 4096, 65536, 3 * 65536 + 17, 4 * MiB]
    with ServerStore(server.address) as writer, ServerStore(server.address, direct_writes=False) as reader, \
            ServerStore(server.address, write_protect=True) as protected:
        for i, n in enumerate(sizes):
            assert writer.put(_key(i), _payload(i, n), parent=_key(i - 1) if i else None, chunk_index=i)
            assert protected.put(_key(100 + i), _payload(100 + i, n))
        for i, n in enumerate(sizes):  # another client (a staging one) reads what they wrote
            assert reader.get(_key(i)) == _payload(i, n).tobytes()
            assert reader.get(_key(100 + i)) == _payload(100 + i, n).tobytes()
        assert reader.put(_key(50), _payload(50, MiB))  # the staging path still works beside it
        assert writer.get(_key(50)) == _payload(50, MiB).tobytes()
        assert writer.put(_key(0), _payload(0, 1))  # already there: acknowledged, nothing reserved
        stats = writer.stats()
        assert stats["client"]["direct_writes"] == len(sizes) and stats["client"]["write_failures"] == 0
        assert protected.stats()["client"]["direct_writes"] == len(sizes)
        assert reader.stats()["client"]["direct_writes"] == 0
        assert stats["server"]["direct_puts"] == 2 * len(sizes) + 1
        assert stats["server"]["put_stored"] == 2 * len(sizes) + 1
        assert stats["server"]["direct_write_bytes_open"] == 0 and stats["server"]["staging_used_bytes"] == 0
        seen = []  # what read hands out stays read-only although the mapping is writable now
        assert writer.read(_key(4), lambda segs: seen.extend(segs)) == "ram"
        assert seen and all(not s.flags.writeable for s in seen)


def test_write_protect_faults_a_write_after_the_fill_and_the_entry_keeps_its_bytes(make_server, tmp_path):
    server = make_server(tiers=ARENA_8M)
    script = textwrap.dedent(f"""
        import numpy as np
        from kvtier.server import ServerStore
        c = ServerStore({server.address!r}, write_protect=True)
        kept = []
        def fill(segs):
            for s in segs:
                s[:] = 7
            kept.extend(segs)
        assert c.write({_key(1)!r}, 65536, fill)
        print("stored", flush=True)
        kept[0][:] = 9  # a stray write after the commit: must fault, not land in the entry
        print("wrote", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "stored" in proc.stdout and "wrote" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGSEGV, proc.stderr
    with ServerStore(server.address) as c:
        assert c.get(_key(1)) == bytes([7]) * 65536


def test_an_arena_page_that_is_not_whole_os_pages_falls_back_to_staging(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "4MiB", "page_size": "6000"}])
    with ServerStore(server.address) as c:
        assert c.put(_key(0), _payload(0, 100_000))
        assert c.get(_key(0)) == _payload(0, 100_000).tobytes()
        stats = c.stats()
        assert stats["client"]["direct_writes"] == 0 and stats["server"]["direct_puts"] == 0


def test_a_server_without_direct_writes_gets_staged_writes(tmp_path, monkeypatch):
    """A server of before direct writes (its hello reply has no ``direct_writes``): the client
    writes through the staging area, as it did."""
    from kvtier.server.server import CacheServer, ServeConfig

    monkeypatch.setattr(CacheServer, "hello_reply",
                        lambda self, _orig=CacheServer.hello_reply: {k: v for k, v in _orig(self).items()
                                                                      if k != "direct_writes"})
    config = ServeConfig.from_mapping({"listen": f"unix://{tmp_path}/old.sock", "staging": "8MiB",
                                       "shm_dir": str(tmp_path), "store": {"tiers": ARENA_8M}})
    with CacheServer(config) as server, ServerStore(server.address) as c:
        assert c.put(_key(0), _payload(0, MiB))
        assert c.get(_key(0)) == _payload(0, MiB).tobytes()
        assert c.stats()["client"]["direct_writes"] == 0 and c.stats()["server"]["direct_puts"] == 0


# ----------------------------------------------------------------------------- leases


def test_a_client_killed_between_reserve_and_commit_leaks_nothing(make_server):
    server = make_server(tiers=ARENA_8M, staging="16MiB", client_staging_fraction=0.5)
    script = textwrap.dedent(f"""
        import time
        from kvtier.server import ServerStore
        c = ServerStore({server.address!r})
        def fill(segs):
            for s in segs[: len(segs) // 2]:
                s[:] = 1  # half written
            print("reserved", flush=True)
            time.sleep(600)
        c.write({_key(7)!r}, 4 << 20, fill)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "reserved"
        assert _server_stats(server.address)["server"]["direct_write_bytes_open"] == 4 * MiB
        with ServerStore(server.address) as c:
            assert c.lookup([_key(7)]) == 0 and c.get(_key(7)) is None  # invisible while reserved
    finally:
        proc.kill()
        proc.wait(timeout=10)
    _wait(lambda: _server_stats(server.address)["server"]["direct_write_bytes_open"] == 0, what="pages returned")
    stats = _server_stats(server.address)
    assert stats["server"]["direct_aborted"] == 1 and stats["server"]["put_stored"] == 0
    with ServerStore(server.address) as c:
        assert c.lookup([_key(7)]) == 0 and c.get(_key(7)) is None
    _arena_whole(server.address)


def test_a_commit_after_the_lease_expired_is_refused(make_server):
    server = make_server(tiers=ARENA_8M, lease_timeout_s=0.3)
    s = _raw(server.address)
    try:
        reply = _reserve(s, _key(1), MiB)
        assert reply["status"] == "ok"
        time.sleep(0.6)
        refused = _ask(s, {"op": "commit", "lease": reply["lease"]})
        assert not refused["ok"] and refused["error"] == P.LEASE_EXPIRED, refused
        again = _ask(s, {"op": "commit", "lease": reply["lease"]})  # nothing left to commit
        assert not again["ok"] and again["error"] == P.MALFORMED
        assert _ask(s, {"op": "lookup", "keys": [_key(1)]})["n"] == 0
    finally:
        s.close()
    stats = _server_stats(server.address)
    assert stats["server"]["write_leases_expired"] == 1 and stats["server"]["direct_write_bytes_open"] == 0
    # the client's own rule: a fill that outlasts the lease is aborted, never committed late
    with ServerStore(server.address) as c:
        assert not c.write(_key(2), MiB, lambda segs: time.sleep(0.5))
        assert c.stats()["client"]["lease_expired"] == 1 and c.lookup([_key(2)]) == 0
        assert c.put(_key(3), _payload(3, MiB)) and c.get(_key(3)) == _payload(3, MiB).tobytes()
        assert c.delete(_key(3))
    _arena_whole(server.address)


def test_a_forged_lease_or_another_request_aborts_the_write(make_server):
    """The next request after ``reserve_arena`` ends the write: only this lease's commit
    publishes; any other request aborts it (nothing visible) and is then served as usual."""
    server = make_server(tiers=ARENA_8M)
    a, b = _raw(server.address), _raw(server.address)
    try:
        lease = _reserve(a, _key(1), MiB)["lease"]
        forged = _ask(a, {"op": "commit", "lease": lease + 1})  # not the open lease: no such reservation
        assert not forged["ok"] and forged["error"] == P.MALFORMED
        late = _ask(a, {"op": "commit", "lease": lease})  # the real one is gone with it
        assert not late["ok"] and late["error"] == P.MALFORMED
        _reserve(a, _key(2), MiB)
        other = _ask(a, {"op": "get", "key": _key(2)})  # another request: the write ends, the get is served
        assert other["ok"] and other["tier"] is None
        _reserve(a, _key(3), MiB)
        second = _reserve(a, _key(4), MiB)  # one direct write per connection: the first is aborted
        assert second["status"] == "ok"
        assert _ask(a, {"op": "commit", "lease": second["lease"]}) == {"ok": True, "stored": True}
        lease = _reserve(a, _key(5), MiB)["lease"]
        stolen = _ask(b, {"op": "commit", "lease": lease})  # another connection's lease
        assert not stolen["ok"] and stolen["error"] == P.MALFORMED
        assert _ask(a, {"op": "commit", "lease": lease}) == {"ok": True, "stored": True}  # untouched by b
        P.send(a, {"op": "abort", "lease": _reserve(a, _key(6), MiB)["lease"]})  # abort: no reply
        for k, present in ((1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 0)):
            assert _ask(b, {"op": "lookup", "keys": [_key(k)]})["n"] == present, k
    finally:
        a.close()
        b.close()
    stats = _server_stats(server.address)
    assert stats["server"]["direct_abandoned"] == 3 and stats["server"]["direct_write_bytes_open"] == 0
    assert stats["server"]["direct_aborted"] == 4 and stats["server"]["put_stored"] == 2
    with ServerStore(server.address) as c:
        assert c.delete(_key(4)) and c.delete(_key(5))
    _arena_whole(server.address)


def test_client_rejects_extents_outside_the_arena_or_off_the_os_page():
    page = C.mmap.PAGESIZE
    good = {"lease": 1, "extents": [[0, page], [4 * page, 10]]}
    assert C._extents(good, 8 * page, page + 10) == [(0, page), (4 * page, 10)]
    assert C._extents(good, 8 * page, page + 11) is None  # not the size asked for
    assert C._extents({"lease": 1, "extents": [[7 * page, page + 1]]}, 8 * page, page + 1) is None
    assert C._extents({"lease": 1, "extents": [[-page, page]]}, 8 * page, page) is None
    assert C._extents({"lease": 1, "extents": [[1, page]]}, 8 * page, page) is None
    assert C._extents({"lease": "1", "extents": [[0, page]]}, 8 * page, page) is None
    assert C._extents({"lease": 1, "extents": "x"}, 8 * page, page) is None


def test_open_direct_writes_are_capped_per_client_and_in_all(make_server):
    # staging 8 MiB, a client's share 4 MiB: three clients reserving 3 MiB each
    server = make_server(tiers=[{"type": "ram", "capacity": "32MiB", "page_size": "64KiB"}],
                         staging="8MiB", client_staging_fraction=0.5)
    a, b, c = (_raw(server.address) for _ in range(3))
    try:
        assert _reserve(a, _key(9), 5 * MiB)["status"] == "quota"  # over one client's share
        la = _reserve(a, _key(1), 3 * MiB)["lease"]
        lb = _reserve(b, _key(2), 3 * MiB)["lease"]
        assert _reserve(c, _key(3), 3 * MiB)["status"] == "quota"  # 9 MiB > 8 MiB held in all
        with ServerStore(server.address) as d:  # the arena stays open to everyone else
            assert d.put(_key(4), _payload(4, 2 * MiB))
            assert d.stats()["server"]["direct_write_bytes_open"] == 6 * MiB
        assert _ask(a, {"op": "commit", "lease": la})["stored"]
        lc = _reserve(c, _key(3), 3 * MiB)["lease"]  # room again
        assert _ask(b, {"op": "commit", "lease": lb})["stored"]
        assert _ask(c, {"op": "commit", "lease": lc})["stored"]
    finally:
        for s in (a, b, c):
            s.close()
    stats = _server_stats(server.address)
    assert stats["server"]["put_quota"] == 2 and stats["server"]["direct_write_bytes_open"] == 0


# ----------------------------------------------------------------------------- concurrency


def test_readers_never_see_a_half_written_entry_and_other_keys_are_served_meanwhile(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "32MiB", "page_size": "64KiB"}])
    n = 2 * MiB
    old, new = _payload(1, n), _payload(2, n)
    results: list = []
    stop = threading.Event()
    filling = threading.Event()

    def reader():
        with ServerStore(server.address) as r:
            while not stop.is_set():
                got = r.get(_key(0))
                results.append(got if got is None else (got == old.tobytes(), got == new.tobytes()))
                if filling.is_set():
                    results.append(("other", r.get(_key(9)) == _payload(9, 4096).tobytes()))

    with ServerStore(server.address) as w:
        assert w.put(_key(0), old) and w.put(_key(9), _payload(9, 4096))
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert w.delete(_key(0))

        def slow_fill(segs):  # the new bytes arrive over ~1 s, in 16 steps
            filling.set()
            flat = [(s, off) for s, off in zip(segs, np.cumsum([0] + [s.size for s in segs[:-1]]))]
            steps = np.linspace(0, n, 17, dtype=int)
            for lo, hi in zip(steps[:-1], steps[1:]):
                for s, off in flat:
                    a, b = max(lo, off), min(hi, off + s.size)
                    if a < b:
                        s[a - off : b - off] = new[a:b]
                time.sleep(0.06)

        assert w.write(_key(0), n, slow_fill)
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(timeout=30)
    reads = [r for r in results if not (isinstance(r, tuple) and r and r[0] == "other")]
    others = [r for r in results if isinstance(r, tuple) and r and r[0] == "other"]
    assert all(r is None or r[0] or r[1] for r in reads), "a read saw bytes of neither version"
    assert any(r is None for r in reads) and any(r is not None and r[1] for r in reads)
    assert others and all(ok for _, ok in others), "another key was not served during the slow fill"


def test_a_delete_during_the_fill_wins(make_server):
    """The rule: a delete of the key that arrives between reserve and commit wins. The commit
    answers ``stored: false`` (``write`` returns False), the entry is absent and its pages free."""
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as w, ServerStore(server.address) as d:
        def fill(segs):
            for s in segs:
                s[:] = 3
            assert d.delete(_key(1))  # another engine deletes the key meanwhile

        assert not w.write(_key(1), 4 * MiB, fill)
        assert w.lookup([_key(1)]) == 0 and d.get(_key(1)) is None
        stats = w.stats()
        assert stats["cancelled_writes"] == 1 and stats["server"]["direct_write_bytes_open"] == 0
        assert w.put(_key(1), _payload(1, MiB)) and d.get(_key(1)) == _payload(1, MiB).tobytes()  # re-put
        assert w.delete(_key(1))
    _arena_whole(server.address)


def test_an_open_direct_write_does_not_stall_the_read_lease_reaper(make_server):
    """The connection waiting for its client's commit holds no lock the reaper needs: another
    client's read lease still expires on time."""
    server = make_server(tiers=ARENA_8M, lease_timeout_s=0.3)
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _payload(1, MiB))
    a, b = _raw(server.address), _raw(server.address)
    try:
        assert _reserve(a, _key(2), MiB)["status"] == "ok"  # left open
        assert _ask(b, {"op": "get", "key": _key(1)})["tier"] == "ram"  # a read lease, never released
        _wait(lambda: _server_stats(server.address)["server"]["leases_expired"] >= 1, timeout=10,
              what="the read lease's expiry")
        assert _server_stats(server.address)["server"]["direct_write_bytes_open"] == MiB
    finally:
        a.close()
        b.close()


def test_the_write_comparison_benchmark_reports_every_path_beside_memcpy(tmp_path):
    from kvtier.bench.server import compare_writes

    report = compare_writes([65536], total=MiB, rounds=2, workdir=str(tmp_path), batch=5)
    rows = {(r["path"], r["op"]): r for r in report["results"]}
    assert report["batch"] == 5
    assert set(rows) == {(p, o) for p in ("memcpy", "memcpy-stream", "direct", "direct-batch", "staging") for o in ("put", "get")}
    assert all(r["gb_per_s"] > 0 and r["vs_memcpy_min"] <= r["vs_memcpy"] <= r["vs_memcpy_max"] for r in rows.values())
    assert rows["memcpy", "put"]["vs_memcpy"] == 1.0

"""Hostile review of batched direct writes (``reserve_arena_many``, ``ServerStore.write_many``,
``poll_readable``, the server's fill-rate poll, ``BackgroundSaves`` batching).

Real ``kvtier serve`` processes (``make_server``) and raw protocol frames play a hostile client;
fakes only inject faults (a store whose ``write_many`` misbehaves, a hostile server reply). Tests
that pass document rules that hold; tests marked ``xfail(strict=True, reason="DEFECT: ...")``
are real defects: they fail until the defect is fixed (then the mark must go).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvtier.keys import KEY_BYTES
from kvtier.server import ServerStore
from kvtier.server import client as C
from kvtier.server import protocol as P
from kvtier.store import WriteItem
from tests.server.test_direct_write import _arena_whole, _ask, _key, _payload, _raw, _server_stats, _wait

MiB = 1 << 20
PAGE = 65536
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]
ARENA_16M = [{"type": "ram", "capacity": "16MiB", "page_size": "64KiB", "policy": "lru"}]


def _items(keys, size: int) -> list[dict]:
    return [{"key": _key(k), "nbytes": size, "parent": None, "chunk_index": 0} for k in keys]


def _open_bytes(address: str) -> int:
    return _server_stats(address)["server"]["direct_write_bytes_open"]


def _closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server ended the connection (EOF or reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


# ----------------------------------------------------------------------------- quotas


def test_tiny_items_cannot_hold_more_arena_than_the_global_cap(make_server):
    """The quota counts the arena pages a batch holds, not its bytes: 64 one-byte items hold 64
    pages (4 MiB here), far over one connection's 256 KiB share, and are refused; four of them
    (four pages, the share) are taken and counted as 256 KiB open."""
    # staging 1 MiB: one connection may hold 256 KiB of open direct writes, all of them 1 MiB
    server = make_server(tiers=ARENA_8M, staging="1MiB")
    with ServerStore(server.address) as c:  # control: a 256 KiB write fits this client's share
        assert c.put(_key(501), _payload(501, 256 * 1024)) and c.delete(_key(501))
    a, b = _raw(server.address), _raw(server.address)
    try:
        for s, base in ((a, 0), (b, 100)):
            reply = _ask(s, {"op": "reserve_arena_many", "items": _items(range(base, base + 64), 1)})
            assert reply == {"ok": True, "status": "quota"}, reply
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items(range(4), 1)})
        assert reply["status"] == "ok" and _open_bytes(server.address) == 4 * PAGE
        # open direct writes may hold at most 1 MiB of this 8 MiB arena: 7 MiB must stay writable
        with ServerStore(server.address) as c:
            assert c.put(_key(500), _payload(500, 256 * 1024)), "the open batches hold more arena than the global cap"
            assert c.delete(_key(500))
        assert _ask(a, {"op": "commit", "lease": reply["lease"]}) == {"ok": True, "stored": [True] * 4}
    finally:
        a.close()
        b.close()
    assert _open_bytes(server.address) == 0


def test_the_client_cuts_batches_by_the_pages_its_chunks_hold(make_server):
    """The client counts each chunk in whole pages, as the server does: 64 one-byte chunks go
    in batches of four pages (the 256 KiB share), every one stored, none refused for quota."""
    server = make_server(tiers=ARENA_8M, staging="1MiB")
    with ServerStore(server.address) as c:
        assert c._map.page_size == PAGE and c._map.write_share == 4 * PAGE
        assert c.put_many([(_key(i), bytes([i])) for i in range(64)]) == [True] * 64
        assert c.stats()["server"]["put_quota"] == 0
        assert all(c.get(_key(i)) == bytes([i]) for i in range(64))


def test_a_batch_over_the_share_reserves_nothing_whatever_its_shape(make_server):
    """Huge, uint64-max and summed-over items are ``quota`` (Python ints do not wrap) and hold
    nothing; the connection goes on."""
    server = make_server(tiers=ARENA_8M, staging="4MiB")  # share 1 MiB
    a = _raw(server.address)
    try:
        for items in (_items([1], 2**64 - 1),
                      _items([1, 2], 2**63) ,
                      _items(range(64), 2**58),  # 64 x 2^58 = 2^64: wraps to 0 in a C uint64
                      _items(range(5), 256 * 1024 + 1)):
            reply = _ask(a, {"op": "reserve_arena_many", "items": items})
            assert reply == {"ok": True, "status": "quota"}, reply
        assert _ask(a, {"op": "lookup", "keys": [_key(1)]}) == {"ok": True, "n": 0}
    finally:
        a.close()
    assert _open_bytes(server.address) == 0
    _arena_whole(server.address)


def test_the_global_cap_counts_every_connections_open_batch(make_server):
    server = make_server(tiers=ARENA_16M, staging="2MiB", client_staging_fraction=0.75)  # share 1.5 MiB, cap 2 MiB
    a, b = _raw(server.address), _raw(server.address)
    try:
        first = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2], 512 * 1024)})
        assert first["status"] == "ok"
        assert _ask(b, {"op": "reserve_arena_many", "items": _items([3, 4], 768 * 1024)}) == \
            {"ok": True, "status": "quota"}  # 1 MiB + 1.5 MiB > 2 MiB
        assert _open_bytes(server.address) == MiB
        assert _ask(a, {"op": "commit", "lease": first["lease"]}) == {"ok": True, "stored": [True, True]}
        second = _ask(b, {"op": "reserve_arena_many", "items": _items([3, 4], 768 * 1024)})
        assert second["status"] == "ok"
        assert _ask(b, {"op": "commit", "lease": second["lease"]}) == {"ok": True, "stored": [True, True]}
    finally:
        a.close()
        b.close()
    assert _open_bytes(server.address) == 0


def test_a_key_repeated_64_times_is_written_once(make_server):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([7] * 64, PAGE)})
        assert [i["status"] for i in reply["items"]] == ["ok"] + ["full"] * 63
        done = _ask(a, {"op": "commit", "lease": reply["lease"]})
        assert done == {"ok": True, "stored": [True] + [False] * 63}
    finally:
        a.close()
    assert _open_bytes(server.address) == 0
    with ServerStore(server.address) as c:
        assert c.lookup([_key(7)]) == 1 and c.delete(_key(7))
    _arena_whole(server.address)


# ----------------------------------------------------------------------------- nesting, shapes


def test_64_nested_items_and_zero_byte_items_round_trip(make_server):
    """64 nested ``store.write`` levels fit the server thread's stack; zero-byte items reserve
    no page and are stored empty; ``stored`` is one bool per item."""
    server = make_server(tiers=ARENA_8M)
    sizes = [PAGE if i % 2 else 0 for i in range(64)]  # 32 x 64 KiB = 2 MiB, within the 8 MiB share
    with ServerStore(server.address) as c:
        stored = c.put_many([(_key(i), _payload(i, n)) for i, n in enumerate(sizes)])
        assert stored == [True] * 64 and all(type(v) is bool for v in stored)
        assert c.stats()["client"]["direct_writes"] == 64
        for i, n in enumerate(sizes):
            assert c.get(_key(i)) == _payload(i, n).tobytes(), i
        assert c.stats()["server"]["direct_write_bytes_open"] == 0
        for i in range(64):
            assert c.delete(_key(i))
    _arena_whole(server.address)


def test_a_batch_that_must_evict_as_it_goes_keeps_its_own_items_and_answers_each(make_server):
    """A full 2 MiB arena: each nested item evicts an older entry, never one of its own batch's
    reserved items; the item that no longer fits is ``full``; ``stored`` matches, per item,
    exists/ok/full/deleted-meanwhile/zero-byte."""
    server = make_server(tiers=[{"type": "ram", "capacity": "2MiB", "page_size": "64KiB", "policy": "lru"}])
    with ServerStore(server.address) as c:
        assert c.put_many([(_key(900 + i), _payload(900 + i, PAGE)) for i in range(32)]) == [True] * 32
    a = _raw(server.address)
    try:
        items = _items([900], PAGE) + _items(range(1, 31), PAGE) + _items([31], 3 * PAGE) + _items([40], 0) \
            + _items([5], PAGE)
        reply = _ask(a, {"op": "reserve_arena_many", "items": items})
        statuses = [i["status"] for i in reply["items"]]
        assert statuses == ["exists"] + ["ok"] * 30 + ["full", "ok", "full"], statuses
        with ServerStore(server.address) as d:
            d.delete(_key(7))  # deleted while its batch is open: that item only is not stored
        done = _ask(a, {"op": "commit", "lease": reply["lease"]})
        assert done["stored"] == [True] + [k != 7 for k in range(1, 31)] + [False, True, False], done
        present = _ask(a, {"op": "lookup", "keys": [_key(k) for k in range(1, 7)]})
        assert present["n"] == 6
        assert _ask(a, {"op": "lookup", "keys": [_key(7)]})["n"] == 0
    finally:
        a.close()
    assert _open_bytes(server.address) == 0
    with ServerStore(server.address) as c:
        for k in [900, 40] + list(range(1, 31)):
            c.delete(_key(k))
        assert c.put_many([(_key(800 + i), _payload(800 + i, PAGE)) for i in range(32)]) == [True] * 32
        assert c.stats()["evictions"] >= 30


@pytest.mark.parametrize("item", [
    {"key": [1, 2], "nbytes": 1, "parent": None, "chunk_index": 0},
    {"key": b"k" * KEY_BYTES, "nbytes": 1.5, "parent": None, "chunk_index": 0},
    {"key": b"k" * KEY_BYTES, "nbytes": 1, "parent": 7, "chunk_index": 0},
    {"key": b"k" * KEY_BYTES, "nbytes": 1, "parent": None, "chunk_index": -1},
    {"key": b"k" * KEY_BYTES, "nbytes": 1, "parent": None, "chunk_index": False},
    {"key": b"k" * KEY_BYTES, "nbytes": None, "parent": None, "chunk_index": 0},
    {"key": b"k" * KEY_BYTES, "nbytes": {"n": 1}, "parent": None, "chunk_index": 0},
    {b"key": b"k" * KEY_BYTES, b"nbytes": 1, b"parent": None, b"chunk_index": 0},
    [[["deep"]]],
    None,
])
def test_junk_items_are_malformed_and_the_connection_goes_on(make_server, item):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        good = _items([1], 1)[0]
        reply = _ask(a, {"op": "reserve_arena_many", "items": [good, item]})
        assert not reply["ok"] and reply["error"] == P.MALFORMED and "items[1]" in reply["message"], reply
        assert _ask(a, {"op": "lookup", "keys": [_key(1)]}) == {"ok": True, "n": 0}
    finally:
        a.close()
    assert _open_bytes(server.address) == 0


def test_a_huge_chunk_index_and_extra_fields_are_served(make_server):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        items = [{**_items([1], 10)[0], "chunk_index": 2**64 - 1, "junk": [1, {"x": b"y"}]},
                 {**_items([2], 10)[0], "parent": _key(1), "chunk_index": 2**63}]
        reply = _ask(a, {"op": "reserve_arena_many", "items": items})
        assert reply["ok"] and [i["status"] for i in reply["items"]] == ["ok", "ok"], reply
        assert _ask(a, {"op": "commit", "lease": reply["lease"]}) == {"ok": True, "stored": [True, True]}
        assert _ask(a, {"op": "lookup", "keys": [_key(1), _key(2)]}) == {"ok": True, "n": 2}
        assert _ask(a, {"op": "delete", "key": _key(1)})["ok"] and _ask(a, {"op": "delete", "key": _key(2)})["ok"]
    finally:
        a.close()
    assert _open_bytes(server.address) == 0


# ----------------------------------------------------------------------------- ending a batch


def test_whatever_ends_an_open_batch_publishes_nothing_and_frees_every_page(make_server):
    """Another batch, an abort of another lease, an unknown op, a second commit: each ends the
    open batch (nothing published) and is then served as usual."""
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        first = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2], MiB)})
        second = _ask(a, {"op": "reserve_arena_many", "items": _items([3, 1], MiB)})  # ends the first
        assert [i["status"] for i in second["items"]] == ["ok", "ok"], second  # key 1 free again
        assert second["lease"] != first["lease"]
        assert _ask(a, {"op": "commit", "lease": first["lease"]})["error"] == P.MALFORMED  # ends the second too
        P.send(a, {"op": "release", "lease": 12345})  # no reply
        third = _ask(a, {"op": "reserve_arena_many", "items": _items([4], MiB)})
        P.send(a, {"op": "abort", "lease": third["lease"] + 1})  # another lease's abort: ends it, no reply
        fourth = _ask(a, {"op": "reserve_arena_many", "items": _items([5], MiB)})
        bad = _ask(a, {"op": "no_such_op"})  # malformed: ends it, answered
        assert not bad["ok"] and bad["error"] == P.MALFORMED
        fifth = _ask(a, {"op": "reserve_arena_many", "items": _items([6], MiB)})
        assert _ask(a, {"op": "commit", "lease": fifth["lease"]}) == {"ok": True, "stored": [True]}
        again = _ask(a, {"op": "commit", "lease": fifth["lease"]})  # twice: no such reservation
        assert not again["ok"] and again["error"] == P.MALFORMED
        assert _ask(a, {"op": "lookup", "keys": [_key(6)]})["n"] == 1
        for k in (1, 2, 3, 4, 5):
            assert _ask(a, {"op": "lookup", "keys": [_key(k)]})["n"] == 0, k
        assert _ask(a, {"op": "delete", "key": _key(6)})["ok"]
    finally:
        a.close()
    stats = _server_stats(server.address)["server"]
    assert stats["direct_write_bytes_open"] == 0 and stats["direct_abandoned"] >= 3
    _arena_whole(server.address)


def test_a_garbage_frame_inside_a_batch_hangs_up_and_frees_the_pages(make_server):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2], MiB)})
        assert reply["status"] == "ok"
        a.sendall(P._LEN.pack(3) + b"\xc1\xc1\xc1")  # not msgpack
        err = P.recv(a)
        assert err is not None and err["error"] == P.MALFORMED
        assert _closed(a)
    finally:
        a.close()
    _wait(lambda: _open_bytes(server.address) == 0, timeout=5, what="pages returned")
    with ServerStore(server.address) as c:
        assert c.lookup([_key(1)]) == 0 and c.lookup([_key(2)]) == 0
    _arena_whole(server.address)


def test_a_half_closed_peer_inside_a_batch_frees_every_page(make_server):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2, 3], MiB)})
        assert reply["status"] == "ok" and _open_bytes(server.address) == 3 * MiB
        a.shutdown(socket.SHUT_WR)  # the commit never comes; the peer still reads
        assert _closed(a)  # the server's thread did not wait forever
    finally:
        a.close()
    _wait(lambda: _open_bytes(server.address) == 0, timeout=5, what="pages returned")
    with ServerStore(server.address) as c:
        assert c.lookup([_key(1)]) == 0
    _arena_whole(server.address)


def test_a_batch_deleted_key_by_key_during_its_fill_publishes_none(make_server):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2, 3], MiB)})
        with ServerStore(server.address) as d:
            for k in (1, 2, 3):
                d.delete(_key(k))
        assert _ask(a, {"op": "commit", "lease": reply["lease"]}) == {"ok": True, "stored": [False, False, False]}
        assert _ask(a, {"op": "lookup", "keys": [_key(1)]})["n"] == 0
    finally:
        a.close()
    assert _open_bytes(server.address) == 0
    _arena_whole(server.address)


# ----------------------------------------------------------------------------- the commit poll


def test_a_slow_small_fill_does_not_cost_the_next_write_its_connection(make_server):
    server = make_server(tiers=ARENA_16M)  # staging 32 MiB: share 8 MiB
    a = _raw(server.address)
    try:
        one = _ask(a, {"op": "reserve_arena_many", "items": _items([1], 1)})
        time.sleep(0.5)  # a 1-byte fill that took 0.5 s (a GC pause): ~2 B/s
        assert _ask(a, {"op": "commit", "lease": one["lease"]}) == {"ok": True, "stored": [True]}
        P.send(a, {"op": "reserve_arena_many", "items": _items(range(10, 18), MiB)})  # 8 MiB: "4e6 s" ahead
        reply = P.recv(a)
        assert reply is not None and reply["status"] == "ok", reply
        assert _ask(a, {"op": "commit", "lease": reply["lease"]})["stored"] == [True] * 8
    finally:
        a.close()


def test_strange_fill_rates_never_stall_the_commit(make_server):
    """A very fast fill then a tiny one, and polling at the operator's maximum: each commit is
    answered promptly (the server's wait ends when the request arrives)."""
    server = make_server(tiers=ARENA_8M, commit_poll_s=0.1)
    a = _raw(server.address)
    try:
        for size, pause in ((4 * MiB, 0.0), (1, 0.0), (4 * MiB, 0.05), (0, 0.0), (PAGE, 0.0)):
            reply = _ask(a, {"op": "reserve_arena_many", "items": _items([size % 251 + 1], size)})
            time.sleep(pause)
            t0 = time.monotonic()
            done = _ask(a, {"op": "commit", "lease": reply["lease"]})
            assert done == {"ok": True, "stored": [True]} and time.monotonic() - t0 < 1.0, (size, done)
            assert _ask(a, {"op": "delete", "key": _key(size % 251 + 1)})["ok"]
    finally:
        a.close()
    assert _open_bytes(server.address) == 0


def test_a_server_stopped_while_it_waits_out_a_slow_clients_fill_exits_promptly(make_server):
    """After a slow small fill the server sleeps through the next write's "expected" fill in a
    poll (here ~5e5 s); closing the server must still wake it, free the pages and exit."""
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        one = _ask(a, {"op": "reserve_arena_many", "items": _items([1], 1)})
        time.sleep(0.5)
        assert _ask(a, {"op": "commit", "lease": one["lease"]})["stored"] == [True]
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([2], MiB)})
        assert reply["status"] == "ok"
        t0 = time.monotonic()
        server.proc.terminate()
        assert server.proc.wait(timeout=8) == 0 and time.monotonic() - t0 < 8
        assert "Traceback" not in server.output(), server.output()[-2000:]
        assert _closed(a, 2.0)
    finally:
        a.close()


class _FakeSock:
    """A socket stand-in whose ``recv`` raises ``error`` (a fault poll_readable must survive)."""

    def __init__(self, error: BaseException, timeout):
        self.timeout, self.error, self.recvs = timeout, error, 0

    def gettimeout(self):
        return self.timeout

    def settimeout(self, value):
        self.timeout = value

    def recv(self, n, flags=0):
        self.recvs += 1
        raise self.error


@pytest.mark.parametrize("timeout", [None, 0.0, 3.5])
def test_poll_readable_restores_the_timeout_on_every_path(timeout):
    a, b = socket.socketpair()
    try:
        a.settimeout(timeout)
        assert not P.poll_readable(a, 0.005) and a.gettimeout() == timeout  # time ran out
        assert not P.poll_readable(a, 0) and a.gettimeout() == timeout  # nothing to do
        assert not P.poll_readable(a, -1) and a.gettimeout() == timeout
        b.sendall(b"x")
        assert P.poll_readable(a, 1.0) and a.gettimeout() == timeout  # data
        assert a.recv(1) == b"x"  # peeked, not taken
        b.close()
        assert P.poll_readable(a, 1.0) and a.gettimeout() == timeout  # the stream's end
    finally:
        a.close()
    for error in (ConnectionResetError("reset"), OSError(9, "bad fd"), KeyboardInterrupt()):
        fake = _FakeSock(error, timeout)
        with pytest.raises(type(error)):
            P.poll_readable(fake, 1.0)
        assert fake.timeout == timeout and fake.recvs == 1


# ----------------------------------------------------------------------------- the client


def test_client_refuses_hostile_batch_replies_without_crashing():
    page = C.mmap.PAGESIZE
    size = 16 * page
    base = {"ok": True, "status": "ok", "lease": 3}
    sizes = [page, page]
    hostile = [
        [{"status": "ok", "extents": [[0, page]]}, {"status": "ok", "extents": [[0, page]]}],  # same pages twice
        [{"status": "ok", "extents": [[0, page // 2], [0, page // 2]]}, {"status": "ok", "extents": [[page, page]]}],
        [{"status": "ok", "extents": [[size, page]]}, {"status": "ok", "extents": [[0, page]]}],  # outside
        [{"status": "ok", "extents": [[-page, page]]}, {"status": "ok", "extents": [[0, page]]}],
        [{"status": "ok", "extents": [[1, page]]}, {"status": "ok", "extents": [[page * 2, page]]}],  # unaligned
        [{"status": "ok", "extents": [[0, 2**64]]}, {"status": "ok", "extents": [[0, page]]}],
        [{"status": "ok", "extents": "xy"}, {"status": "ok", "extents": [[0, page]]}],
        [{"status": "ok", "extents": [[None, page]]}, {"status": "ok", "extents": [[0, page]]}],
        [{"status": "ok", "extents": [[0, page, 1]]}, {"status": "ok", "extents": [[page, page]]}],
        [{"status": "ok", "extents": None}, {"status": "ok", "extents": [[page, page]]}],
        [{"status": "ok"}, {"status": "ok", "extents": [[page, page]]}],
        [{"status": b"ok", "extents": [[0, page]]}, {"status": "ok", "extents": [[page, page]]}],
        [{"status": ["ok"]}, {"status": "full"}],
        [{"status": "ok", "extents": [[0, page]]}],  # one answer short
        [{"status": "ok", "extents": [[0, page]]}, {"status": "ok", "extents": [[page, page]]}, {"status": "full"}],
    ]
    for items in hostile:
        assert C._batch_plan({**base, "items": items}, size, sizes) is None, items
    good = [{"status": "ok", "extents": [[0, page]]}, {"status": "ok", "extents": [[page, page]]}]
    for reply in ({**base, "items": good, "lease": "3"}, {**base, "items": good, "status": "quota"},
                  {**base, "items": {"0": good[0]}}, {**base, "items": None}, {"ok": True}):
        assert C._batch_plan(reply, size, sizes) is None, reply
    assert C._batch_plan({**base, "items": good}, size, sizes) == (["ok", "ok"], [[(0, page)], [(page, page)]])


@pytest.mark.parametrize("stored", [[1, 1], [True], [True, True, True], "tt", None, {"0": True}, [None, True]])
def test_client_trusts_no_malformed_commit_answer(make_server, monkeypatch, stored):
    """A commit answer whose ``stored`` is not one bool per item: every item counts as not
    stored, nothing raises."""
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        real = c._call

        def tamper(message, deadline, reply=True):
            answer = real(message, deadline, reply)
            if message.get("op") == "commit" and answer is not None:
                answer = {**answer, "stored": stored}
            return answer

        monkeypatch.setattr(c, "_call", tamper)
        before = c.stats()["client"]["write_failures"]
        assert c.put_many([(_key(1), _payload(1, PAGE)), (_key(2), _payload(2, PAGE))]) == [False, False]
        assert c.stats()["client"]["write_failures"] - before == 2
        monkeypatch.undo()
        assert c.stats()["server"]["direct_write_bytes_open"] == 0


def test_a_hostile_reserve_reply_is_aborted_and_nothing_is_filled(make_server, monkeypatch):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        real = c._call
        filled = []

        def tamper(message, deadline, reply=True):
            answer = real(message, deadline, reply)
            if message.get("op") == "reserve_arena_many" and answer is not None and "items" in answer:
                items = answer["items"]
                items[1] = {**items[1], "extents": items[0]["extents"]}  # the second item on the first's pages
            return answer

        monkeypatch.setattr(c, "_call", tamper)
        items = [WriteItem(_key(i), PAGE, lambda segs, i=i: filled.append(i)) for i in range(3)]
        assert c.write_many(items) == [False] * 3
        assert filled == []
        monkeypatch.undo()
        assert c.lookup([_key(0)]) == 0 and c.stats()["server"]["direct_write_bytes_open"] == 0
    _arena_whole(server.address)


def test_an_oserror_from_a_fill_propagates_as_from_write(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        def broken(segments):
            raise FileNotFoundError("the caller's source went away")

        with pytest.raises(FileNotFoundError):  # a single write lets it through
            c.write(_key(1), PAGE, broken)
        with pytest.raises(FileNotFoundError):
            c.write_many([WriteItem(_key(2), PAGE, lambda s: s[0].fill(2)), WriteItem(_key(3), PAGE, broken)])


def test_a_fill_raising_in_a_batch_frees_the_pages_and_the_client_goes_on(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        def broken(segments):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            c.write_many([WriteItem(_key(2), PAGE, lambda s: s[0].fill(2)), WriteItem(_key(3), PAGE, broken)])
        assert c.lookup([_key(2)]) == 0
        assert c.stats()["server"]["direct_write_bytes_open"] == 0
        assert c.put_many([(_key(4), _payload(4, PAGE)), (_key(5), _payload(5, PAGE))]) == [True, True]
        assert c.delete(_key(4)) and c.delete(_key(5))
    _arena_whole(server.address)


def test_concurrent_write_many_callers_on_one_client_never_mix_their_batches(make_server):
    server = make_server(tiers=ARENA_16M)
    with ServerStore(server.address) as c:
        results: dict[int, list] = {}

        def writer(t: int):
            results[t] = c.put_many([(_key(100 * t + i), _payload(100 * t + i, PAGE)) for i in range(8)])

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert results == {t: [True] * 8 for t in range(1, 5)}
        for t in range(1, 5):
            for i in range(8):
                assert c.get(_key(100 * t + i)) == _payload(100 * t + i, PAGE).tobytes()
        assert c.stats()["server"]["direct_write_bytes_open"] == 0


# ----------------------------------------------------------------------------- BackgroundSaves


class _FaultyStore:
    """A non-memcpy store whose ``write_many`` answers ``answer(items)`` (or raises it)."""

    memcpy_writes = False

    def __init__(self, answer):
        self.answer = answer
        self.batches: list[int] = []

    def write_many(self, items):
        self.batches.append(len(items))
        for item in items:  # a store copies what it is given
            item.fill([np.empty(item.nbytes, dtype=np.uint8)])
        result = self.answer(items)
        if isinstance(result, BaseException):
            raise result
        return result


def _saves(store, n: int, slots: int = 8):
    from kvtier.integrations.vllm.worker import BackgroundSaves, _SaveJob

    saves = BackgroundSaves(store, chunk_bytes=64, slots=slots)
    taken = [saves.take() for _ in range(n)]
    saves.submit([_SaveJob(key=_key(i), parent=None, chunk_index=i, slot=s) for i, s in enumerate(taken)])
    return saves


@pytest.mark.parametrize("answer, saved", [
    (lambda items: [i.chunk_index % 2 == 0 for i in items], 3),
    (lambda items: RuntimeError("store fault"), 0),
    (lambda items: None, 0),  # not a list at all: a counted drop of the batch
    (lambda items: [True] * (len(items) + 3), 0),  # not one answer per chunk: a broken store, the batch dropped
])
def test_background_saves_count_every_job_and_free_every_slot(answer, saved):
    saves = _saves(_FaultyStore(answer), 6)
    try:
        assert saves.drain(5)
        out = saves.take_outcomes()
        assert out["saved"] == saved and out["saved"] + out["dropped"] == 6, out
        assert out["saved_bytes"] == 64 * saved
        assert sorted(saves.take() for _ in range(8)) == list(range(8))  # every slot back
    finally:
        saves.close(5)


def test_background_saves_survive_a_store_answering_too_few_results():
    saves = _saves(_FaultyStore(lambda items: [True] * (len(items) - 1)), 4)
    try:
        assert saves.drain(3), "the writer stopped: jobs stuck in flight"
        out = saves.take_outcomes()
        assert out["saved"] + out["dropped"] == 4
        assert len([s for s in (saves.take() for _ in range(8)) if s is not None]) == 8
    finally:
        saves.close(1)

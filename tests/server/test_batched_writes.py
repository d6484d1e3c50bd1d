"""Batched direct writes (issue 25, item 3): ``reserve_arena_many`` -> fill every item -> commit.

Real ``kvtier serve`` processes (``make_server``) and real clients: the ``ServerStore``'s
``write_many``/``put_many``, or raw protocol frames where a test plays a client that
misbehaves. The rules under test are the ones ``kvtier.server.protocol`` states for a batch: two
round trips for the whole batch; each item answered ``ok``/``exists``/``full``; the commit
answers ``stored`` per item; an abort, a late commit, any other request or the connection's end
frees every page of the batch and publishes nothing; a batch over the client's write share is
``quota``; a delete during the fill wins for its key only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvtier.config import ConfigError
from kvtier.keys import KEY_BYTES
from kvtier.server import ServerStore
from kvtier.server import client as C
from kvtier.server import protocol as P
from kvtier.store import WriteItem
from tests.server.test_direct_write import REPO, _arena_whole, _ask, _key, _payload, _raw, _server_stats, _wait

MiB = 1 << 20
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]


def _items(keys: list[int], size: int) -> list[dict]:
    return [{"key": _key(k), "nbytes": size, "parent": None, "chunk_index": 0} for k in keys]


def _fill_with(value: int):
    def fill(segments):
        for s in segments:
            s[:] = value
    return fill


def test_a_batch_round_trip_is_bit_exact_and_costs_two_requests(make_server):
    server = make_server(tiers=ARENA_8M)
    sizes = [MiB, 3 * 65536 + 17, 0, 2 * MiB - 5]
    with ServerStore(server.address) as c, ServerStore(server.address) as reader:
        assert c._map.batch_items == P.MAX_BATCH_ITEMS and c._map.write_share == 8 * MiB  # 32 MiB x 0.25
        before = c.stats()["client"]["requests"]
        stored = c.put_many([(_key(i), _payload(i, n)) for i, n in enumerate(sizes)])
        assert stored == [True] * len(sizes)
        client = c.stats()["client"]
        assert client["requests"] - before == 3  # reserve_arena_many, commit (and this stats call)
        assert client["direct_writes"] == len(sizes) and client["write_failures"] == 0
        for i, n in enumerate(sizes):
            assert reader.get(_key(i)) == _payload(i, n).tobytes(), i
        server_stats = c.stats()["server"]
        assert server_stats["direct_puts"] == len(sizes) and server_stats["put_stored"] == len(sizes)
        assert server_stats["direct_batches"] == 1
        assert server_stats["direct_write_bytes_open"] == 0
        for i in range(len(sizes)):
            assert c.delete(_key(i))
    _arena_whole(server.address)


def test_items_held_already_refused_or_repeated_get_their_own_outcome(make_server):
    """``exists`` is stored (True, not written again), an item larger than the arena is
    refused (False) while the others are stored, and a key twice in one batch is written once."""
    server = make_server(tiers=ARENA_8M, staging="64MiB")
    with ServerStore(server.address) as c:
        assert c.put(_key(1), _payload(1, MiB))
        calls: list[int] = []

        def fill(i: int, value: int):
            def run(segments):
                calls.append(i)
                _fill_with(value)(segments)
            return run

        items = [WriteItem(_key(1), MiB, fill(0, 9)),  # held already: not filled
                 WriteItem(_key(2), MiB, fill(1, 2)),
                 WriteItem(_key(3), 9 * MiB, fill(2, 3)),  # larger than the arena
                 WriteItem(_key(2), MiB, fill(3, 4)),  # the same key again
                 WriteItem(_key(4), 65536, fill(4, 5))]
        assert c.write_many(items) == [True, True, False, False, True]
        assert calls == [1, 4]
        assert c.get(_key(1)) == _payload(1, MiB).tobytes()
        assert c.get(_key(2)) == bytes([2]) * MiB and c.get(_key(4)) == bytes([5]) * 65536
        assert c.lookup([_key(3)]) == 0
        assert c.stats()["server"]["direct_write_bytes_open"] == 0
        for k in (1, 2, 4):
            assert c.delete(_key(k))
    _arena_whole(server.address)


def test_a_batch_larger_than_the_write_share_goes_in_several(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "32MiB", "page_size": "64KiB"}], staging="8MiB")
    with ServerStore(server.address) as c:
        assert c._map.write_share == 2 * MiB
        before = c.stats()["client"]["requests"]
        assert c.put_many([(_key(i), _payload(i, MiB)) for i in range(5)]) == [True] * 5  # 2 + 2 + 1
        assert c.stats()["client"]["requests"] - before == 2 + 2 + 2 + 1  # the last item: one write
        assert all(c.get(_key(i)) == _payload(i, MiB).tobytes() for i in range(5))
        # an item over the share on its own: the server refuses it, the others are stored
        assert c.put_many([(_key(10), _payload(10, 3 * MiB)), (_key(11), _payload(11, MiB))]) == [False, True]
        assert c.stats()["server"]["put_quota"] >= 1


def test_a_fill_that_raises_stores_nothing_of_its_batch_and_leaks_nothing(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        def boom(segments):
            raise RuntimeError("injected fill failure")

        items = [WriteItem(_key(1), MiB, _fill_with(1)), WriteItem(_key(2), MiB, boom),
                 WriteItem(_key(3), MiB, _fill_with(3))]
        with pytest.raises(RuntimeError, match="injected"):
            c.write_many(items)
        assert c.lookup([_key(1)]) == 0 and c.lookup([_key(3)]) == 0
        assert c.stats()["server"]["direct_write_bytes_open"] == 0
        assert c.put(_key(4), _payload(4, MiB)) and c.get(_key(4)) == _payload(4, MiB).tobytes()  # the connection goes on
        assert c.delete(_key(4))
    _arena_whole(server.address)


def test_a_delete_during_a_batch_fill_wins_for_its_key_only(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as w, ServerStore(server.address) as d:
        def fill_and_delete(segments):
            _fill_with(2)(segments)
            assert d.delete(_key(2))  # another engine deletes this key meanwhile

        items = [WriteItem(_key(1), MiB, _fill_with(1)), WriteItem(_key(2), MiB, fill_and_delete),
                 WriteItem(_key(3), MiB, _fill_with(3))]
        assert w.write_many(items) == [True, False, True]
        assert d.lookup([_key(2)]) == 0 and d.get(_key(1)) == bytes([1]) * MiB and d.get(_key(3)) == bytes([3]) * MiB
        assert w.stats()["cancelled_writes"] == 1
        assert w.delete(_key(1)) and w.delete(_key(3))
    _arena_whole(server.address)


def test_the_next_request_after_a_batch_reserve_ends_it_and_is_served(make_server):
    """Raw frames: the batch's commit publishes every reserved item; an abort, another request
    or a commit past the lease frees every page and publishes nothing."""
    server = make_server(tiers=ARENA_8M, lease_timeout_s=0.3)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2], MiB)})
        assert reply["status"] == "ok" and [i["status"] for i in reply["items"]] == ["ok", "ok"]
        assert _ask(a, {"op": "commit", "lease": reply["lease"]}) == {"ok": True, "stored": [True, True]}
        _ask(a, {"op": "reserve_arena_many", "items": _items([3, 4], MiB)})
        other = _ask(a, {"op": "lookup", "keys": [_key(1), _key(2), _key(3)]})  # ends the batch, served
        assert other == {"ok": True, "n": 2}
        lease = _ask(a, {"op": "reserve_arena_many", "items": _items([5, 6], MiB)})["lease"]
        P.send(a, {"op": "abort", "lease": lease})  # no reply
        late = _ask(a, {"op": "reserve_arena_many", "items": _items([7, 1], MiB)})
        assert [i["status"] for i in late["items"]] == ["ok", "exists"]
        time.sleep(0.6)
        refused = _ask(a, {"op": "commit", "lease": late["lease"]})
        assert not refused["ok"] and refused["error"] == P.LEASE_EXPIRED
        nothing = _ask(a, {"op": "reserve_arena_many", "items": _items([1, 2], MiB)})  # all held: no lease
        assert nothing == {"ok": True, "status": "ok", "items": [{"status": "exists"}, {"status": "exists"}]}
        for k, present in ((3, 0), (4, 0), (5, 0), (6, 0), (7, 0)):
            assert _ask(a, {"op": "lookup", "keys": [_key(k)]})["n"] == present, k
    finally:
        a.close()
    stats = _server_stats(server.address)["server"]
    assert stats["direct_write_bytes_open"] == 0 and stats["write_leases_expired"] == 1
    with ServerStore(server.address) as c:
        assert c.delete(_key(1)) and c.delete(_key(2))
    _arena_whole(server.address)


def test_a_client_killed_inside_a_batch_fill_leaks_nothing(make_server):
    server = make_server(tiers=ARENA_8M, staging="16MiB", client_staging_fraction=0.5)
    script = textwrap.dedent(f"""
        import time
        from kvtier.server import ServerStore
        from kvtier.store import WriteItem
        c = ServerStore({server.address!r})
        def hang(segs):
            print("filling", flush=True)
            time.sleep(600)
        c.write_many([WriteItem({_key(7)!r}, 1 << 20, lambda segs: None), WriteItem({_key(8)!r}, 2 << 20, hang)])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "filling"
        assert _server_stats(server.address)["server"]["direct_write_bytes_open"] == 3 * MiB
        with ServerStore(server.address) as c:
            assert c.lookup([_key(7)]) == 0 and c.lookup([_key(8)]) == 0  # invisible while reserved
    finally:
        proc.kill()
        proc.wait(timeout=10)
    _wait(lambda: _server_stats(server.address)["server"]["direct_write_bytes_open"] == 0, what="pages returned")
    with ServerStore(server.address) as c:
        assert c.lookup([_key(7)]) == 0 and c.lookup([_key(8)]) == 0
    _arena_whole(server.address)


@pytest.mark.parametrize("items, message", [
    ([], "1 to 64"),
    (_items(range(P.MAX_BATCH_ITEMS + 1), 1), "1 to 64"),
    (["not a map"], "items[0] must be a map"),
    ([{"key": b"short", "nbytes": 1, "parent": None, "chunk_index": 0}], f"{KEY_BYTES}-byte chunk key"),
    ([{"key": b"k" * KEY_BYTES, "nbytes": -1, "parent": None, "chunk_index": 0}], "nbytes must not be negative"),
    ([{"key": b"k" * KEY_BYTES, "nbytes": 1, "parent": None}], "field 'chunk_index'"),
    ([{"key": b"k" * KEY_BYTES, "nbytes": True, "parent": None, "chunk_index": 0}], "field 'nbytes'"),
    ([{"key": b"k" * KEY_BYTES, "nbytes": 1, "parent": b"p", "chunk_index": 0}], "field 'parent'"),
])
def test_a_malformed_batch_is_refused_in_one_line_and_the_connection_goes_on(make_server, items, message):
    server = make_server(tiers=ARENA_8M)
    a = _raw(server.address)
    try:
        reply = _ask(a, {"op": "reserve_arena_many", "items": items})
        assert not reply["ok"] and reply["error"] == P.MALFORMED and message in reply["message"], reply
        assert _ask(a, {"op": "lookup", "keys": [_key(1)]}) == {"ok": True, "n": 0}
    finally:
        a.close()
    assert _server_stats(server.address)["server"]["direct_write_bytes_open"] == 0


def test_client_checks_a_batch_reply_before_writing_a_byte():
    page = C.mmap.PAGESIZE
    size = 16 * page
    ok = {"ok": True, "status": "ok", "lease": 3,
          "items": [{"status": "ok", "extents": [[0, page]]}, {"status": "exists"}, {"status": "full"},
                    {"status": "ok", "extents": [[2 * page, 10]]}]}
    statuses, extents = C._batch_plan(ok, size, [page, 7, 7, 10])
    assert statuses == ["ok", "exists", "full", "ok"] and extents == [[(0, page)], None, None, [(2 * page, 10)]]
    overlap = {**ok, "items": [{"status": "ok", "extents": [[0, 2 * page]]}, {"status": "ok", "extents": [[page, page]]}]}
    assert C._batch_plan(overlap, size, [2 * page, page]) is None  # one item's pages inside another's
    assert C._batch_plan({**ok, "lease": None}, size, [page, 7, 7, 10]) is None  # pages without a lease
    assert C._batch_plan(ok, size, [page, 7, 7]) is None  # not one answer per item
    assert C._batch_plan(ok, size, [page, 7, 7, 11]) is None  # not the size asked for
    assert C._batch_plan({**ok, "items": [{"status": "maybe"}]}, size, [1]) is None
    assert C._batch_plan({**ok, "items": ["x"]}, size, [1]) is None
    assert C._batch_plan({"ok": True, "status": "ok", "items": [{"status": "full"}]}, size, [1]) == (["full"], [None])
    assert C._batch_plan(None, size, [1]) is None
    # a hello's limits: a server that names none (or nonsense) gets no batches
    assert C._batch_limits({"batch_writes": 16, "write_share": 4096, "page_size": 512}) == (16, 4096, 512)
    assert C._batch_limits({"batch_writes": 10**6, "write_share": 4096, "page_size": 1}) == (P.MAX_BATCH_ITEMS, 4096, 1)
    for hello in ({}, {"batch_writes": True, "write_share": 1, "page_size": 1},
                  {"batch_writes": 8, "write_share": 0, "page_size": 1},
                  {"batch_writes": "8", "write_share": 1, "page_size": 1},
                  {"batch_writes": 1, "write_share": 1, "page_size": 1},
                  {"batch_writes": 8, "write_share": 1, "page_size": 0},
                  {"batch_writes": 8, "write_share": 1}):
        assert C._batch_limits(hello) == (1, 0, 1), hello


def test_a_client_of_a_server_without_batches_writes_one_at_a_time(make_server):
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address) as c:
        c._map.batch_items, c._map.write_share = 1, 0  # as a server before batches answers its hello
        before = c.stats()["client"]["requests"]
        assert c.put_many([(_key(i), _payload(i, MiB)) for i in range(3)]) == [True] * 3
        assert c.stats()["client"]["requests"] - before == 3 * 2 + 1
        assert all(c.get(_key(i)) == _payload(i, MiB).tobytes() for i in range(3))
    with ServerStore(server.address, direct_writes=False) as staged:  # no direct writes: staged, one at a time
        assert staged.put_many([(_key(10 + i), _payload(10 + i, MiB)) for i in range(2)]) == [True, True]
        assert staged.stats()["client"]["direct_writes"] == 0
        assert staged.get(_key(11)) == _payload(11, MiB).tobytes()


def test_the_poll_settings_are_checked_at_the_edge():
    from kvtier.server.server import ServeConfig

    with pytest.raises(ConfigError, match="commit_poll_s"):
        ServeConfig.from_mapping({"commit_poll_s": -1})
    with pytest.raises(ConfigError, match="commit_poll_s"):
        ServeConfig.from_mapping({"commit_poll_s": 5})
    assert ServeConfig.from_mapping({"commit_poll_s": 0}).commit_poll_s == 0
    for bad in (-1, 0.5, "fast"):
        with pytest.raises(ConfigError, match="request_poll_s"):
            ServeConfig.from_mapping({"request_poll_s": bad})
    assert ServeConfig.from_mapping({"request_poll_s": 0}).request_poll_s == 0
    for bad in (-0.1, 1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="reply_poll_s"):
            ServerStore("unix:///nonexistent/kvtier.sock", reply_poll_s=bad)


def test_writes_and_reads_work_with_polling_off_on_both_sides(make_server):
    server = make_server(tiers=ARENA_8M, commit_poll_s=0, request_poll_s=0)
    with ServerStore(server.address, reply_poll_s=0) as c:
        assert c.put(_key(1), _payload(1, MiB)) and c.put_many([(_key(2), _payload(2, MiB))] * 1) == [True]
        assert c.put_many([(_key(3), _payload(3, 65536)), (_key(4), _payload(4, 65536))]) == [True, True]
        assert c.get(_key(1)) == _payload(1, MiB).tobytes() and c.get(_key(4)) == _payload(4, 65536).tobytes()


def test_poll_readable_returns_at_once_with_data_and_times_out_without(tmp_path):
    import socket

    a, b = socket.socketpair()
    try:
        a.settimeout(2.5)
        t0 = time.perf_counter()
        assert not P.poll_readable(a, 0.01)
        assert 0.01 <= time.perf_counter() - t0 < 1.0
        assert a.gettimeout() == 2.5  # restored
        b.sendall(b"x")
        assert P.poll_readable(a, 5.0) and a.recv(1) == b"x"
        assert not P.poll_readable(a, 0)
        b.close()
        assert P.poll_readable(a, 5.0)  # the stream's end is readable too
    finally:
        a.close()


def test_the_poller_stops_while_messages_come_late_and_resumes_when_they_are_fast_again():
    poller = P.Poller(0.001)
    assert poller.polling
    for _ in range(3):
        poller.observe(0.0001)
    assert poller.polling  # replies well within the budget
    for _ in range(20):
        poller.observe(0.005)  # a busy peer: the spin would only take its core
    assert not poller.polling
    poller.observe(0.0008)
    assert not poller.polling  # under the budget but not under half of it: still off
    for _ in range(30):
        poller.observe(0.0002)
    assert poller.polling
    off = P.Poller(0)
    off.observe(1.0)
    assert not off.polling and off.average == 0


def test_the_server_polls_for_requests_while_they_come_back_to_back_and_not_for_a_client_that_pauses():
    import socket
    import threading
    from types import SimpleNamespace

    from kvtier.server.server import _Connection

    a, b = socket.socketpair()
    try:
        conn = _Connection(SimpleNamespace(config=SimpleNamespace(commit_poll_s=0.002, request_poll_s=0.0002)), a)
        poller = conn.request_poller

        def ask(delay: float) -> dict | None:
            answered = time.monotonic()
            if delay == 0:  # back to back: the request is there before the wait
                P.send(b, {"op": "stats"})
                return conn._next_request(answered)
            timer = threading.Timer(delay, P.send, (b, {"op": "stats"}))
            timer.start()
            try:
                return conn._next_request(answered)
            finally:
                timer.join()

        for _ in range(5):
            assert ask(0.0) == {"op": "stats"}
        assert poller.polling and poller.average < 0.0002  # a loop of requests: polled for
        assert ask(0.03) == {"op": "stats"}
        assert poller.polling  # one pause between two loops does not turn it off
        for _ in range(6):
            assert ask(0.03) == {"op": "stats"}
        assert not poller.polling and poller.average <= 0.0004  # a pause counts at most twice the budget
        for _ in range(10):
            ask(0.0)
        assert poller.polling  # back to back again
        b.close()
        assert conn._next_request(time.monotonic()) is None  # the stream's end ends the wait
    finally:
        b.close()
        a.close()

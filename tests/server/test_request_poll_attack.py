"""Hostile review of commit 4937bb6: the server's request poll (``request_poll_s``,
``_Connection._next_request``) and the writes' fills through ``scatter``/``copy_segments``.

Each test is a defect found (it failed before its fix) or a rule the review checked and keeps:
a connection blocked in the new wait ends at the server's close, a descriptor past FD_SETSIZE,
a stalled partial frame that costs no CPU.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.server import ServerStore
from kvtier.server import protocol as P
from kvtier.server.server import CacheServer, ServeConfig, _Connection
from tests.server.test_direct_write import _key, _payload
from tests.test_store import wait_for

PAGE = 65536
ARENA_8M = [{"type": "ram", "capacity": "8MiB", "page_size": "64KiB", "policy": "lru"}]


def _inprocess(tmp_path: Path, **overrides) -> CacheServer:
    config = ServeConfig.from_mapping({"listen": f"unix://{tmp_path}/k.sock", "staging": "1MiB",
                                       "shm_dir": str(tmp_path), "store": {"tiers": ARENA_8M}, **overrides})
    return CacheServer(config).start()


def _connect(server: CacheServer) -> socket.socket:
    family, where = P.parse_address(server.address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.connect(where)
    s.settimeout(5.0)
    P.send(s, {"op": "hello", "version": P.VERSION, "token": None})
    assert P.recv(s)["ok"]
    return s


# ------------------------------------------------------------------ config: one line, never a spin of seconds


@pytest.mark.parametrize("bad", [True, False, "fast", "0.001", [0.001]])
def test_request_poll_s_built_by_hand_is_a_number_or_one_config_error_line(bad):
    """DEFECT (fixed): ``ServeConfig(request_poll_s=True)`` was accepted (``validate`` skipped
    bools), a 1.0 s spin budget per request, 100 x the field's maximum; a string raised a bare
    TypeError from the range comparison. By hand as from a file: one ConfigError line."""
    with pytest.raises(ConfigError) as info:
        ServeConfig(request_poll_s=bad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("serve.request_poll_s: expected a number"), msg
    with pytest.raises(ConfigError, match="serve.commit_poll_s: expected a number"):
        ServeConfig(commit_poll_s=True)  # every ranged field, not only the new one


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1e-9, 0.0100001])
def test_request_poll_s_out_of_range_is_one_line_by_hand_and_from_a_file(bad):
    for build in (lambda: ServeConfig(request_poll_s=bad), lambda: ServeConfig.from_mapping({"request_poll_s": bad})):
        with pytest.raises(ConfigError) as info:
            build()
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("serve.request_poll_s:"), msg
    assert ServeConfig(request_poll_s=0).request_poll_s == 0
    assert ServeConfig(request_poll_s=0.01).request_poll_s == 0.01


# ------------------------------------------------------------------ the gap after an error reply


def test_the_gap_after_an_error_reply_is_measured_from_that_reply(tmp_path, monkeypatch):
    """DEFECT (fixed): a malformed request's error reply did not reset ``answered`` (the loop
    ``continue``d past it), so the next request's gap was measured from the reply before it: a
    client that paused, sent a bad request and then its requests back to back was seen pausing
    (the poll switched off), and one whose first request was malformed was not polled for."""
    seen: list[float | None] = []
    real = _Connection._next_request

    def spy(self, answered):
        seen.append(answered)
        return real(self, answered)

    monkeypatch.setattr(_Connection, "_next_request", spy)
    server = _inprocess(tmp_path, request_poll_s=0.001)
    try:
        s = _connect(server)
        P.send(s, {"op": "nope"})  # the first request is malformed
        assert P.recv(s)["ok"] is False
        P.send(s, {"op": "stats"})
        assert P.recv(s)["ok"]
        before_error = time.monotonic()
        P.send(s, {"op": "nope"})
        assert P.recv(s)["ok"] is False
        P.send(s, {"op": "stats"})
        assert P.recv(s)["ok"]
        assert wait_for(lambda: len(seen) >= 5)
        # reads: first (after hello), after error 1, after stats, after error 2, after stats
        assert seen[0] is None
        assert seen[1] is not None  # the error was a reply: the next request is polled for
        assert seen[3] is not None and seen[3] >= before_error, (seen, before_error)
        s.close()
    finally:
        server.close()


# ------------------------------------------------------------------ the wait ends; no core spins


def test_close_ends_connections_blocked_in_the_request_wait_and_a_stalled_partial_frame(tmp_path):
    """Sound: a connection whose client paused (its thread blocked in ``recv``, past the poll)
    and one that sent half a frame header and stalled (its thread in ``recv`` too) both end at
    the server's close; the stalled one costs no CPU meanwhile."""
    server = _inprocess(tmp_path, request_poll_s=0.01)
    try:
        paused, stalled = _connect(server), _connect(server)
        for s in (paused, stalled):
            for _ in range(5):  # back to back: the poll is on
                P.send(s, {"op": "stats"})
                assert P.recv(s)["ok"]
        stalled.sendall(b"\x00\x00")
        time.sleep(0.05)  # past the poll's budget: both threads block
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.5)
        after = resource.getrusage(resource.RUSAGE_SELF)
        used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert used < 0.2, f"{used:.3f} s of CPU in 0.5 s with every client silent"
        assert len(server._conns) == 2
        server.close()
        assert wait_for(lambda: not server._conns)
        for s in (paused, stalled):
            assert s.recv(16) == b""
            s.close()
    finally:
        server.close()


def test_the_request_wait_takes_a_descriptor_past_fd_setsize_and_ends_at_shutdown():
    """Sound: the wait takes a descriptor past 1024 (no ``select.select``), and ``shutdown``
    (the server's close) ends it: the next request is None."""
    import fcntl
    from types import SimpleNamespace

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1100:
        pytest.skip("the descriptor limit is at most 1100")
    a, b = socket.socketpair()
    high = socket.socket(fileno=fcntl.fcntl(a.fileno(), fcntl.F_DUPFD, 1100))
    a.close()
    try:
        conn = _Connection(SimpleNamespace(config=SimpleNamespace(commit_poll_s=0.002, request_poll_s=0.0002)), high)
        assert high.fileno() >= 1100
        timer = threading.Timer(0.05, P.send, (b, {"op": "stats"}))
        timer.start()
        assert conn._next_request(time.monotonic() - 1.0) == {"op": "stats"}  # a pause: blocked, not polled
        timer.join()
        timer = threading.Timer(0.05, conn.shutdown)
        timer.start()
        assert conn._next_request(time.monotonic()) is None
        timer.join()
    finally:
        b.close()
        high.close()


# ------------------------------------------------------------------ staging extents that do not add up


@pytest.mark.parametrize("delta", [-1, +1, -PAGE])
def test_staging_extents_that_do_not_add_up_are_refused_not_raised(make_server, monkeypatch, delta):
    """DEFECT (fixed): the client checked a ``reserve`` reply's staging extents against the
    staging area but not their total against ``nbytes`` (the direct path's ``_extents`` does).
    ``scatter`` now refuses segments that do not hold the source exactly, so a server answering
    extents short or long by a byte made ``put`` raise ValueError into the engine (before the
    commit, a short total was committed with the missing bytes stale). Now: False, counted as an
    error, the reservation aborted."""
    server = make_server(tiers=ARENA_8M)
    with ServerStore(server.address, direct_writes=False) as c:
        real = c._call

        def tamper(message, deadline, reply=True):
            answer = real(message, deadline, reply)
            if message.get("op") == "reserve" and answer is not None and answer.get("extents"):
                extents = [list(e) for e in answer["extents"]]
                extents[-1][1] += delta
                answer = {**answer, "extents": extents}
            return answer

        monkeypatch.setattr(c, "_call", tamper)
        errors = c.stats()["client"]["errors"]
        assert c.put(_key(1), _payload(1, 2 * PAGE)) is False
        assert c.stats()["client"]["errors"] == errors + 1
        monkeypatch.undo()
        assert c.lookup([_key(1)]) == 0
        assert c.put(_key(2), _payload(2, 2 * PAGE)) is True  # the reservation was given back
        assert c.get(_key(2)) == _payload(2, 2 * PAGE).tobytes()
        assert c.stats()["server"]["staging_used_bytes"] == 0

"""``kvtier route``'s front door, through real ``kvtier route`` processes in front of a stub engine
of the tests' own: upstream deadlines and cancellation (load returns to 0), limits on slow,
large and idle clients, malformed bodies, engine credentials, hop-by-hop headers, ``--port 0``."""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import socket
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from kvtier.harness.procs import spawn
from tests.route._stub_engine import StubEngine

_READY = re.compile(r"kvtier route: ready on http://127\.0\.0\.1:(\d+)")
SECRET = "s3cr:et"  # percent-encoded in the URL below; contains the ':' Basic auth separates on


class Router:
    """A ``kvtier route`` process started with ``--port 0`` and a config file."""

    def __init__(self, tmp_path: Path, name: str, config: dict, prefix: list[str] | None = None) -> None:
        self.cfg = tmp_path / f"{name}.json"
        self.cfg.write_text(json.dumps(config))
        self.log = tmp_path / f"{name}.log"
        self.log.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kvtier", "route", "--config", str(self.cfg), "--port", "0"]
        self.child = spawn((prefix or []) + argv, name=name, log=self.log)
        deadline = time.monotonic() + 60
        while not (m := _READY.search(self.log.read_text())):
            assert self.child.alive and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        self.port = int(m.group(1))
        self.base = f"http://127.0.0.1:{self.port}"

    def health(self, timeout: float = 5.0) -> dict:
        return requests.get(self.base + "/health", timeout=timeout).json()

    def metrics(self) -> str:
        return requests.get(self.base + "/metrics", timeout=5).text

    def in_flight(self) -> int:
        return sum(e["in_flight"] for e in self.health()["engines"].values())

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        self.child.stop()


def _until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def stub():
    engine = StubEngine().start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def router(stub, tmp_path_factory):
    """One router with short deadlines, a 1 MiB body limit, and credentials in its engine URL."""
    url = stub.url.replace("http://", "http://alice:s3cr%3Aet@")
    r = Router(tmp_path_factory.mktemp("route"), "router", {
        "engines": [url], "block_size": 4, "first_byte_timeout_s": 1.5, "stream_idle_timeout_s": 1.5,
        "header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 1.5,
        "max_body_bytes": "1MiB", "max_body_bytes_total": "3MiB", "health_interval_s": 0.5})
    yield r
    r.stop()
    assert "Traceback" not in r.text(), r.text()[-3000:]


def _post(router: Router, body, mode: str = "ok", ident: str = "", timeout: float = 10.0, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", "X-Stub": mode, "X-Stub-Id": ident, **kw.pop("headers", {})}
    return requests.post(router.base + "/v1/completions", data=data, headers=headers, timeout=timeout, **kw)


# --- 14: --port 0 -------------------------------------------------------------------------------

def test_port_0_prints_the_bound_port(router):
    assert router.port != 0
    assert router.health()["healthy"]


# --- 8: deadlines and cancellation --------------------------------------------------------------

def test_an_engine_that_never_answers_is_a_504_at_the_first_byte_deadline(router, stub):
    t0 = time.monotonic()
    resp = _post(router, {"prompt": [1, 2, 3, 4, 5]}, mode="hang", ident="hang-1")
    took = time.monotonic() - t0
    assert resp.status_code == 504 and "sent no response within 1.5 s" in resp.json()["error"]["message"]
    assert 1.4 < took < 5.0
    _until(lambda: "hang-1" in stub.cancelled, 5, "the engine sees its request closed")
    assert router.in_flight() == 0
    assert 'outcome="first_byte_timeout"' in router.metrics()


def test_an_engine_stalling_mid_stream_is_cut_at_the_idle_deadline(router, stub):
    t0 = time.monotonic()
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        with _post(router, {"prompt": [1] * 8, "stream": True}, mode="stall", ident="stall-1", stream=True) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_content(chunk_size=None):
                pass
    assert time.monotonic() - t0 < 6.0
    _until(lambda: "stall-1" in stub.cancelled, 5, "the engine sees its request closed")
    assert router.in_flight() == 0
    assert 'outcome="stream_idle_timeout"' in router.metrics()


def test_a_client_that_disconnects_cancels_the_upstream_request(router, stub):
    for ident, mode in (("gone-wait", "hang"), ("gone-stream", "stall")):
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            body = json.dumps({"prompt": [7] * 8, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"X-Stub: %s\r\nX-Stub-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
                         % (mode.encode(), ident.encode(), len(body), body))
            _until(lambda: any(s["headers"].get("X-Stub-Id") == ident for s in stub.seen), 5, "request reached")
            if mode == "stall":
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        took = _until(lambda: ident in stub.cancelled, 1.2, f"{ident}: the engine sees the client leave")
        assert took < 1.2  # well before either deadline (1.5 s)
        _until(lambda: router.in_flight() == 0, 2, "in_flight back to 0")
    assert 'outcome="client_gone"' in router.metrics()


def test_a_client_that_stops_reading_does_not_hold_the_engine(router, stub):
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        body = json.dumps({"prompt": [3] * 8, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Stub: flood\r\nX-Stub-Id: slow-reader\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        _until(lambda: "slow-reader" in stub.cancelled, 15, "the engine's stream closed")
    _until(lambda: router.in_flight() == 0, 3, "in_flight back to 0")
    assert 'outcome="client_write_timeout"' in router.metrics()


def test_a_flood_of_bad_requests_is_a_few_log_lines(router):
    before = len(router.text().splitlines())
    for _ in range(100):
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n")
            sock.settimeout(5)
            assert sock.recv(100).startswith(b"HTTP/1.0 400")
    lines = router.text().splitlines()[before:]
    assert len(lines) <= 10 and not any("Traceback" in line for line in lines), lines


# --- 9: slow, large and idle clients ---------------------------------------------------------------

def _closed_within(sock: socket.socket, limit: float, drip: bytes | None = None) -> float:
    """Seconds until the router closes ``sock`` (reading whatever it sends), dripping ``drip``
    every 0.25 s meanwhile; fails past ``limit``."""
    sock.settimeout(0.25)
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            if drip:
                sock.sendall(drip)
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
    raise AssertionError(f"connection still open after {limit} s")


def test_slow_heads_slow_bodies_and_silent_connections_are_closed(router):
    with socket.create_connection(("127.0.0.1", router.port)) as silent:
        assert _closed_within(silent, 4.0) < 3.0  # keep-alive idle 1.5 s
    with socket.create_connection(("127.0.0.1", router.port)) as loris:
        loris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(loris, 4.0, drip=b"X-A: b\r\n") < 2.5  # head deadline 1 s
    with socket.create_connection(("127.0.0.1", router.port)) as slow_body:
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"pr")
        slow_body.settimeout(4.0)
        t0 = time.monotonic()
        answer = slow_body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3.0
    # a connection that did its request then went quiet is closed too
    with socket.create_connection(("127.0.0.1", router.port)) as used:
        used.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        used.settimeout(2.0)
        assert used.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_within(used, 4.0) < 3.0
    text = router.metrics()
    assert 'reason="header_timeout"' in text and 'reason="body_timeout"' in text


def test_bodies_over_the_limit_are_413_before_they_are_read(router):
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 62914560\r\n\r\n")
        sock.settimeout(3.0)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    chunked = (b"[" + b"1," * 600_000 + b"1]")  # 1.2 MB without a Content-Length
    resp = requests.post(router.base + "/v1/completions", data=iter([chunked[:600_000], chunked[600_000:]]),
                         timeout=10)
    assert resp.status_code == 413 and "over the limit" in resp.json()["error"]["message"]


def test_bodies_held_at_once_share_one_budget_and_rss_stays_bounded(router):
    proc = psutil.Process(router.child.popen.pid)
    before = proc.memory_info().rss
    held, answers = [], []
    try:
        for _ in range(6):  # six bodies one byte short of 1 MiB each, 3 MiB allowed at once
            sock = socket.create_connection(("127.0.0.1", router.port))
            held.append(sock)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n"
                         + b"x" * 1048575)
        time.sleep(0.3)
        grown = proc.memory_info().rss - before
        for sock in held:
            sock.settimeout(3.0)
            answers.append(sock.recv(4096)[:12])
    finally:
        for sock in held:
            sock.close()
    assert answers.count(b"HTTP/1.1 503") == 3 and answers.count(b"HTTP/1.1 408") == 3, answers
    assert grown < 40 * 1024**2, f"RSS grew {grown / 2**20:.0f} MiB"


def _worst_health_while(router: Router, send) -> float:
    """The slowest /health answer (s) while ``send()`` runs, polling every 20 ms."""
    worst = [0.0]
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            requests.get(router.base + "/health", timeout=10)
            worst[0] = max(worst[0], time.monotonic() - t0)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        send()
    finally:
        stop.set()
        prober.join()
    return worst[0]


def test_a_token_prompt_at_the_default_body_limit_does_not_stall_the_event_loop(stub, tmp_path):
    """Default limits: a 31 MiB token-id prompt (3.8 million ids) is routed while /health keeps
    answering (the ids are checked in slices between which the loop runs); 59 MB is a 413."""
    r = Router(tmp_path, "big", {"engines": [stub.url], "block_size": 16})
    try:
        body = json.dumps({"prompt": list(range(100_000, 3_900_000)), "max_tokens": 1})
        assert 30 * 1024**2 < len(body) < 32 * 1024**2
        statuses = []
        worst = _worst_health_while(r, lambda: statuses.append(_post(r, body, timeout=60).status_code))
        assert statuses == [200] and worst < 0.5, f"/health took up to {worst:.2f} s"
        bad = json.dumps({"prompt": list(range(100_000, 3_900_000)) + [-1]})
        resp = _post(r, bad, timeout=60)
        assert resp.status_code == 400 and "in `$.prompt`" in resp.json()["error"]["message"]
        t0 = time.monotonic()
        assert _post(r, b"[" + b"1," * 29_000_000 + b"1]", timeout=60).status_code == 413
        assert time.monotonic() - t0 < 5.0
        assert "Traceback" not in r.text()
    finally:
        r.stop()


# --- 11: malformed bodies ----------------------------------------------------------------------

@pytest.mark.parametrize("body, fragment", [
    ("[" * 100_000, "Expected `object`"),
    ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ({"prompt": [1, 2, -1]}, "at `$.prompt[2]`"),
    ({"prompt": [2**32]}, "4294967295"),
    ({"prompt": [[1, 2], [3, 2**40]]}, "at `$.prompt[1][1]`"),
    ({"prompt": 5}, "at `$.prompt`"),
    ({"prompt": [1, "two"]}, "not a mix"),
    ({"prompt": [True]}, "got `bool`"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("not json", "not valid JSON"),
])
def test_malformed_bodies_are_400_with_a_message(router, body, fragment):
    resp = _post(router, body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert fragment in message and "\n" not in message


def test_malformed_chat_bodies_are_400(router):
    for body in ({"messages": "hi"}, {"messages": [1]}):
        resp = requests.post(router.base + "/v1/chat/completions", json=body, timeout=5)
        assert resp.status_code == 400 and "$.messages" in resp.json()["error"]["message"]


# --- 12: engine credentials --------------------------------------------------------------------

def test_engine_credentials_are_sent_as_basic_auth_and_never_shown(router, stub):
    shown = json.dumps(router.health()) + router.metrics() + router.text()
    assert "alice" not in shown and "s3cr" not in shown
    assert stub.url in router.health()["engines"]
    resp = _post(router, {"prompt": [1, 2]}, ident="auth", headers={"Authorization": "Bearer client-token"})
    assert resp.status_code == 200
    seen = next(s for s in stub.seen if s["headers"].get("X-Stub-Id") == "auth")
    expected = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert seen["headers"]["Authorization"] == expected  # the URL's credentials win


def test_without_credentials_in_the_url_the_clients_authorization_is_passed_on(stub, tmp_path):
    r = Router(tmp_path, "plain", {"engines": [stub.url]})
    try:
        resp = _post(r, {"prompt": [1]}, ident="client-auth", headers={"Authorization": "Bearer t0k"})
        assert resp.status_code == 200
        seen = next(s for s in stub.seen if s["headers"].get("X-Stub-Id") == "client-auth")
        assert seen["headers"]["Authorization"] == "Bearer t0k"
    finally:
        r.stop()


# --- 13: hop-by-hop headers --------------------------------------------------------------------

def test_hop_by_hop_headers_are_dropped_both_ways(router, stub):
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
    body = json.dumps({"prompt": [1, 2, 3]})
    conn.request("POST", "/v1/completions", body=body, headers={
        "Content-Type": "application/json", "X-Stub": "hop", "X-Stub-Id": "hop",
        "Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "1", "Keep-Alive": "timeout=5",
        "TE": "trailers", "Trailer": "X-T", "Upgrade": "websocket", "Proxy-Authorization": "Basic eDp5",
        "Proxy-Connection": "keep-alive", "X-End-To-End": "1"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    got = {k.lower() for k in resp.headers}
    assert not got & {"x-engine-hop", "keep-alive", "proxy-authenticate", "trailer", "upgrade"}, got
    assert resp.headers["X-End-To-End"] == "1"
    conn.close()
    sent = {k.lower() for k in next(s for s in stub.seen if s["headers"].get("X-Stub-Id") == "hop")["headers"]}
    assert not sent & {"x-client-hop", "keep-alive", "te", "trailer", "upgrade", "proxy-authorization",
                       "proxy-connection"}, sent
    assert "x-end-to-end" in sent


# --- connection cap ------------------------------------------------------------------------------

def test_idle_connections_past_the_fd_limit_leave_health_answering(stub, tmp_path):
    """Under a 256-descriptor limit, 300 idle connections: /health still answers at once, the
    excess is closed (counted), and nothing is logged per connection."""
    r = Router(tmp_path, "capped", {"engines": [stub.url], "keepalive_timeout_s": 60, "header_timeout_s": 60},
               prefix=["prlimit", "--nofile=256:256", "--"])
    socks = []
    try:
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", r.port), timeout=5))
        time.sleep(0.5)
        for _ in range(5):
            t0 = time.monotonic()
            assert r.health(timeout=2)["healthy"]
            assert time.monotonic() - t0 < 1.0
        text = r.metrics()
        evicted = float(re.search(r'kvtier_route_connections_closed_total\{reason="evicted"\} (\S+)', text).group(1))
        assert evicted >= 300 - 256
        assert "max_connections lowered" in r.text()
        log = r.text()
        assert "Traceback" not in log and len(log.splitlines()) < 20, log
    finally:
        for s in socks:
            s.close()
        r.stop()


# --- 10: KV events ----------------------------------------------------------------------------

def _metric(text: str, pattern: str) -> float:
    m = re.search(pattern + r" (\S+)", text)
    return float(m.group(1)) if m else 0.0


def test_a_malformed_kv_event_is_counted_and_the_stream_goes_on(stub, tmp_path):
    """Token id -1 (OverflowError in the index), a medium of the wrong type, a hash that cannot be
    hashed: each is counted and skipped; good events after them are still applied."""
    import msgspec
    import zmq

    from kvtier.harness.services import free_port

    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    r = Router(tmp_path, "events", {"engines": [{"url": stub.url, "kv_events": f"tcp://127.0.0.1:{port}"}],
                                    "block_size": 4})

    def stored(h, tokens, **extra):
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": tokens,
                "block_size": 4, "medium": "GPU", **extra}

    bad = [stored(1, [1, 2, 3, -1]), stored(2, [1, 2, 3, 4], medium=5), stored([[1]], [1, 2, 3, 4]),
           stored(3, [1, 2, 3, 2**40])]
    seq = 0
    try:
        deadline = time.monotonic() + 20
        while True:
            for batch in ([bad[seq % 4]], [stored(1000 + seq, [seq, seq + 1, seq + 2, seq + 3])]):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), batch, 0])])
                seq += 1
            time.sleep(0.1)
            text = r.metrics()
            malformed = _metric(text, r'kvtier_route_kv_events_total\{engine="[^"]+",type="malformed"\}')
            if malformed >= 4 and r.health()["index_keys"] >= 3:
                break
            assert time.monotonic() < deadline, f"malformed={malformed}, health={r.health()}"
        assert "Traceback" not in r.text()
    finally:
        r.stop()
        pub.close(linger=0)
        ctx.term()


def test_a_subscriber_that_dies_is_restarted_and_logged(stub, tmp_path):
    r = Router(tmp_path, "deadsub", {"engines": [{"url": stub.url, "kv_events": "tcp://127.0.0.1:notaport"}]})
    try:
        pattern = r'kvtier_route_kv_subscriber_restarts_total\{engine="%s"\}' % re.escape(stub.url)
        _until(lambda: _metric(r.metrics(), pattern) >= 2, 10, "two restarts")
        assert f"kv events of {stub.url} stopped (ZMQError" in r.text()
        assert r.health()["healthy"] == [stub.url]
        assert "Traceback" not in r.text()
    finally:
        r.stop()


def test_a_burst_of_the_same_loop_error_is_one_line_a_second(caplog):
    """asyncio reports each failed ``accept`` of a burst (up to its backlog per tick) past the
    fd limit: the router's loop handler logs the first, counts the repeats within a second, and
    says how many it held back in the next line of that message."""
    from kvtier.cli.route import _LoopErrors

    now = [0.0]  # the handler's clock, moved by hand
    handler = _LoopErrors(logging.getLogger("kvtier.route.test"), interval_s=0.2, clock=lambda: now[0])
    exc = OSError(24, "Too many open files")
    with caplog.at_level(logging.ERROR, logger="kvtier.route.test"):
        for _ in range(128):
            handler(None, {"message": "socket.accept() out of system resource", "exception": exc})
        handler(None, {"message": "another error"})
        assert len(caplog.records) == 2
        now[0] += 0.25
        handler(None, {"message": "socket.accept() out of system resource", "exception": exc})
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "socket.accept() out of system resource: OSError: [Errno 24] Too many open files"
    assert lines[1] == "another error"
    assert lines[2].endswith("(127 more since the last line)"), lines[2]
    assert all("Traceback" not in line for line in lines)

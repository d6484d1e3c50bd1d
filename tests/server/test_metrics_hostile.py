"""The metrics endpoint of a real ``kvtier serve`` against hostile clients on raw sockets: bytes
dripped slower than any per-read timeout, many connections at once, resets and oversized
requests. Bounds: at most ``metrics_max_connections`` handler threads, each connection closed by
``metrics_request_timeout_s`` after it was accepted however it drips, excess refused at once,
one counted log line per failure and never a traceback."""

from __future__ import annotations

import select
import socket
import struct
import time
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.errors import ConfigError
from kvtier.server.server import ServeConfig

CAP = 4
DEADLINE_S = 1.5
SLACK_S = 1.0  # scheduling on a loaded 2-core machine
DRIP = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Drip: 1\r\n" * 1000  # headers that never end


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _counters(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text)
            if f.name.startswith("kvtier_metrics_")}


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # polling interval
    return predicate()


def test_dripping_connections_are_capped_and_cut_at_the_whole_request_deadline(make_server):
    """30 connections each send one header byte every 0.1 s (each read arrives well inside any
    per-read timeout; the headers never end). The server runs at most CAP extra threads, refuses
    the connections over CAP at once, closes each admitted one by DEADLINE_S after it was
    accepted, counts both kinds, logs no traceback, and answers a scrape once they are gone."""
    server = make_server(metrics_max_connections=CAP, metrics_request_timeout_s=DEADLINE_S)
    proc = psutil.Process(server.proc.pid)
    baseline = proc.num_threads()
    addr = _hostport(server.metrics_address)

    socks, opened, closed_at, sent = [], [], {}, {}
    for _ in range(30):
        s = socket.create_connection(addr, timeout=5)
        s.setblocking(False)
        socks.append(s)
        opened.append(time.monotonic())
        sent[s] = 0
    peak = baseline
    end = time.monotonic() + DEADLINE_S + SLACK_S + 2.0
    while len(closed_at) < len(socks) and time.monotonic() < end:
        for s in socks:
            if s in closed_at:
                continue
            try:
                s.send(DRIP[sent[s]:sent[s] + 1])
                sent[s] += 1
            except OSError:  # reset or closed by the server
                closed_at[s] = time.monotonic()
        readable, _, _ = select.select([s for s in socks if s not in closed_at], [], [], 0.1)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data or b"503" in data:
                closed_at[s] = time.monotonic()
        peak = max(peak, proc.num_threads())
    for s in socks:
        s.close()

    assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} connections still open"
    held = sorted(closed_at[s] - t0 for s, t0 in zip(socks, opened))
    assert held[-1] <= DEADLINE_S + SLACK_S, held
    refused_fast = sum(h < 0.5 for h in held)
    assert refused_fast >= len(socks) - CAP, held
    assert peak - baseline <= CAP, (baseline, peak)
    counters = _counters(server.metrics_address)
    assert counters["kvtier_metrics_refused"] >= len(socks) - CAP
    assert counters["kvtier_metrics_timeouts"] >= 1
    out = server.output()
    assert "Traceback" not in out, out[-3000:]
    assert "ran past its deadline" in out


def test_each_reset_is_one_counted_line_and_no_traceback(make_server):
    """Clients that send half a request and reset (RST) the connection: one log line each with
    the running count, the resets counted in /metrics, no traceback, the endpoint still serves."""
    server = make_server(metrics_request_timeout_s=5.0)
    addr = _hostport(server.metrics_address)
    resets = 5
    for _ in range(resets):
        s = socket.create_connection(addr, timeout=5)
        s.sendall(b"GET /metr")
        time.sleep(0.2)  # the handler is waiting for the rest of the request
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST
    assert _wait_for(lambda: server.output().count("reset mid-request") >= resets), server.output()[-3000:]
    out = server.output()
    lines = [line for line in out.splitlines() if "reset mid-request" in line]
    assert len(lines) == resets and f"({resets} so far)" in lines[-1], lines
    assert "Traceback" not in out, out[-3000:]
    assert _counters(server.metrics_address)["kvtier_metrics_resets"] == resets


def test_an_oversized_request_is_cut_and_counted(make_server):
    """Headers past the request-size bound (16 KiB) sent at once: the connection is closed
    without an answer, one counted line, no traceback."""
    server = make_server()
    s = socket.create_connection(_hostport(server.metrics_address), timeout=5)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Big: " + b"a" * 200 + b"\r\n" * 1)
        try:
            s.sendall((b"X-Big: " + b"a" * 200 + b"\r\n") * 200)
        except OSError:
            pass  # the server may already have closed
        s.settimeout(5)
        try:
            assert s.recv(4096) == b""
        except ConnectionResetError:
            pass
    finally:
        s.close()
    assert _wait_for(lambda: "larger than 16384 bytes" in server.output()), server.output()[-3000:]
    assert "Traceback" not in server.output()
    assert _counters(server.metrics_address)["kvtier_metrics_oversized"] == 1


@pytest.mark.parametrize("key, value", [("metrics_max_connections", 0), ("metrics_max_connections", 5000),
                                        ("metrics_request_timeout_s", 0), ("metrics_request_timeout_s", float("inf"))])
def test_metrics_bounds_are_range_checked(key, value):
    with pytest.raises(ConfigError, match=rf"^serve\.{key}: "):
        ServeConfig.from_mapping({key: value})

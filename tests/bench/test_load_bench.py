"""The load benchmark's parts: the delay proxy (latency per request, window per round trip) and
`kvtier bench load --json`'s interface. Lower time bounds only: the proxy sleeps, so they hold on
any machine; how fast anything is belongs to the benchmark, not to a test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvtier.bench.delay_proxy import DelayProxy

PAYLOAD = os.urandom(2 << 20)


@pytest.fixture
def upstream():
    """A server that answers each 1-byte request with PAYLOAD (a thread per connection)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def answer(conn):
        with conn:
            try:
                while conn.recv(1):
                    conn.sendall(PAYLOAD)
            except OSError:
                pass

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def _fetch(port: int, requests: int) -> tuple[float, bytes]:
    got = bytearray()
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # a hang fails, never stalls
        for _ in range(requests):
            s.sendall(b"x")
            want = len(got) + len(PAYLOAD)
            while len(got) < want:
                chunk = s.recv(1 << 20)
                assert chunk
                got += chunk
    return time.monotonic() - start, bytes(got)


def test_each_request_waits_the_delay(upstream):
    with DelayProxy(upstream, 0.05) as proxy:
        secs, data = _fetch(proxy.port, 3)
        assert proxy.requests == 3
    assert data == PAYLOAD * 3
    assert secs >= 3 * 0.05


def test_window_caps_a_connection_per_round_trip(upstream):
    window = 256 << 10
    with DelayProxy(upstream, 0.02, window=window) as proxy:
        secs, data = _fetch(proxy.port, 1)
    assert data == PAYLOAD
    # 2 MiB at 256 KiB per 20 ms: the request's own delay plus at least 7 full periods
    assert secs >= 0.02 + (len(PAYLOAD) // window - 1) * 0.02


def test_rate_paces_a_response_shorter_than_any_window(upstream):
    """``rate``: 2 MiB at 100 MB/s take ~21 ms beyond the request's delay, though a window of the
    same bandwidth-delay product (2 MB per 20 ms) would let them through unpaced."""
    rate = 100e6
    with DelayProxy(upstream, 0.02, rate=rate) as proxy:
        secs, data = _fetch(proxy.port, 2)
    assert data == PAYLOAD * 2
    # each response: its last slice (0.5 ms of the rate) may go unwaited
    assert secs >= 2 * (0.02 + len(PAYLOAD) / rate - 0.0005)
    with pytest.raises(ValueError, match="rate"):
        DelayProxy(upstream, 0.02, window=1024, rate=rate)
    with pytest.raises(ValueError, match="rate"):
        DelayProxy(upstream, 0.02, rate=0)


def test_link_rate_is_shared_by_concurrent_connections(upstream):
    """``link_rate``: four connections fetching 2 MiB each at once share one 100 MB/s link, so the
    last one ends no sooner than all 8 MiB took on it (with ``rate``, each would get 100 MB/s)."""
    rate, clients = 100e6, 4
    with DelayProxy(upstream, 0.0, link_rate=rate) as proxy:
        start = time.monotonic()
        results = [None] * clients

        def fetch(i):
            results[i] = _fetch(proxy.port, 1)[1]

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        took = time.monotonic() - start
    assert results == [PAYLOAD] * clients
    # each connection's last slice (0.5 ms of the rate, 16 KiB at least) may go unwaited
    assert took >= clients * len(PAYLOAD) / rate - clients * max(16 << 10, rate * 0.0005) / rate
    with pytest.raises(ValueError, match="exclude"):
        DelayProxy(upstream, 0.0, rate=rate, link_rate=rate)
    with pytest.raises(ValueError, match="link_rate"):
        DelayProxy(upstream, 0.0, link_rate=-1)


def test_close_ends_every_pump_even_one_blocked_on_a_quiet_connection(upstream):
    """A pump blocked in ``splice`` on a connection that says nothing more returns at ``close``
    (its sockets are shut down, not only closed). Before, such a thread stayed blocked on the
    closed socket's file, and the next proxy of the same process hung its first response."""
    with DelayProxy(upstream, 0.02, window=256 << 10) as proxy:
        _fetch(proxy.port, 1)
        pumps = list(proxy._threads)
    assert pumps and not any(t.is_alive() for t in pumps)
    with DelayProxy(upstream, 0.0, rate=100e6) as proxy:  # the same process, a fresh proxy
        _, data = _fetch(proxy.port, 1)
    assert data == PAYLOAD


def test_window_needs_a_delay():
    with pytest.raises(ValueError, match="window"):
        DelayProxy(("127.0.0.1", 1), 0.0, window=1024)


@pytest.mark.slow
@pytest.mark.s3
def test_bench_load_json_interface(tmp_path):
    cmd = [sys.executable, "-m", "kvtier.cli", "bench", "load", "--size", "24MiB", "--modes", "warm,s3+wan",
           "--no-runai", "--concurrency", "4", "--block-size", "4MiB", "--memory-limit", "16MiB",
           "--latency-ms", "10", "--wan-window", "2MiB", "--work-dir", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    got = {(r["method"], r["mode"]) for r in report["results"]}
    assert {("kvtier", "warm"), ("safetensors", "warm"), ("kvtier", "s3+wan"), ("single-stream", "s3+wan"),
            ("sequential", "s3+wan")} <= got
    for r in report["results"]:
        assert isinstance(r["gb_per_s"], float) and r["gb_per_s"] > 0 and r["peak_rss_bytes"] > 0, r
    assert report["wan_window_bytes"] == 2 << 20 and report["proxy_requests_s3+wan"] > 3
    names = {c["target"] for c in report["checks"]}
    assert {"warm vs safetensors", "s3+wan vs single GET"} <= names


def test_bench_load_bad_mode_is_one_line(capsys):
    from kvtier.cli import main

    assert main(["bench", "load", "--modes", "s3+lan"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown mode 's3+lan'" in err and "s3+wan" in err and "\n" not in err

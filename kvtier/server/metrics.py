"""HTTP endpoint of the cache server: ``/metrics`` (Prometheus text format) and ``/healthz``.

Metric names (all prefixed ``kvtier_``): store counters (``store_hits_total``,
``store_misses_total``, ``store_promotions_total``, ...), per tier with a ``tier`` label
(``tier_hits_total``, ``tier_misses_total``, ``tier_bytes_read_total``,
``tier_bytes_written_total``, ``tier_errors_total``, ``tier_corrupt_total``,
``tier_dropped_total``, ``tier_evictions_total``, gauges ``tier_used_bytes``,
``tier_capacity_bytes``, ``tier_queue_depth``) and the server's own counters
(``server_connections_total``, ``server_rejected_total``, ``server_malformed_total``,
``server_refused_busy_total``, ``server_hello_timeouts_total``, ``server_leases_expired_total``,
``server_lease_quota_total``, ``server_put_quota_total``, ...) and gauges
(``server_connections_open``, ``server_unauthenticated_open``, ``server_leases_open``,
``server_staging_used_bytes``). No secret is ever part of the output.

The HTTP server binds ``host:port`` as given (port 0: a free port; the caller reads the bound one
from ``server_address``) and gives each scrape connection 5 s to send its request.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.server.server import CacheServer

_TIER_COUNTERS = ("hits", "misses", "puts", "deletes", "bytes_read", "bytes_written", "corrupt",
                  "errors", "dropped", "evictions")
_TIER_GAUGES = ("used_bytes", "capacity_bytes", "queue_depth", "entries")
_SERVER_GAUGES = ("staging_used_bytes", "connections_open", "unauthenticated_open", "leases_open")
_REQUEST_TIMEOUT_S = 5.0


def render(stats: dict) -> str:
    """The Prometheus text exposition of a server ``stats()`` dict."""
    lines: list[str] = []

    def metric(name: str, kind: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# TYPE kvtier_{name} {kind}")
        for labels, value in samples:
            lines.append(f"kvtier_{name}{labels} {value}")

    for name, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metric(f"store_{name}_total", "counter", [("", value)])
    tiers = stats.get("tiers", [])
    for name in _TIER_COUNTERS + _TIER_GAUGES:
        samples = [(f'{{tier="{_escape(t["name"])}"}}', t[name]) for t in tiers if t.get(name) is not None]
        if samples:
            kind = "gauge" if name in _TIER_GAUGES else "counter"
            metric(f"tier_{name}" + ("" if kind == "gauge" else "_total"), kind, samples)
    for name, value in stats.get("server", {}).items():
        kind = "gauge" if name in _SERVER_GAUGES else "counter"
        metric(f"server_{name}" + ("" if kind == "gauge" else "_total"), kind, [("", value)])
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def start_metrics(server: "CacheServer", host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``/metrics`` and ``/healthz`` for ``server`` in a daemon thread; returns the HTTP server."""

    class Handler(BaseHTTPRequestHandler):
        timeout = _REQUEST_TIMEOUT_S  # a silent scraper costs one thread for at most this long

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/metrics":
                body = render(server.stats()).encode()
                self._reply(200, body, "text/plain; version=0.0.4; charset=utf-8")
            elif self.path == "/healthz":
                self._reply(200, b"ok\n", "text/plain")
            else:
                self._reply(404, b"not found; try /metrics or /healthz\n", "text/plain")

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # keep scrapes out of the server's log
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="kvtier-metrics", daemon=True).start()
    return httpd

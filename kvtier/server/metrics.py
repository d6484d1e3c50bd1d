"""HTTP endpoint of the cache server: ``/metrics`` (Prometheus exposition via ``prometheus_client``)
and ``/healthz``; GET and HEAD.

The module knows nothing of the server: ``start_metrics`` takes a *stats callable* returning a
server ``stats()`` dict (the store's counters, a ``tiers`` list, a ``server`` dict) and reads it
at each scrape. Every metric has HELP and TYPE lines; the registry is owned by the
``MetricsEndpoint`` instance (never prometheus_client's global one) and also carries the
standard ``process_*`` (CPU seconds, resident memory, open fds, start time), ``python_gc_*`` and
``python_info`` collectors.

Metric names (all prefixed ``kvtier_``): store counters (``store_hits_total``,
``store_misses_total``, ``store_promotions_total``, ... one per numeric key of the store's
stats), per tier with a ``tier`` label (counters ``tier_hits_total``, ``tier_misses_total``,
``tier_puts_total``, ``tier_deletes_total``, ``tier_bytes_read_total``,
``tier_bytes_written_total``, ``tier_corrupt_total``, ``tier_errors_total``,
``tier_dropped_total``, ``tier_evictions_total``; gauges ``tier_used_bytes``,
``tier_capacity_bytes``, ``tier_queue_depth``, ``tier_entries``) and the server's own counters
(``server_connections_total``, ``server_rejected_total``, ``server_malformed_total``,
``server_refused_busy_total``, ``server_hello_timeouts_total``, ``server_leases_expired_total``,
``server_lease_quota_total``, ``server_put_quota_total``, ...) and gauges
(``server_connections_open``, ``server_unauthenticated_open``, ``server_leases_open``,
``server_staging_used_bytes``). No secret is ever part of the output.

The HTTP server binds ``host:port`` as given (port 0: a free port; the caller reads the bound one
from ``server_address``) and gives each scrape connection 5 s to send its request. A stats
callable that raises makes that scrape answer 500 with one line; the endpoint keeps serving.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

StatsFn = Callable[[], dict]

PREFIX = "kvtier_"
_TIER_COUNTERS = {
    "hits": "Reads the tier answered with an entry.",
    "misses": "Reads the tier could not answer.",
    "puts": "Entries written to the tier.",
    "deletes": "Entries deleted from the tier.",
    "bytes_read": "Payload bytes read from the tier.",
    "bytes_written": "Payload bytes written to the tier.",
    "corrupt": "Entries that failed their checksum or header check (served as misses).",
    "errors": "Operations of the tier that failed (I/O, connection, timeout).",
    "dropped": "Writes to the tier dropped because its queue was full.",
    "evictions": "Entries evicted from the tier to make room.",
}
_TIER_GAUGES = {
    "used_bytes": "Bytes the tier holds now.",
    "capacity_bytes": "Capacity of the tier in bytes.",
    "queue_depth": "Writes queued for the tier now.",
    "entries": "Entries the tier holds now.",
}
_SERVER_GAUGES = {
    "staging_used_bytes": "Bytes of the shared staging area held by open reservations.",
    "connections_open": "Client connections open now.",
    "unauthenticated_open": "Connections open now that have not completed hello.",
    "leases_open": "Read leases held by clients now.",
}
_REQUEST_TIMEOUT_S = 5.0


class StatsCollector(Collector):
    """A prometheus_client collector over a stats callable: one snapshot per scrape."""

    def __init__(self, stats: StatsFn):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        """The metric families of one ``stats()`` snapshot (see the module docstring)."""
        return iter(families(self._stats()))


def families(stats: dict[str, Any]) -> list[Metric]:
    """The metric families of a server ``stats()`` dict: store counters, per-tier counters and
    gauges (``tier`` label), server counters and gauges. Non-numeric values are skipped."""
    out: list[Metric] = []
    for name, value in stats.items():
        if _numeric(value):
            out.append(CounterMetricFamily(f"{PREFIX}store_{name}", f"Store counter {name}.", value=value))
    tiers = [t for t in stats.get("tiers", []) if isinstance(t, dict)]
    for table, family in ((_TIER_COUNTERS, CounterMetricFamily), (_TIER_GAUGES, GaugeMetricFamily)):
        for name, doc in table.items():
            samples = [(str(t.get("name", "")), t[name]) for t in tiers if _numeric(t.get(name))]
            if samples:
                metric = family(f"{PREFIX}tier_{name}", doc, labels=["tier"])
                for tier, value in samples:
                    metric.add_metric([tier], value)
                out.append(metric)
    for name, value in (stats.get("server") or {}).items():
        if not _numeric(value):
            continue
        if name in _SERVER_GAUGES:
            out.append(GaugeMetricFamily(f"{PREFIX}server_{name}", _SERVER_GAUGES[name], value=value))
        else:
            out.append(CounterMetricFamily(f"{PREFIX}server_{name}", f"Server counter {name}.", value=value))
    return out


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_registry(stats: StatsFn) -> CollectorRegistry:
    """A fresh registry with the stats collector and the process, platform and GC collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class MetricsEndpoint:
    """``/metrics`` and ``/healthz`` over HTTP for one stats callable, in a daemon thread.

    ``server_address`` is the bound (host, port); ``close()`` stops serving and releases the port.
    """

    def __init__(self, stats: StatsFn, host: str, port: int):
        """Bind ``host:port`` and start serving; OSError when the address cannot be bound."""
        self.registry = make_registry(stats)
        self._httpd = ThreadingHTTPServer((host, port), _handler(self.registry))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvtier-metrics", daemon=True)
        self._thread.start()

    @property
    def server_address(self) -> tuple:
        return self._httpd.server_address

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics(stats: StatsFn, host: str, port: int) -> MetricsEndpoint:
    """Serve ``/metrics`` and ``/healthz`` for ``stats`` on ``host:port`` (port 0: any free one).

    Raises OSError when the address cannot be bound (the caller turns it into one line).
    """
    return MetricsEndpoint(stats, host, port)


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = _REQUEST_TIMEOUT_S  # a silent scraper costs one thread for at most this long

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                try:
                    payload = encoder(registry)
                except Exception as exc:  # a failing stats source must not kill the endpoint
                    self._reply(500, f"stats unavailable: {type(exc).__name__}: {exc}\n".encode(), "text/plain", body)
                    return
                self._reply(200, payload, ctype, body)
            elif path == "/healthz":
                self._reply(200, b"ok\n", "text/plain", body)
            else:
                self._reply(404, b"not found; try /metrics or /healthz\n", "text/plain", body)

        def _reply(self, code: int, payload: bytes, ctype: str, body: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, *args) -> None:  # keep scrapes out of the server's log
            pass

    return Handler

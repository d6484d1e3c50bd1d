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
``tier_dropped_total``, ``tier_evictions_total``, ``tier_coded_total``; gauges
``tier_used_bytes``, ``tier_capacity_bytes``, ``tier_queue_depth``, ``tier_entries``; the codec:
``tier_codec_info{codec}`` and, for ``auto``, ``tier_codec_coding``,
``tier_codec_tier_bytes_per_second``, ``tier_codec_tier_latency_seconds``,
``tier_codec_encode_bytes_per_second``, ``tier_codec_decode_bytes_per_second``,
``tier_codec_ratio``; for a coded server arena, gauges ``tier_codec_arena_bytes``,
``tier_codec_arena_free_bytes``, ``tier_codec_stored_bytes``, ``tier_codec_raw_bytes``,
``tier_codec_entries_coded``, ``tier_codec_pending`` and counters ``tier_codec_kept_raw_total``,
``tier_codec_busy_total``, ``tier_codec_queue_full_total``, ``tier_codec_corrupt_total``,
``tier_codec_errors_total``) and the server's own counters
(``server_connections_total``, ``server_rejected_total``, ``server_malformed_total``,
``server_refused_busy_total``, ``server_hello_timeouts_total``, ``server_leases_expired_total``,
``server_lease_quota_total``, ``server_put_quota_total``, ...) and gauges
(``server_connections_open``, ``server_unauthenticated_open``, ``server_leases_open``,
``server_staging_used_bytes``). No secret is ever part of the output.

The HTTP server binds ``host:port`` as given (port 0: a free port; the caller reads the bound one
from ``server_address``). A stats callable that raises makes that scrape answer 500 with one
line; the endpoint keeps serving.

Bounds against slow, many or hostile clients (each connection carries one request):

- at most ``max_connections`` connections are served at once, one thread each (so the endpoint
  never runs more than ``max_connections + 1`` threads); a connection over the cap is answered
  ``503`` from the accept loop without a thread and closed at once;
- a connection has ``request_timeout_s`` in all to send its request and take the answer, however
  slowly its bytes come (the deadline is for the whole request, not per read), and at most
  ``MAX_REQUEST_BYTES`` of request; then it is closed;
- a client that resets its connection, runs past its deadline or sends too much costs one log
  line with the running count, never a traceback; refusals at the cap are logged at most once
  per ``REFUSED_LOG_INTERVAL_S`` with their count.

These are counted in the endpoint's own families: ``kvtier_metrics_refused_total``,
``kvtier_metrics_timeouts_total``, ``kvtier_metrics_resets_total``,
``kvtier_metrics_oversized_total``, ``kvtier_metrics_errors_total``.
"""

from __future__ import annotations

import io
import logging
import socket
import sys
import threading
import time
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
    "coded": "Entries the tier's codec stored coded (the rest are stored raw).",
}
_TIER_GAUGES = {
    "used_bytes": "Bytes the tier holds now.",
    "capacity_bytes": "Capacity of the tier in bytes.",
    "queue_depth": "Writes queued for the tier now.",
    "entries": "Entries the tier holds now.",
}
_SERVER_GAUGES = {
    "staging_used_bytes": "Bytes of the shared staging area held by open reservations.",
    "direct_write_bytes_open": "Arena bytes held by open direct writes (reserved, not yet committed).",
    "connections_open": "Client connections open now.",
    "unauthenticated_open": "Connections open now that have not completed hello.",
    "leases_open": "Read leases held by clients now.",
}
DEFAULT_MAX_CONNECTIONS = 8
DEFAULT_REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024  # a scrape's request line and headers are a few hundred bytes
REFUSED_LOG_INTERVAL_S = 10.0
# How often the accept loop looks for a shutdown request; close() waits up to this long
# (socketserver's default of 0.5 s made every stop of a server take that much longer).
SHUTDOWN_POLL_S = 0.05
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 33\r\n"
         b"Connection: close\r\n\r\nbusy: too many metrics requests\n")

log = logging.getLogger(__name__)


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
    out.extend(_codec_families(tiers))
    for name, value in (stats.get("server") or {}).items():
        if not _numeric(value):
            continue
        if name in _SERVER_GAUGES:
            out.append(GaugeMetricFamily(f"{PREFIX}server_{name}", _SERVER_GAUGES[name], value=value))
        else:
            out.append(CounterMetricFamily(f"{PREFIX}server_{name}", f"Server counter {name}.", value=value))
    return out


# an ``auto`` codec's inputs (``kvtier.codecs.AutoChoice.state``): key -> (metric suffix, help)
_CODEC_GAUGES = {
    "coding": ("coding", "1 while the tier's auto codec codes the chunks it stores (the break-even rule "
               "pays), else 0."),
    "tier_bps": ("tier_bytes_per_second", "The tier's bandwidth the auto codec's rule uses (fitted from its reads, "
                 "else its writes)."),
    "latency_s": ("tier_latency_seconds", "The tier's fixed cost per request in the auto codec's fit (paid "
                  "coded or raw)."),
    "encode_bps": ("encode_bytes_per_second", "The codec's encode speed on one core, as measured here."),
    "decode_bps": ("decode_bytes_per_second", "The codec's decode speed on one core, as measured here."),
    "read_decode_bps": ("read_decode_bytes_per_second", "The codec's decode speed as the tier's readers saw it "
                        "(readers decoding at once share the cores); the auto rule's decode speed once known."),
    "ratio": ("ratio", "Raw over coded bytes of the chunks the codec coded (moving average)."),
    "coded_read_s_per_byte": ("coded_read_seconds_per_byte", "Time per raw byte of the tier's timed re-reads of "
                              "coded entries, decode included (median of the last 15): one side of the measured rule."),
    "raw_read_s_per_byte": ("raw_read_seconds_per_byte", "Time per raw byte of the tier's timed re-reads of raw "
                            "entries (median of the last 15): the other side of the measured rule."),
    # a coded server arena's (``RamTier.codec_state``): its pages, not ``tier_capacity_bytes`` (its
    # raw-byte budget, 16 x the arena), are the limit
    "arena_bytes": ("arena_bytes", "Bytes of a coded arena's pages (its tier_capacity_bytes is a raw-byte budget)."),
    "free_bytes": ("arena_free_bytes", "Bytes in a coded arena's free pages."),
    "stored_bytes": ("stored_bytes", "Bytes a coded arena's entries take in its pages (coded or raw)."),
    "raw_bytes": ("raw_bytes", "Raw bytes of a coded arena's entries."),
    "entries_coded": ("entries_coded", "Entries of a coded arena held coded now."),
    "pending": ("pending", "Entries waiting for a coded arena's coder."),
}
# a coded server arena's coder: key -> help of ``kvtier_tier_codec_<key>_total``
_CODEC_COUNTERS = {
    "kept_raw": "Entries a coded arena's coder left raw: under 4 KiB, or no page saved.",
    "busy": "Times a coded arena's coder found an entry held by a reader (coded after its release).",
    "queue_full": "Entries a coded arena left raw because its coder's queue was full.",
    "corrupt": "Coded entries of the arena that failed to decode in the server.",
    "errors": "Entries a coded arena left raw because its coder failed (logged).",
}


def _codec_families(tiers: list[dict]) -> list[Metric]:
    """``kvtier_tier_codec_info{tier,codec}`` (1) for every tier, and an ``auto`` tier's choice
    and inputs as ``kvtier_tier_codec_*`` gauges (``tier`` label)."""
    states = [(str(t.get("name", "")), t["codec"]) for t in tiers if isinstance(t.get("codec"), dict)]
    if not states:
        return []
    info = GaugeMetricFamily(f"{PREFIX}tier_codec_info", "The tier's codec setting (none, lossless, fp8, auto).",
                             labels=["tier", "codec"])
    for tier, state in states:
        info.add_metric([tier, str(state.get("codec", "none"))], 1)
    out: list[Metric] = [info]
    for key, (suffix, doc) in _CODEC_GAUGES.items():
        samples = [(tier, float(state[key])) for tier, state in states
                   if isinstance(state.get(key), (int, float))]  # bool (coding) included: 0/1
        if samples:
            metric = GaugeMetricFamily(f"{PREFIX}tier_codec_{suffix}", doc, labels=["tier"])
            for tier, value in samples:
                metric.add_metric([tier], value)
            out.append(metric)
    for key, doc in _CODEC_COUNTERS.items():
        samples = [(tier, state[key]) for tier, state in states if _numeric(state.get(key))]
        if samples:
            metric = CounterMetricFamily(f"{PREFIX}tier_codec_{key}", doc, labels=["tier"])
            for tier, value in samples:
                metric.add_metric([tier], value)
            out.append(metric)
    return out


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class EndpointCounters:
    """What the endpoint refused or cut short, by kind (thread-safe)."""

    KINDS = {
        "refused": "Metrics connections answered 503 at once because the endpoint served its maximum.",
        "timeouts": "Metrics connections closed because their request ran past its deadline.",
        "resets": "Metrics connections reset or broken by the client mid-request.",
        "oversized": "Metrics connections closed because their request was larger than allowed.",
        "errors": "Metrics requests that failed otherwise.",
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str) -> int:
        """Count one ``kind``; the new total."""
        with self._lock:
            self._counts[kind] += 1
            return self._counts[kind]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _EndpointCollector(Collector):
    """The endpoint's own counters as ``kvtier_metrics_*_total`` families."""

    def __init__(self, counters: EndpointCounters):
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        """One counter family per kind of ``EndpointCounters``."""
        counts = self._counters.snapshot()
        return iter([CounterMetricFamily(f"{PREFIX}metrics_{kind}", doc, value=counts[kind])
                     for kind, doc in EndpointCounters.KINDS.items()])


def make_registry(stats: StatsFn, counters: EndpointCounters | None = None) -> CollectorRegistry:
    """A fresh registry with the stats collector, the endpoint's own counters (when given) and
    the process, platform and GC collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    if counters is not None:
        registry.register(_EndpointCollector(counters))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class MetricsEndpoint:
    """``/metrics`` and ``/healthz`` over HTTP for one stats callable, in a daemon thread.

    ``server_address`` is the bound (host, port); ``counters`` what was refused or cut short;
    ``close()`` stops serving and releases the port. The bounds are the module docstring's.
    """

    def __init__(self, stats: StatsFn, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        """Bind ``host:port`` and start serving; OSError when the address cannot be bound."""
        if max_connections < 1 or not request_timeout_s > 0:
            raise ValueError("max_connections must be >= 1 and request_timeout_s > 0")
        self.counters = EndpointCounters()
        self.registry = make_registry(stats, self.counters)
        handler = _handler(self.registry, self.counters, request_timeout_s)
        self._httpd = _BoundedHTTPServer((host, port), handler, max_connections, self.counters)
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(SHUTDOWN_POLL_S,), name="kvtier-metrics",
                                        daemon=True)
        self._thread.start()

    @property
    def server_address(self) -> tuple:
        return self._httpd.server_address

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics(stats: StatsFn, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> MetricsEndpoint:
    """Serve ``/metrics`` and ``/healthz`` for ``stats`` on ``host:port`` (port 0: any free one),
    at most ``max_connections`` at once, each request within ``request_timeout_s``.

    Raises OSError when the address cannot be bound (the caller turns it into one line).
    """
    return MetricsEndpoint(stats, host, port, max_connections, request_timeout_s)


class _DeadlineExceeded(TimeoutError):
    """A metrics request ran past its whole-request deadline."""


class _Oversized(Exception):
    """A metrics request sent more than MAX_REQUEST_BYTES."""


class _BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on the connections served at once (checked in the accept
    loop: over it, a 503 without a thread) and one counted log line, no traceback, per failed
    request."""

    daemon_threads = True
    request_queue_size = 128  # the kernel queue: refusals are answered rather than left pending

    def __init__(self, address, handler, max_connections: int, counters: EndpointCounters):
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._counters = counters
        self._refused_logged_at = -REFUSED_LOG_INTERVAL_S
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        """Serve in a thread when a slot is free; else answer 503 without blocking and close."""
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        total = self._counters.add("refused")
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        if now - self._refused_logged_at >= REFUSED_LOG_INTERVAL_S:
            self._refused_logged_at = now
            log.warning("metrics: connection refused, %d requests already being served (%d refused so far)",
                        self._max_connections, total)

    def handle_error(self, request, client_address) -> None:
        """One log line with the running count for the request that failed (no traceback)."""
        count_failure(self._counters, client_address, sys.exc_info()[1])


def count_failure(counters: EndpointCounters, client_address: Any, exc: BaseException | None) -> None:
    """Count a request that failed with ``exc`` by kind and log one line with the running count."""
    peer = _peer(client_address)
    if isinstance(exc, _Oversized):
        log.info("metrics: request from %s larger than %d bytes, closed (%d so far)", peer, MAX_REQUEST_BYTES,
                 counters.add("oversized"))
    elif isinstance(exc, TimeoutError):
        log.info("metrics: request from %s ran past its deadline, closed (%d so far)", peer, counters.add("timeouts"))
    elif isinstance(exc, OSError):  # ConnectionResetError, BrokenPipeError, ...
        log.info("metrics: connection from %s reset mid-request: %s (%d so far)", peer, type(exc).__name__,
                 counters.add("resets"))
    else:
        log.warning("metrics: request from %s failed: %s: %s (%d so far)", peer, type(exc).__name__,
                    str(exc)[:200], counters.add("errors"))


def _peer(client_address: Any) -> str:
    """``host:port`` of a client address tuple."""
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError):
        return str(client_address)


class _DeadlineSocket(io.RawIOBase):
    """A connection's socket as a raw stream whose every read and write must end before one
    deadline (each waits at most the time left), reading at most MAX_REQUEST_BYTES in all."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._deadline = deadline
        self._read = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _arm(self) -> None:
        """Give the next socket call the time left; _DeadlineExceeded when none is."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _DeadlineExceeded("metrics request deadline")
        self._sock.settimeout(left)

    def readinto(self, buffer) -> int:
        if self._read >= MAX_REQUEST_BYTES:
            raise _Oversized(f"more than {MAX_REQUEST_BYTES} bytes")
        self._arm()
        try:
            n = self._sock.recv_into(buffer, min(len(buffer), MAX_REQUEST_BYTES - self._read))
        except socket.timeout as exc:
            raise _DeadlineExceeded("metrics request deadline") from exc
        self._read += n
        return n

    def write(self, data) -> int:
        self._arm()
        try:
            self._sock.sendall(data)
        except socket.timeout as exc:
            raise _DeadlineExceeded("metrics request deadline") from exc
        return len(data)


def _handler(registry: CollectorRegistry, counters: EndpointCounters,
             request_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            """Streams over the connection that share one deadline for the whole request."""
            self.connection = self.request
            raw = _DeadlineSocket(self.connection, time.monotonic() + request_timeout_s)
            self.rfile = io.BufferedReader(raw, buffer_size=4096)
            self.wfile = raw

        def log_error(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
            """http.server reports a request past its deadline here (it catches the TimeoutError
            itself): count it as ``handle_error`` would. Other errors (a 400's) stay unlogged."""
            exc = sys.exc_info()[1]
            if isinstance(exc, TimeoutError):
                count_failure(counters, self.client_address, exc)

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
                    line = f"stats unavailable: {type(exc).__name__}: {str(exc)[:200]}\n"
                    self._reply(500, line.encode(errors="replace"), "text/plain", body)
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

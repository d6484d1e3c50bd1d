"""A TCP proxy on loopback that delays each request by a fixed time (the latency-bound regime).

Each client connection gets its own upstream connection. Client bytes that arrive after the
upstream has answered (or first on a connection) start a new request: the proxy waits
``delay_s`` before forwarding them, as a network round trip would. Responses are not delayed,
unless ``window`` is set: then each connection forwards at most ``window`` response bytes per
``delay_s``, the bandwidth-delay bound of one TCP connection whose window is ``window`` on a path
whose round trip is ``delay_s`` (what caps one GET stream on a real network, and why object-store
clients open many). A response shorter than ``window`` is then not paced at all; ``rate`` (bytes
per second) paces every response at the link's serialization rate instead (a token bucket per
connection, slices of at most half a millisecond of the rate), what a link of that speed takes to
carry a response of any size. ``link_rate`` (bytes per second) paces the responses of all
connections together, as one link they share (a NIC, a switch port): concurrent readers split
it instead of each getting it whole. Threads: two per connection; ``close()`` stops accepting and
shuts every connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from typing import Iterator

_F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity


class DelayProxy:
    """``with DelayProxy(("127.0.0.1", port), 0.015) as p: p.url`` -> ``http://127.0.0.1:PORT``."""

    def __init__(self, upstream: tuple[str, int], delay_s: float, bufsize: int = 1 << 20,
                 window: int | None = None, rate: float | None = None, link_rate: float | None = None):
        if window is not None and (window < 1 or delay_s <= 0):
            raise ValueError("window needs a positive size and a positive delay")
        for name, value in (("rate", rate), ("link_rate", link_rate)):
            if value is not None and (window is not None or not value > 0):
                raise ValueError(f"{name} needs a positive number of bytes per second, and no window")
        if rate is not None and link_rate is not None:
            raise ValueError("rate (per connection) and link_rate (all connections) exclude each other")
        self.upstream, self.delay_s, self.bufsize, self.window = upstream, delay_s, bufsize, window
        self.rate = rate
        self._link = _RatePacer(link_rate) if link_rate is not None else None  # shared by every response pump
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(256)
        self.port = self._srv.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # the pumps, joined at close
        self._closed = threading.Event()
        self.requests = 0
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, up]
            state = {"answered": True}
            pumps = [threading.Thread(target=self._pump, args=(client, up, state, True), daemon=True),
                     threading.Thread(target=self._pump, args=(up, client, state, False), daemon=True)]
            for pump in pumps:
                pump.start()
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + pumps

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, requests: bool) -> None:
        """Forward ``src`` -> ``dst`` with ``os.splice`` through a pipe: the bytes never enter
        Python and the GIL is released, so the proxy costs little CPU beside the kernel's."""
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, self.bufsize)
        except OSError:
            pass  # the default pipe size (64 KiB) still works, only slower
        pace = None
        if not requests and self.window is not None:
            pace = _Pacer(self.window, self.delay_s)
        elif not requests and self.rate is not None:
            pace = _RatePacer(self.rate)
        elif not requests and self._link is not None:
            pace = self._link
        try:
            while True:
                n = os.splice(src.fileno(), w, pace.allowance(self.bufsize) if pace else self.bufsize)
                if not n:
                    break
                if pace:
                    pace.sent(n)
                if requests:
                    if state["answered"]:
                        state["answered"] = False
                        with self._lock:  # one pump thread per connection: count atomically
                            self.requests += 1
                        time.sleep(self.delay_s)  # the injected per-request latency
                else:
                    state["answered"] = True
                while n:
                    n -= os.splice(r, dst.fileno(), n)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting, and end every connection: each socket is shut down before it is
        closed, so a pump blocked in ``splice`` on it returns (a bare close leaves the thread
        blocked on the socket, whose file stays open, and its descriptor number free for reuse)."""
        self._closed.set()
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self._srv.close()
        with self._lock:
            conns, self._conns = self._conns, []
            threads = list(self._threads)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout=2.0)
        for s in conns:
            s.close()

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Pacer:
    """At most ``window`` bytes per ``period`` seconds on one connection (one per pump thread).

    A period starts when its first bytes go (not when the connection last went idle), so a
    response that follows a quiet spell does not get the idle time as free bandwidth.
    """

    def __init__(self, window: int, period: float):
        self.window, self.period = window, period
        self.start = 0.0
        self.used = 0

    def allowance(self, want: int) -> int:
        """Bytes that may go now, up to ``want``; sleeps out the period when the window is used."""
        now = time.monotonic()
        if self.used and now - self.start >= self.period:
            self.used = 0
        elif self.used >= self.window:
            time.sleep(self.start + self.period - now)
            self.used = 0
        return min(want, self.window - self.used)

    def sent(self, n: int) -> None:
        if not self.used:
            self.start = time.monotonic()
        self.used += n


class _RatePacer:
    """At most ``rate`` bytes per second on one link: each slice waits for the time the bytes
    before it took on the link (a schedule, so an oversleep is made up by the next slices, not
    lost); a link idle for longer than one slice starts afresh. Thread-safe: pumps that share
    one pacer share its rate (on average exactly; at most one slice each may go at once)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.slice = max(16 << 10, int(rate * 0.0005))
        self.free_at = 0.0  # when the bytes sent so far will have crossed the link
        self._lock = threading.Lock()

    def allowance(self, want: int) -> int:
        with self._lock:
            now = time.monotonic()
            wait = self.free_at - now
            if wait <= 0 and -wait > self.slice / self.rate:
                self.free_at = now  # idle: the link was free
        if wait > 0:
            time.sleep(wait)
        return min(want, self.slice)

    def sent(self, n: int) -> None:
        with self._lock:
            self.free_at = max(self.free_at, time.monotonic() - self.slice / self.rate) + n / self.rate


def _serve_in_child(port: int, delay_s: float, link_rate: float | None, conn) -> None:
    """``proxy_process``'s child: sends the proxy's port, then runs until the parent sends
    anything or goes away."""
    with DelayProxy(("127.0.0.1", port), delay_s, link_rate=link_rate) as proxy:
        conn.send(proxy.port)
        try:
            conn.recv()
        except EOFError:
            pass


@contextlib.contextmanager
def proxy_process(port: int, delay_s: float, link_rate: float | None = None) -> Iterator[int]:
    """The port of a ``DelayProxy`` (``delay_s`` per request, all responses paced together at
    ``link_rate`` bytes/s) in front of loopback ``port``, run in a child process: its pump threads
    then never wait for the caller's GIL (nor make the caller's timed reads wait for them), which
    in-process moved the benchmarks' ratios by more than the differences they measure."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_child, args=(port, delay_s, link_rate, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the delay proxy process did not start in 60 s")
        yield parent.recv()
    finally:
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()

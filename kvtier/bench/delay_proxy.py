"""A TCP proxy on loopback that delays each request by a fixed time (the latency-bound regime).

Each client connection gets its own upstream connection. Client bytes that arrive after the
upstream has answered (or first on a connection) start a new request: the proxy waits
``delay_s`` before forwarding them, as a network round trip would. Responses are not delayed.
Threads: two per connection; ``close()`` stops accepting and shuts every connection.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time

_F_SETPIPE_SZ = 1031  # Linux fcntl: set a pipe's capacity


class DelayProxy:
    """``with DelayProxy(("127.0.0.1", port), 0.015) as p: p.url`` -> ``http://127.0.0.1:PORT``."""

    def __init__(self, upstream: tuple[str, int], delay_s: float, bufsize: int = 1 << 20):
        self.upstream, self.delay_s, self.bufsize = upstream, delay_s, bufsize
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(256)
        self.port = self._srv.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
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
            threading.Thread(target=self._pump, args=(client, up, state, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, state, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, requests: bool) -> None:
        """Forward ``src`` -> ``dst`` with ``os.splice`` through a pipe: the bytes never enter
        Python and the GIL is released, so the proxy costs little CPU beside the kernel's."""
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, self.bufsize)
        except OSError:
            pass  # the default pipe size (64 KiB) still works, only slower
        try:
            while True:
                n = os.splice(src.fileno(), w, self.bufsize)
                if not n:
                    break
                if requests:
                    if state["answered"]:
                        state["answered"] = False
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
        self._closed.set()
        self._srv.close()
        with self._lock:
            for s in self._conns:
                s.close()
            self._conns = []

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The router's connection guard: a cap on client connections and a deadline on request heads.

aiohttp bounds an idle connection (``keepalive_timeout``) and a request line or header field's
length, but not how long a request head may take to arrive (a client sending a header line every
few seconds holds its connection forever) nor how many connections are open (past the process's
file-descriptor limit, ``accept`` fails in a loop and nothing answers). ``ConnectionGuard`` wraps
the server's protocol factory and adds both:

* At most ``max_connections`` connections. One more arriving closes the connection that has been
  idle (no request in progress, or a request head still arriving) the longest, so a new client
  (a health probe) is still served; when every connection has a request in progress, the new
  one gets ``503`` and is closed at once (nothing is logged per connection; it is counted).
* A request head (line and headers) must be complete within ``header_timeout_s`` of its first
  byte, else the connection is closed (counted).

The router marks when a request's handler starts and ends (``request_started``/``request_ended``
by transport). Everything runs on the event loop; counts go to ``on_close(reason)``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

IDLE, HEAD, BUSY = "idle", "head", "busy"
_BODY = b'{"error": {"message": "too many connections", "type": "router_error", "code": 503}}'
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class _Guarded(asyncio.Protocol):
    """One client connection: forwards every protocol call to aiohttp's handler ``inner``."""

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.state = IDLE
        self.since = time.monotonic()
        self.refused = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard._admit(self):
            self.refused = True
            transport.write(_REFUSAL)  # type: ignore[attr-defined]
            transport.close()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.state == IDLE:
            self._enter(HEAD)
            self._timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._head_late)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.refused:
            return
        self.guard._gone(self)
        self.inner.connection_lost(exc)

    # --- states ------------------------------------------------------------------------------
    def _enter(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_late(self) -> None:
        self._timer = None
        if self.state == HEAD and self.transport is not None:
            self.guard._count("header_timeout")
            self.transport.close()

    def started(self) -> None:
        self._cancel_timer()
        self._enter(BUSY)

    def ended(self) -> None:
        self._enter(IDLE)


class ConnectionGuard:
    """Caps connections and bounds request heads (see the module docstring)."""

    def __init__(self, max_connections: int, header_timeout_s: float,
                 on_close: Callable[[str], None] | None = None) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.on_close = on_close
        self._live: dict[Any, _Guarded] = {}  # transport -> connection

    def factory(self, inner_factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` wrapping aiohttp's ``inner_factory``."""
        return lambda: _Guarded(self, inner_factory())

    def __len__(self) -> int:
        return len(self._live)

    def request_started(self, transport: Any) -> None:
        """A request's handler begins on ``transport`` (its head is complete)."""
        conn = self._live.get(transport)
        if conn is not None:
            conn.started()

    def request_ended(self, transport: Any) -> None:
        """A request's handler returned on ``transport``: the connection is idle again."""
        conn = self._live.get(transport)
        if conn is not None:
            conn.ended()

    def _admit(self, conn: _Guarded) -> bool:
        if len(self._live) >= self.max_connections:
            victim = self._oldest_idle()
            if victim is None:
                self._count("refused")
                return False
            self._count("evicted")
            self._live.pop(victim.transport, None)
            victim.transport.close()  # type: ignore[union-attr]
        self._live[conn.transport] = conn
        return True

    def _oldest_idle(self) -> _Guarded | None:
        waiting = [c for c in self._live.values() if c.state != BUSY]
        return min(waiting, key=lambda c: (c.state != IDLE, c.since), default=None)

    def _gone(self, conn: _Guarded) -> None:
        if self._live.get(conn.transport) is conn:
            del self._live[conn.transport]

    def _count(self, reason: str) -> None:
        if self.on_close is not None:
            self.on_close(reason)


__all__ = ["ConnectionGuard"]

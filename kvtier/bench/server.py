"""``kvtier bench tiers`` target "server": a ``kvtier serve`` subprocess measured through ServerStore.

The server runs as its own process (as in production: engines and server do not share a GIL),
on a unix socket in the benchmark's scratch directory, with a RAM arena large enough for one
pass. ``get_into`` copies an entry out of the shared arena into the caller's buffer, and ``put``
copies the payload straight into arena pages the server reserved (a direct write), so both
figures compare directly with the "memcpy" baseline. The target "server-staging" is the same
server with the client's writes forced through the staging area (two copies: the path before
direct writes), to compare the two in one run. The process is started, polled for
readiness and stopped through ``kvtier.bench.procs`` (it dies with the benchmark).
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.bench.procs import Child, spawn, wait_ready
from kvtier.server.client import ServerStore
from kvtier.server.protocol import ServerRejected

MiB = 1024 * 1024


class ServerTarget:
    """A started server process plus a connected client; ``put``/``get_into``/``delete``/``close``.

    Raises ``ServiceUnavailable`` when the server exits or is not ready within ``timeout`` s,
    ``ServerRejected`` when it refuses the client.
    """

    def __init__(self, workdir: str, capacity: int, page_size: int = 256 * 1024, timeout: float = 30.0,
                 direct_writes: bool = True):
        os.makedirs(workdir, exist_ok=True)
        sock = os.path.join(workdir, "kvtier.sock")
        path = os.path.join(workdir, "serve.json")
        with open(path, "w") as f:
            json.dump(_serve_config(sock, capacity, page_size), f)
        self._child: Child = spawn([sys.executable, "-m", "kvtier.cli", "serve", "--config", path,
                                    "--log-level", "WARNING"], name="kvtier serve",
                                   log=os.path.join(workdir, "serve.log"))
        self.client: ServerStore | None = None
        try:
            self.client = _connect(self._child, sock, timeout, direct_writes)
        except BaseException:
            self._child.stop()
            raise

    def put(self, key: bytes, data) -> bool:
        return self.client.put(key, data)

    def get_into(self, key: bytes, out) -> int | None:
        return self.client.get_into(key, out)

    def delete(self, key: bytes) -> bool:
        return self.client.delete(key)

    def close(self) -> None:
        """Close the client, then stop the server (SIGTERM, SIGKILL after a grace period)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self._child.stop(grace=10.0)


def _serve_config(sock: str, capacity: int, page_size: int) -> dict:
    """``kvtier serve``'s configuration: one LRU RAM arena of ``capacity`` bytes on ``sock``."""
    return {"listen": f"unix://{sock}", "staging": max(64 * MiB, capacity // 4),
            "store": {"tiers": [{"type": "ram", "capacity": capacity, "page_size": page_size,
                                 "policy": "lru"}]}}


def _connect(child: Child, sock: str, timeout: float, direct_writes: bool = True) -> ServerStore:
    """A client connected to the server ``child`` runs on the unix socket ``sock``, polled with
    real handshakes once the socket exists until one succeeds; a refusal (``ServerRejected``) is
    raised at once, not retried."""
    address = f"unix://{sock}"
    found: list[ServerStore | ServerRejected] = []

    def ready() -> bool:
        if not os.path.exists(sock):  # not listening yet: no handshake (the client would log each miss)
            return False
        try:
            client = ServerStore(address, direct_writes=direct_writes)
        except ServerRejected as exc:
            found.append(exc)
            return True
        if not client.connected:
            client.close()
            return False
        found.append(client)
        return True

    wait_ready(child, ready, timeout, f"kvtier serve on {address}", bind_failure=None)
    if isinstance(found[-1], ServerRejected):
        raise found[-1]
    return found[-1]


def server_target(args, workdir: str, entry_bytes: int, count: int, direct_writes: bool = True) -> ServerTarget:
    """Factory for ``kvtier.bench.tiers.TARGETS["server"]`` (and, with ``direct_writes=False``,
    ``"server-staging"``)."""
    name = f"server-{entry_bytes}" if direct_writes else f"server-staging-{entry_bytes}"
    page = _page_for(entry_bytes)
    capacity = count * (-(-entry_bytes // page) * page) + 64 * MiB
    return ServerTarget(os.path.join(workdir, name), capacity, page_size=page, direct_writes=direct_writes)


def _page_for(entry_bytes: int, largest: int = 256 * 1024, os_page: int = 4096) -> int:
    """The arena page for entries of ``entry_bytes``: at most ``largest``, no larger than an entry
    (rounded up to whole OS pages, as direct writes need), so one pass fits the arena."""
    return min(largest, max(os_page, -(-entry_bytes // os_page) * os_page))

"""``kvtier bench tiers`` target "server": a ``kvtier serve`` subprocess measured through ServerStore.

The server runs as its own process (as in production: engines and server do not share a GIL),
on a unix socket in the benchmark's scratch directory, with a RAM arena large enough for one
pass. ``get_into`` copies an entry out of the shared arena into the caller's buffer, so its
figure compares directly with the "memcpy" baseline. The process is started, polled for
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

    def __init__(self, workdir: str, capacity: int, page_size: int = 256 * 1024, timeout: float = 30.0):
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
            self.client = _connect(self._child, sock, timeout)
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


def _connect(child: Child, sock: str, timeout: float) -> ServerStore:
    """A client connected to the server ``child`` runs on the unix socket ``sock``, polled with
    real handshakes once the socket exists until one succeeds; a refusal (``ServerRejected``) is
    raised at once, not retried."""
    address = f"unix://{sock}"
    found: list[ServerStore | ServerRejected] = []

    def ready() -> bool:
        if not os.path.exists(sock):  # not listening yet: no handshake (the client would log each miss)
            return False
        try:
            client = ServerStore(address)
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


def server_target(args, workdir: str, entry_bytes: int, count: int) -> ServerTarget:
    """Factory for ``kvtier.bench.tiers.TARGETS["server"]``."""
    return ServerTarget(os.path.join(workdir, f"server-{entry_bytes}"), count * entry_bytes + 64 * MiB)

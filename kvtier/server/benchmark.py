"""``kvtier bench tiers`` target "server": a ``kvtier serve`` subprocess measured through ServerStore.

The server runs as its own process (as in production: engines and server do not share a GIL),
on a unix socket in the benchmark's scratch directory, with a RAM arena large enough for one
pass. ``get_into`` copies an entry out of the shared arena into the caller's buffer, so its
figure compares directly with the "memcpy" baseline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from kvtier.bench.services import ServiceUnavailable
from kvtier.server import protocol as P
from kvtier.server.client import ServerStore

MiB = 1024 * 1024


class ServerTarget:
    """A started server process plus a client; ``put``/``get_into``/``delete``/``close``."""

    def __init__(self, workdir: str, capacity: int, page_size: int = 256 * 1024, timeout: float = 30.0):
        os.makedirs(workdir, exist_ok=True)
        sock = os.path.join(workdir, "kvtier.sock")
        config = {"listen": f"unix://{sock}", "staging": max(64 * MiB, capacity // 4),
                  "store": {"tiers": [{"type": "ram", "capacity": capacity, "page_size": page_size,
                                       "policy": "lru"}]}}
        path = os.path.join(workdir, "serve.json")
        with open(path, "w") as f:
            json.dump(config, f)
        self._log = open(os.path.join(workdir, "serve.log"), "ab")
        self._proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", path,
                                       "--log-level", "WARNING"], stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        self.client = None
        while self.client is None:  # poll readiness with real handshakes
            if self._proc.poll() is not None:
                raise ServiceUnavailable(f"kvtier serve exited with code {self._proc.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise ServiceUnavailable(f"kvtier serve not ready after {timeout:.0f} s")
            if os.path.exists(sock):
                try:
                    self.client = ServerStore(f"unix://{sock}")
                    if not self.client.connected:
                        self.client.close()
                        self.client = None
                except P.ServerRejected:
                    raise
            if self.client is None:
                time.sleep(0.02)  # polling interval

    def put(self, key: bytes, data) -> bool:
        return self.client.put(key, data)

    def get_into(self, key: bytes, out) -> int | None:
        return self.client.get_into(key, out)

    def delete(self, key: bytes) -> bool:
        return self.client.delete(key)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


def server_target(args, workdir: str, entry_bytes: int, count: int) -> ServerTarget:
    """Factory for ``kvtier.bench.tiers.TARGETS["server"]``."""
    return ServerTarget(os.path.join(workdir, f"server-{entry_bytes}"), count * entry_bytes + 64 * MiB)

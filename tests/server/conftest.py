"""Fixtures: real ``kvtier serve`` processes on a unix socket (or TCP) in a temp dir."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.server import protocol as P


class ServerProcess:
    """A ``kvtier serve`` subprocess; ``start``/``kill``/``restart`` keep the same address."""

    def __init__(self, workdir: Path, config: dict):
        self.workdir = workdir
        self.config = config
        self.address = config["listen"]
        self.token = config.get("token")
        self.proc: subprocess.Popen | None = None
        self.config_path = workdir / "serve.yaml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log = workdir / "serve.log"

    def start(self, timeout: float = 30.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(self.config_path)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        delay = 0.02
        while not self._hello_ok():  # poll readiness with a real handshake
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve not ready: {self.log.read_text()[-2000:]}")
            time.sleep(delay)  # polling interval
            delay = min(delay * 1.5, 0.2)

    def _hello_ok(self) -> bool:
        family, where = P.parse_address(self.address)
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(2.0)
                s.connect(where)
                P.send(s, {"op": "hello", "version": P.VERSION, "token": self.token})
                reply = P.recv(s)
                return bool(reply and reply.get("ok"))
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL (no clean shutdown), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def make_server(tmp_path):
    """``make_server(**overrides)`` -> a started ServerProcess (stopped at teardown)."""
    started = []

    def make(tiers=None, **overrides) -> ServerProcess:
        n = len(started)
        config = {
            "listen": f"unix://{tmp_path}/kvtier-{n}.sock",
            "metrics": f"127.0.0.1:{free_port()}",
            "staging": "32MiB",
            "store": {"tiers": tiers or [{"type": "ram", "capacity": "64MiB", "page_size": "64KiB"}]},
            **overrides,
        }
        workdir = tmp_path / f"server-{n}"
        workdir.mkdir()
        server = ServerProcess(workdir, config)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()

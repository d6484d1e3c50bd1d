"""Fixtures: real ``kvtier serve`` processes on a unix socket (or TCP) in a temp dir.

Readiness is the server's own ready line (printed once every listener accepts connections),
and the addresses are the ones it reports there: ports are bound as 0 by the server itself,
never picked here and hoped free. Each server process gets a parent-death signal, so a test
run killed from outside does not leave servers behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

READY = re.compile(r"kvtier serve: ready on (\S+?)(?:, metrics http://(\S+))?$", re.M)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """A ``kvtier serve`` subprocess; ``start``/``kill``/``stop`` keep the same config.

    ``address`` and ``metrics_address`` are what the server's ready line reports.
    """

    def __init__(self, workdir: Path, config: dict):
        self.workdir = workdir
        self.config = config
        self.address = config.get("listen")
        self.metrics_address: str | None = None
        self.token = config.get("token")
        self.proc: subprocess.Popen | None = None
        self.config_path = workdir / "serve.yaml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log = workdir / "serve.log"

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait for the ready line; RuntimeError naming the log if it exits or is late."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process without waiting."""
        self._log_offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(self.config_path)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent)

    def output(self) -> str:
        """What this start of the process has logged so far."""
        with open(self.log, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            match = READY.search(self.output())
            if match:
                self.address, self.metrics_address = match.group(1), match.group(2)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier serve exited ({self.proc.returncode}); log {self.log}: "
                                   f"{self.output()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve not ready after {timeout:.0f} s; log {self.log}: "
                                   f"{self.output()[-2000:]}")
            time.sleep(delay)  # polling interval
            delay = min(delay * 1.5, 0.2)

    def kill(self) -> None:
        """SIGKILL (no clean shutdown), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a test may have left it stopped
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


def free_port() -> int:
    """A port free right now (only for third-party servers that cannot bind port 0 themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_config(tmp_path):
    """``server_config(n, tiers=None, **overrides)`` -> the config dict ``make_server`` uses."""

    def config(n: int = 0, tiers=None, **overrides) -> dict:
        return {
            "listen": f"unix://{tmp_path}/kvtier-{n}.sock",
            "metrics": "127.0.0.1:0",
            "staging": "32MiB",
            "store": {"tiers": tiers or [{"type": "ram", "capacity": "64MiB", "page_size": "64KiB"}]},
            **overrides,
        }

    return config


@pytest.fixture
def make_server(tmp_path, server_config):
    """``make_server(**overrides)`` -> a started ServerProcess (stopped at teardown)."""
    started = []

    def make(tiers=None, **overrides) -> ServerProcess:
        n = len(started)
        workdir = tmp_path / f"server-{n}"
        workdir.mkdir()
        server = ServerProcess(workdir, server_config(n, tiers, **overrides))
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()

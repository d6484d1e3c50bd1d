"""``kvtier route`` as a process: the ready line, health going to 503 when its only engine never
answers, a clean exit on SIGTERM, and a one-line error when the port is taken."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvtier.harness.procs import spawn
from kvtier.harness.services import free_port


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            json.loads(resp.read())
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_route_process_ready_health_and_sigterm(tmp_path):
    port, dead = free_port(), free_port()
    log = tmp_path / "route.log"
    child = spawn([sys.executable, "-m", "kvtier", "route", "--engine", f"http://127.0.0.1:{dead}",
                   "--port", str(port)], log=log)
    try:
        deadline = time.monotonic() + 30
        while "ready on" not in log.read_text():
            assert child.alive and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert f"kvtier route: ready on http://127.0.0.1:{port}" in log.read_text()
        deadline = time.monotonic() + 10
        while _health(port) != 503:  # the engine never answers: out after two failed probes
            assert time.monotonic() < deadline
            time.sleep(0.2)
        child.popen.send_signal(signal.SIGTERM)
        assert child.popen.wait(timeout=10) == 0
    finally:
        child.stop()


def test_route_port_in_use_is_one_line(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvtier", "route", "--engine", "http://127.0.0.1:1",
                              "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("kvtier route: error: cannot listen on")

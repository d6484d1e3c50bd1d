"""LMCache's multiprocess server as a baseline for ``kvtier demo`` (the "lmcache-mp" setting).

LMCache is not a dependency of kvtier (it pulls CUDA packages): it lives in a separate
virtualenv whose interpreter the caller names (``--lmcache-python``). This module checks that
interpreter, starts ``lmcache server`` from the same ``bin`` directory on free loopback ports
with an L1 RAM cache of a given size (LRU, engine-driven transfers through a uniquely named
shared-memory segment), waits until its HTTP health check answers, and stops its whole process
group afterwards. ``kv_transfer_config`` is the vLLM side: the LMCacheMPConnector pointed at it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from kvtier.errors import ConfigError, KVTierError

HOST = "127.0.0.1"


def check_python(python: str | None) -> str:
    """The interpreter to run the lmcache-mp engine with; ConfigError in one line if unusable."""
    if not python:
        raise ConfigError("setting 'lmcache-mp' needs --lmcache-python PATH (or KVTIER_LMCACHE_PYTHON): "
                          "the python of a virtualenv with vllm and lmcache installed")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ConfigError(f"--lmcache-python {python}: not an executable file")
    probe = subprocess.run([python, "-c", "import lmcache, lmcache.integration.vllm, vllm"],
                           capture_output=True, text=True, env=dict(os.environ, LMCACHE_DISABLE_BANNER="1"))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["exit status %d" % probe.returncode])[-1]
        raise ConfigError(f"--lmcache-python {python}: cannot import lmcache and vllm ({last})")
    if not (Path(python).parent / "lmcache").is_file():
        raise ConfigError(f"--lmcache-python {python}: no 'lmcache' command beside it")
    return python


def repo_root() -> str:
    """The directory that holds the ``kvtier`` package, for another interpreter's PYTHONPATH."""
    import kvtier

    return str(Path(kvtier.__file__).resolve().parent.parent)


def engine_env(env: dict) -> dict:
    """``env`` with kvtier importable by the lmcache interpreter (kvtier's own root first)."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join([repo_root()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out.setdefault("LMCACHE_DISABLE_BANNER", "1")
    return out


def kv_transfer_config(port: int, host: str = HOST) -> dict:
    """vLLM's ``kv_transfer_config`` for the LMCacheMPConnector talking to a server on ``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port)}}


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LMCacheServer:
    """``lmcache server`` in its own process group; use as a context manager.

    ``l1_bytes`` is the L1 (RAM) capacity in bytes; LMCache takes GiB (``--l1-size-gb``, a
    float, times 2**30), so the two name the same number of bytes.
    """

    def __init__(self, python: str, l1_bytes: int, log_path: str | os.PathLike, *,
                 ready_timeout_s: float = 180.0, env: dict | None = None):
        self.lmcache = str(Path(python).parent / "lmcache")  # the venv's bin dir; no symlink resolving
        self.l1_bytes = int(l1_bytes)
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(env if env is not None else os.environ)
        self.env.setdefault("LMCACHE_DISABLE_BANNER", "1")
        self.shm_name = f"kvtier-lmcache-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # picked now so that kv_transfer_config() is known before start()
        self.port, self.http_port, self.prometheus_port = _free_ports(3)
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [self.lmcache, "server", "--host", HOST, "--port", str(self.port),
                "--http-host", HOST, "--http-port", str(self.http_port),
                "--prometheus-port", str(self.prometheus_port),
                "--l1-size-gb", repr(self.l1_bytes / (1 << 30)), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name]

    def kv_transfer_config(self) -> dict:
        return kv_transfer_config(self.port)

    @staticmethod
    def engine_env(env: dict) -> dict:
        """The environment of the engine process that uses this server (kvtier importable)."""
        return engine_env(env)

    def start(self) -> "LMCacheServer":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        url = f"http://{HOST}:{self.http_port}/healthcheck"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200 and json.loads(resp.read() or b"{}").get("status") == "healthy"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1):
                return True
        except OSError:
            return False

    def _wait_ready(self) -> None:
        """Poll until the HTTP health check says healthy and the request port accepts connections."""
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.05
        while True:
            if self.proc.poll() is not None:
                raise KVTierError(f"lmcache server exited with status {self.proc.returncode} before it was ready:\n"
                                  + self._log_tail())
            if self._healthy() and self._port_open():
                return
            if time.monotonic() > deadline:
                raise KVTierError(f"lmcache server not ready after {self.ready_timeout_s:.0f} s:\n" + self._log_tail())
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``timeout_s``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # start_new_session: the group id is the server's pid
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the leader is gone; children in its group may remain: kill them too
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue
        shm = Path("/dev/shm") / self.shm_name
        if shm.exists():  # a segment a killed server could not unlink
            try:
                shm.unlink()
            except OSError:
                pass

    def __enter__(self) -> "LMCacheServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

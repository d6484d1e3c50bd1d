"""LMCache's multiprocess server as a baseline for ``kvtier demo`` (the "lmcache-mp" setting).

LMCache is not a dependency of kvtier (it pulls CUDA packages): it lives in a separate
virtualenv whose interpreter the caller names (``--lmcache-python``). This module checks that
interpreter, starts ``lmcache server`` from the same ``bin`` directory on loopback ports with an
L1 RAM cache of a given size (LRU, engine-driven transfers through a uniquely named shared-memory
segment) through ``kvtier.harness.procs`` (it dies with this process, even on SIGKILL), waits until
its HTTP health check answers and its request port accepts connections, retries on new ports
when one was taken, and stops its whole process group afterwards. ``kv_transfer_config`` (known
once started) is the vLLM side: the LMCacheMPConnector pointed at it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from kvtier.harness.procs import Child, run_child, spawn, start_on_ports, wait_ready
from kvtier.errors import ConfigError

HOST = "127.0.0.1"


def check_python(python: str | None) -> str:
    """The interpreter to run the lmcache-mp engine with; ConfigError in one line if unusable."""
    if not python:
        raise ConfigError("setting 'lmcache-mp' needs --lmcache-python PATH (or KVTIER_LMCACHE_PYTHON): "
                          "the python of a virtualenv with vllm and lmcache installed")
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ConfigError(f"--lmcache-python {python}: not an executable file")
    try:
        probe = run_child([python, "-c", "import lmcache, lmcache.integration.vllm, vllm"], timeout=300,
                          env=dict(os.environ, LMCACHE_DISABLE_BANNER="1"), name="lmcache import check")
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"--lmcache-python {python}: importing lmcache and vllm took over 300 s") from exc
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


class LMCacheServer:
    """``lmcache server`` in its own process group; use as a context manager.

    ``l1_bytes`` is the L1 (RAM) capacity in bytes; LMCache takes GiB (``--l1-size-gb``, a
    float, times 2**30), so the two name the same number of bytes. The ports are chosen by
    ``start`` (again on a retry), so ``kv_transfer_config`` is known only once it is running.
    """

    PORTS = 3  # request, HTTP (health check), Prometheus

    def __init__(self, python: str, l1_bytes: int, log_path: str | os.PathLike, *,
                 ready_timeout_s: float = 180.0, env: dict | None = None):
        self.lmcache = str(Path(python).parent / "lmcache")  # the venv's bin dir; no symlink resolving
        self.l1_bytes = int(l1_bytes)
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(env if env is not None else os.environ)
        self.env.setdefault("LMCACHE_DISABLE_BANNER", "1")
        self.shm_name = f"kvtier-lmcache-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.port = self.http_port = self.prometheus_port = 0
        self.child: Child | None = None

    def command(self) -> list[str]:
        return [self.lmcache, "server", "--host", HOST, "--port", str(self.port),
                "--http-host", HOST, "--http-port", str(self.http_port),
                "--prometheus-port", str(self.prometheus_port),
                "--l1-size-gb", repr(self.l1_bytes / (1 << 30)), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven", "--shm-name", self.shm_name]

    def kv_transfer_config(self) -> dict:
        """The LMCacheMPConnector's config for this server; RuntimeError before ``start``."""
        if not self.port:
            raise RuntimeError("LMCacheServer.kv_transfer_config: start the server first (its ports are chosen then)")
        return kv_transfer_config(self.port)

    @staticmethod
    def engine_env(env: dict) -> dict:
        """The environment of the engine process that uses this server (kvtier importable)."""
        return engine_env(env)

    def start(self) -> "LMCacheServer":
        """Start the server and wait until it is ready (retried on new ports if one was taken);
        ``ServiceUnavailable`` naming the server and its log tail if it never gets ready."""
        self.log_path.write_bytes(b"")
        start_on_ports(self._start_on, self.PORTS, "lmcache server")
        return self

    def _start_on(self, ports: list[int]) -> None:
        self.port, self.http_port, self.prometheus_port = ports
        self.child = spawn(self.command(), name="lmcache server", log=self.log_path, env=self.env)
        try:
            wait_ready(self.child, lambda: self._healthy() and self._port_open(), self.ready_timeout_s,
                       f"lmcache server (port {self.port}, http {self.http_port})")
        except BaseException:
            self.stop()
            raise

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

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``timeout_s``; unlink
        a shared-memory segment a killed server left."""
        child, self.child = self.child, None
        if child is not None:
            child.stop(grace=timeout_s)
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

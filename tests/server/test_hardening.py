"""Hardening of ``kvtier serve`` and its client (issue 9, items 6-11 and 13; issue 15's readiness).

Every test runs real ``kvtier serve`` processes (or, for the trust checks, a small fake server
that answers ``hello`` with files of its choice) and states in its name what it proves.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES
from kvtier.server import ServeConfig, ServerStore, UntrustedServer
from kvtier.server import protocol as P
from kvtier.server.server import CacheServer, ServeError, default_listen
from tests.server.conftest import ServerProcess

REPO = Path(kvtier.__file__).resolve().parent.parent
SMALL_RAM = [{"type": "ram", "capacity": "4MiB", "page_size": "64KiB"}]


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * (KEY_BYTES // 4)


def _payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8)


def _raw(address: str, timeout: float = 5.0) -> socket.socket:
    family, where = P.parse_address(address)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(where)
    return s


def _hello(s: socket.socket, token: str | None = None) -> dict:
    P.send(s, {"op": "hello", "version": P.VERSION, "token": token})
    reply = P.recv(s)
    assert reply and reply["ok"], reply
    return reply


def _proc_status(pid: int, field: str) -> int:
    """A number from /proc/PID/status (VmRSS in KiB, Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``s`` within ``timeout`` s (replies before the end are skipped)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _serve_once(config_path: Path, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run a ``kvtier serve`` expected to refuse to start; its exit status and output."""
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config_path)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ------------------------------------------------------------------ 7: default listen, socket dir


def test_default_listen_is_a_private_runtime_dir_never_tmp(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_listen() == "unix:///run/kvtier/kvtier.sock"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_listen() == f"unix://{tmp_path}/kvtier/kvtier.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_listen() == "unix:///run/kvtier/kvtier.sock"
    assert not ServeConfig().listen.startswith("unix:///tmp/")


def _inprocess(tmp_path: Path, listen: str, **overrides) -> CacheServer:
    config = ServeConfig.from_mapping({"listen": listen, "staging": "1MiB", "shm_dir": str(tmp_path),
                                       "store": {"tiers": SMALL_RAM}, **overrides})
    return CacheServer(config)


def test_socket_dir_is_created_0700_and_an_unsafe_one_is_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    with _inprocess(shm, f"unix://{tmp_path}/run/kvtier/k.sock") as server:
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "kvtier").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "run" / "kvtier" / "k.sock").st_mode) == 0o600
        assert ServerStore(server.address).lookup([_key(1)]) == 0
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o1777)  # like /tmp: anyone could bind the path first
    server = _inprocess(shm, f"unix://{open_dir}/k.sock")
    with pytest.raises(ServeError, match=r"writable by other users \(mode 1777\)"):
        server.start()
    server.close()
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    server = _inprocess(shm, f"unix://{foreign}/k.sock")
    with pytest.raises(ServeError, match="belongs to uid 65534"):
        server.start()
    server.close()
    assert not os.listdir(shm)  # the refused servers left no shared-memory file behind


# ------------------------------------------------------------------ 7: peer credentials, shm files


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_client_refuses_a_server_of_another_uid_unless_allowed(server_config):
    """A server running as uid 65534: the client refuses it (before sending its token) unless
    ``allowed_uids`` names that uid."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-uid-"))  # pytest's own tree is closed to other users
    base.chmod(0o711)
    run = base / "other"
    run.mkdir(mode=0o700)
    os.chown(run, 65534, 65534)
    workdir = base / "work"
    workdir.mkdir()
    workdir.chmod(0o777)
    config = server_config(listen=f"unix://{run}/kvtier.sock", metrics=None)
    server = ServerProcess(workdir, config)
    server.config_path.chmod(0o644)
    server._log_offset = 0
    with open(server.log, "ab") as out:
        server.proc = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-m", "kvtier.cli", "serve", "--config", str(server.config_path)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    try:
        server.wait_ready()
        with pytest.raises(UntrustedServer, match="runs as uid 65534"):
            ServerStore(server.address)
        with ServerStore(server.address, allowed_uids=[65534]) as client:
            assert client.put(_key(1), _payload(1, 1000)) and client.get(_key(1)) == _payload(1, 1000).tobytes()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


class _FakeServer:
    """A unix-socket peer that answers every hello with the shared-memory files it was given."""

    def __init__(self, path: str, arena: Path, staging: Path, size: int):
        self.reply = {"ok": True, "version": P.VERSION, "server_id": "fake", "page_size": 4096, "tiers": ["ram"],
                      "arena": {"path": str(arena), "size": size}, "staging": {"path": str(staging), "size": size}}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    P.recv(conn)
                    P.send(conn, self.reply)
                    P.recv(conn)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("problem", ["writable by others", "another owner", "symlink"])
def test_client_refuses_shared_memory_files_it_must_not_trust(tmp_path, problem):
    arena, staging = tmp_path / "arena", tmp_path / "staging"
    for f in (arena, staging):
        f.write_bytes(bytes(65536))
        f.chmod(0o600)
    if problem == "writable by others":
        arena.chmod(0o666)
        match = "writable by group or others"
    elif problem == "another owner":
        os.chown(staging, 65534, 65534)
        match = "belongs to uid 65534"
    else:
        target = tmp_path / "target"
        arena.rename(target)
        arena.symlink_to(target)
        match = "cannot open"
    fake = _FakeServer(str(tmp_path / "fake.sock"), arena, staging, 65536)
    try:
        with pytest.raises(UntrustedServer, match=match):
            ServerStore(f"unix://{tmp_path}/fake.sock")
    finally:
        fake.close()


# ------------------------------------------------------------------ 10: read-only arena


def test_client_maps_the_arena_read_only(make_server):
    server = make_server()
    with ServerStore(server.address) as client:
        assert client.put(_key(1), _payload(1, 100_000))
        arena = client._map.arena
        with pytest.raises(ValueError, match="read-only"):
            arena[0] = 1
        with pytest.raises(ValueError):
            arena.flags.writeable = True  # a read-only buffer (PROT_READ too without direct writes)
        seen = []

        def consume(segs):
            with pytest.raises(ValueError):
                segs[0].flags.writeable = True
            seen.append(b"".join(s.tobytes() for s in segs))

        assert client.read(_key(1), consume) == "ram" and seen == [_payload(1, 100_000).tobytes()]
        assert client._map.staging.flags.writeable  # writes still go through staging


# ------------------------------------------------------------------ 11: the listen path


def test_second_server_on_a_live_path_refuses_and_the_first_keeps_serving(make_server, tmp_path):
    first = make_server()
    second = tmp_path / "second.yaml"
    second.write_text(first.config_path.read_text())
    done = _serve_once(second)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already answering on" in lines[0] and f"pid {first.proc.pid}" in lines[0], done.stderr
    with ServerStore(first.address) as client:
        assert client.put(_key(1), _payload(1, 10)) and client.lookup([_key(1)]) == 1


def test_stale_socket_is_replaced(make_server, tmp_path):
    path = tmp_path / "kvtier-0.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: what a killed server leaves
    server = make_server()
    with ServerStore(server.address) as client:
        assert client.lookup([_key(1)]) == 0 and client.connected


def test_regular_file_at_the_listen_path_is_never_deleted(tmp_path, server_config):
    path = tmp_path / "kvtier-0.sock"
    path.write_text("an operator's file\n")
    config = tmp_path / "serve.yaml"
    config.write_text(__import__("json").dumps(server_config()))
    done = _serve_once(config)
    assert done.returncode == 2
    assert "exists and is a regular file, not a socket" in done.stderr, done.stderr
    assert path.read_text() == "an operator's file\n"


def test_stop_removes_only_the_socket_this_server_bound(make_server):
    first = make_server()
    path = first.address[len("unix://"):]
    os.unlink(path)  # someone else now owns the path
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    other.listen(1)
    inode = os.stat(path).st_ino
    first.stop()
    assert os.stat(path).st_ino == inode  # not ours: left alone
    other.close()
    os.unlink(path)
    second = make_server()
    second_path = second.address[len("unix://"):]
    second.stop()
    assert not os.path.exists(second_path)  # ours: removed


# ------------------------------------------------------------------ 8: unauthenticated clients


def test_huge_length_before_hello_is_refused_without_allocating(make_server):
    server = make_server()
    pid = server.proc.pid
    with ServerStore(server.address) as good:
        assert good.put(_key(1), _payload(1, 10_000))
        rss0 = _proc_status(pid, "VmRSS")
        socks = []
        for _ in range(40):
            s = _raw(server.address)
            s.sendall(struct.pack(">I", P.MAX_FRAME))  # 8 MiB announced, nothing sent
            socks.append(s)
        for s in socks:
            reply = P.recv(s)
            assert reply["error"] == P.MALFORMED and str(P.MAX_HELLO_FRAME) in reply["message"]
            assert _closed_by_peer(s, 5.0)
            s.close()
        assert _proc_status(pid, "VmRSS") - rss0 < 16 * 1024  # KiB: nowhere near 40 x 8 MiB
        assert good.get(_key(1)) == _payload(1, 10_000).tobytes()


def test_idle_connections_over_the_cap_are_refused_while_a_client_is_served(make_server):
    server = make_server(listen="tcp://127.0.0.1:0", token="t", max_connections=8, max_unauthenticated=4,
                         hello_timeout_s=30)
    pid = server.proc.pid
    with ServerStore(server.address, token="t") as good:
        assert good.put(_key(1), _payload(1, 1000))
        idle = [_raw(server.address) for _ in range(100)]
        busy = 0
        for s in idle:
            s.settimeout(0.5)
            try:
                reply = P.recv(s)
            except TimeoutError:
                continue  # admitted, waiting for its hello
            busy += reply is not None and reply["error"] == P.BUSY
        assert busy >= 100 - 4
        assert _proc_status(pid, "Threads") < 4 + 20  # no thread per refused connection
        assert good.lookup([_key(1)]) == 1 and good.get(_key(1)) == _payload(1, 1000).tobytes()
        stats = good.stats()["server"]
        assert stats["refused_busy"] >= 96 and stats["unauthenticated_open"] <= 4
        for s in idle:
            s.close()


def test_a_silent_client_is_disconnected_after_the_hello_deadline(make_server):
    server = make_server(hello_timeout_s=0.5, max_unauthenticated=2)
    silent = _raw(server.address)
    trickle = _raw(server.address)
    trickle.sendall(struct.pack(">I", 100))
    started = time.monotonic()
    try:
        for _ in range(50):  # a byte at a time does not extend the deadline
            trickle.sendall(b"\x80")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed by the server while trickling
    assert _closed_by_peer(silent, 5.0) and _closed_by_peer(trickle, 5.0)
    assert time.monotonic() - started < 4.0  # 0.5 s deadline, not 5 s of trickling
    with ServerStore(server.address) as client:  # the slots are free again
        assert client.connected and client.stats()["server"]["hello_timeouts"] >= 2


# ------------------------------------------------------------------ 9: quotas and lease timeouts


def test_a_client_holding_staging_cannot_block_the_others(make_server):
    server = make_server(staging="8MiB", client_staging_fraction=0.25)
    hog = _raw(server.address)
    _hello(hog)
    held = 0
    for i in range(100, 140):  # reserve as much as it is given, never commit
        P.send(hog, {"op": "reserve", "key": _key(i), "nbytes": 1 << 20, "parent": None, "chunk_index": 0})
        reply = P.recv(hog)
        if reply["status"] != "ok":
            assert reply["status"] == "quota"
            break
        held += 1
    assert held == 2  # 25% of 8 MiB
    with ServerStore(server.address) as other:
        assert sum(other.put(_key(i), _payload(i, 1 << 20)) for i in range(30)) == 30
        assert other.stats()["server"]["put_quota"] >= 1
    hog.close()


def test_lease_cap_and_timeout_release_pages_of_a_deleted_entry(make_server):
    server = make_server(tiers=[{"type": "ram", "capacity": "1MiB", "page_size": "64KiB"}],
                         lease_timeout_s=1.0, max_leases_per_client=4)
    with ServerStore(server.address) as client:
        assert client.put(_key(1), _payload(1, 512 << 10))
        pinner = _raw(server.address)
        assert _hello(pinner)["lease_timeout_s"] == 1.0
        tiers = []
        for _ in range(6):  # get without release
            P.send(pinner, {"op": "get", "key": _key(1)})
            tiers.append(P.recv(pinner)["tier"])
        assert tiers == ["ram"] * 4 + [None] * 2  # at most 4 leases per client
        assert client.delete(_key(1))
        # the deleted entry's pages are pinned: 768 KiB do not fit in the 1 MiB arena
        assert not client.put(_key(2), _payload(2, 768 << 10))
        deadline = time.monotonic() + 10
        while not client.put(_key(2), _payload(2, 768 << 10)):  # released after the lease timeout
            assert time.monotonic() < deadline, "leases never expired"
            time.sleep(0.2)
        stats = client.stats()["server"]
        assert stats["leases_expired"] == 4 and stats["lease_quota"] == 2 and stats["leases_open"] == 0
        pinner.close()


def test_a_read_that_outlasts_its_lease_is_a_miss(make_server):
    server = make_server(lease_timeout_s=0.3)
    with ServerStore(server.address) as client:
        assert client.put(_key(1), _payload(1, 1000))
        assert client.read(_key(1), lambda segs: time.sleep(0.5)) is None
        assert client.stats()["client"]["lease_expired"] == 1
        assert client.read(_key(1), lambda segs: None) == "ram"  # a prompt read is still a hit


# ------------------------------------------------------------------ 6: keys at the protocol


def test_keys_of_a_wrong_length_get_an_error_and_the_session_goes_on(make_server, tmp_path):
    tiers = [{"type": "ram", "capacity": "4MiB", "page_size": "64KiB"},
             {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}]
    server = make_server(tiers=tiers)
    s = _raw(server.address)
    _hello(s)
    bad = [
        {"op": "get", "key": b"abc"},
        {"op": "get", "key": b""},
        {"op": "lookup", "keys": [_key(1), b"\x00" * (KEY_BYTES + 1)]},
        {"op": "reserve", "key": b"abc", "nbytes": 10, "parent": None, "chunk_index": 0},
        {"op": "reserve", "key": _key(1), "nbytes": 10, "parent": b"", "chunk_index": 0},
        {"op": "reserve", "key": _key(1), "nbytes": 10, "parent": None, "chunk_index": -1},
        {"op": "delete", "key": b"\x01" * (KEY_BYTES - 1)},
        {"op": "flush", "timeout": float("nan")},
    ]
    messages = []
    for msg in bad:
        P.send(s, msg)
        reply = P.recv(s)
        assert reply["error"] == P.MALFORMED, (msg, reply)
        messages.append(reply["message"])
    assert messages[0] == f"get: field 'key' must be a {KEY_BYTES}-byte chunk key, got 3 bytes"
    P.send(s, {"op": "lookup", "keys": [_key(9)]})
    assert P.recv(s) == {"ok": True, "n": 0}
    with ServerStore(server.address) as client:
        assert client.put(_key(3), _payload(3, 70_000)) and client.flush(timeout=20)
        assert client.stats()["server"]["malformed"] == len(bad)
    assert "Traceback" not in server.output()
    s.close()


# ------------------------------------------------------------------ 13: a hung server


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.01)


def test_a_stopped_server_costs_each_lookup_at_most_its_deadline_and_recovers(make_server):
    server = make_server()
    client = ServerStore(server.address, lookup_timeout=0.2, timeout=1.0, backoff=0.1, max_backoff=0.4)
    assert client.put(_key(1), _payload(1, 1000)) and client.lookup([_key(1)]) == 1
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        _wait_stopped(server.proc.pid)  # a stop is delivered asynchronously: a loaded machine may still answer first
        slowest = 0.0
        results: list[int] = []

        def lookups() -> None:
            nonlocal slowest
            for _ in range(10):
                t0 = time.monotonic()
                results.append(client.lookup([_key(1)]))
                slowest = max(slowest, time.monotonic() - t0)
                time.sleep(0.05)

        threads = [threading.Thread(target=lookups) for _ in range(3)]  # concurrent callers too
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [0] * 30
        assert slowest < 0.2 + 0.3  # the deadline plus scheduling slack on a loaded machine
        t0 = time.monotonic()
        assert client.read(_key(1), lambda segs: None) is None
        assert time.monotonic() - t0 < 1.0 + 0.3
        assert client.stats()["client"]["timeouts"] >= 1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while client.lookup([_key(1)]) != 1:
        assert time.monotonic() < deadline, "client did not recover after SIGCONT"
        time.sleep(0.05)
    assert client.get(_key(1)) == _payload(1, 1000).tobytes()
    client.close()


# ------------------------------------------------------------------ issue 15: readiness, ports


def test_ready_line_means_every_listener_answers_at_once(make_server):
    server = make_server(listen="tcp://127.0.0.1:0", token="t")  # both ports bound as 0
    assert not server.address.endswith(":0") and not server.metrics_address.endswith(":0")
    # no retry: the ready line promised both listeners accept connections
    assert urllib.request.urlopen(f"http://{server.metrics_address}/healthz", timeout=5).read() == b"ok\n"
    with _raw(server.address) as s:
        _hello(s, "t")


def test_new_config_keys_are_range_checked():
    for key, value in (("max_connections", 0), ("hello_timeout_s", float("nan")), ("lease_timeout_s", -1),
                       ("max_leases_per_client", 0), ("client_staging_fraction", 1.5)):
        with pytest.raises(ConfigError, match=rf"serve\.{key}: "):
            ServeConfig.from_mapping({key: value})
    with pytest.raises(ConfigError, match="max_unauthenticated"):
        ServeConfig.from_mapping({"max_connections": 4, "max_unauthenticated": 5})

"""Child-process lifetime (``kvtier.harness.procs``) with real processes: services die with their
parent even on SIGKILL, stale ones are reaped by the next run (and nothing else is), a port taken
by someone else is retried, and readiness errors name the service and its log.

Every test uses its own registry directory, so it neither sees nor reaps other runs' children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.harness import procs
from kvtier.harness.procs import Registry, ServiceUnavailable, spawn, start_ticks, wait_ready

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Registry:
    """A private registry, also for the child processes of a test (through the environment)."""
    path = tmp_path / "registry"
    monkeypatch.setenv(procs.REGISTRY_ENV, str(path))
    return Registry(path)


def _alive(pid: int, ticks: int | None) -> bool:
    """The process ``pid`` that started at ``ticks`` still runs (a zombie or a reused pid does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z" and start_ticks(pid) == ticks


def _gone_within(pid: int, ticks: int | None, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid, ticks):
            return True
        time.sleep(0.05)
    return not _alive(pid, ticks)


def _kill_if_ours(pid: int, ticks: int | None) -> None:
    if _alive(pid, ticks):
        os.kill(pid, signal.SIGKILL)


def _parent(code: str) -> subprocess.Popen:
    """A python parent running ``code`` (kvtier importable) in its own session; stdout piped."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _read_ints(proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    """The first stdout line of ``proc`` as integers (waits at most ``timeout`` s)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0].strip():
        proc.kill()
        pytest.fail(f"parent printed nothing (exit code {proc.poll()})")
    return [int(x) for x in box[0].split()]


def _sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# parent death


def _redis_under_a_parent(tmp_path, prelude: str = ""):
    """(parent, redis pid, its start ticks): a parent program that runs ``prelude``, starts
    redis-server and sleeps; a skip when redis-server is not installed."""
    parent = _parent(
        "import time\n" + prelude +
        "from kvtier.harness.services import redis_server, BinaryMissing\n"
        "try:\n"
        f"    cm = redis_server({str(tmp_path / 'redis')!r}); r = cm.__enter__()\n"
        "except BinaryMissing:\n"
        "    print(0, flush=True); raise SystemExit\n"
        "print(r.pid, flush=True)\n"
        "time.sleep(600)\n")
    (pid,) = _read_ints(parent)
    if pid == 0:
        pytest.skip("redis-server not installed")
    return parent, pid, start_ticks(pid)


def test_redis_dies_when_its_parent_is_sigkilled(registry, tmp_path):
    """The issue's case: whoever started redis-server is SIGKILLed; redis must not outlive it."""
    parent, pid, ticks = _redis_under_a_parent(tmp_path)
    try:
        assert _alive(pid, ticks)
        _sigkill(parent)
        assert _gone_within(pid, ticks, 5.0), "redis-server outlived its SIGKILLed parent"
    finally:
        _kill_if_ours(pid, ticks)


def test_script_child_that_arms_die_with_parent_dies_with_it():
    """A script started by plain subprocess (as the engine scripts are) that calls
    ``die_with_parent`` itself ends when its parent is SIGKILLed."""
    child_code = ("from kvtier.harness.procs import die_with_parent; import time; die_with_parent(); "
                  "print('armed', flush=True); time.sleep(600)")
    parent = _parent(
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline().strip() == 'armed'\n"  # the child has armed the signal
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n")
    (pid,) = _read_ints(parent)
    ticks = start_ticks(pid)
    try:
        assert _alive(pid, ticks)
        _sigkill(parent)
        assert _gone_within(pid, ticks, 5.0), "the script outlived its SIGKILLed parent"
    finally:
        _kill_if_ours(pid, ticks)


def test_child_spawned_from_a_finished_thread_stays_alive(registry):
    """The parent-death signal follows the forking *thread*: a child spawned from a worker thread
    must not be killed when that thread ends (spawn forks on a long-lived thread instead)."""
    box: list[procs.Child] = []
    worker = threading.Thread(target=lambda: box.append(spawn(["sleep", "60"], name="sleeper")))
    worker.start()
    worker.join()
    child = box[0]
    try:
        time.sleep(0.5)
        assert child.alive, "the child died with the thread that spawned it"
    finally:
        child.stop()
    assert not child.alive


# ---------------------------------------------------------------------------------------------
# stale registry


def test_stale_services_of_a_killed_run_are_reaped_and_live_ones_kept(registry, tmp_path):
    """A grandchild that escaped the parent-death signal (its own session) is killed by the next
    ``reap_stale``; a child whose owner is alive is left alone."""
    parent = _parent(
        "import time\n"
        "from kvtier.harness.procs import spawn\n"
        "c = spawn(['sh', '-c', 'setsid sleep 600 & echo $! > grandchild; wait'], name='escaper',"
        f" cwd={str(tmp_path)!r})\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n")
    (child_pid,) = _read_ints(parent)
    deadline = time.monotonic() + 10
    while not (tmp_path / "grandchild").is_file() or not (tmp_path / "grandchild").read_text().strip():
        assert time.monotonic() < deadline, "the grandchild did not start"
        time.sleep(0.05)
    grand = int((tmp_path / "grandchild").read_text())
    grand_ticks = start_ticks(grand)
    mine = spawn(["sleep", "60"], name="live-owner")  # its owner (this process) is alive
    try:
        assert len(registry.records()) == 2
        _sigkill(parent)
        assert _gone_within(child_pid, start_ticks(child_pid), 5.0)
        assert _alive(grand, grand_ticks), "setup: the grandchild should survive its parent"
        killed = procs.reap_stale(registry)
        assert grand in killed
        assert _gone_within(grand, grand_ticks, 5.0)
        assert mine.alive, "a child of a live owner was reaped"
        assert [r.name for _, r in registry.records()] == ["live-owner"]
    finally:
        _kill_if_ours(grand, grand_ticks)
        mine.stop()
    assert registry.records() == []


def test_stale_service_without_parent_death_signal_is_reaped_by_its_record(registry, tmp_path):
    """Where the parent-death signal is unavailable (injected: prctl missing), a redis-server
    outlives its SIGKILLed parent; the next ``reap_stale`` kills it by its recorded pid and start
    time (redis overwrites its environment area with its process title, so it carries no tag)."""
    parent, pid, ticks = _redis_under_a_parent(tmp_path, "from kvtier.harness import procs\n"
                                                          "procs.libc_prctl = lambda: None\n")
    try:
        _sigkill(parent)
        time.sleep(0.5)
        assert _alive(pid, ticks), "setup: without the parent-death signal redis should survive"
        assert procs.reap_stale(registry) == [pid]
        assert _gone_within(pid, ticks, 5.0)
        assert registry.records() == []
    finally:
        _kill_if_ours(pid, ticks)


def test_reap_never_kills_a_process_that_only_reuses_a_recorded_pid(registry):
    """Records of a dead owner that point at a live process which is not theirs (the pid was
    reused: no tag, or a later start time) kill nothing."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    bystander = subprocess.Popen(["sleep", "60"])  # not spawned by procs: carries no tag
    ticks = start_ticks(bystander.pid)
    try:
        for tag, start in (("0" * 32, ticks - 1), ("1" * 32, 0)):  # an earlier process had this pid
            registry.add(procs.Record(bystander.pid, start, tag, dead.pid, 1, procs.boot_id(), "reused"))
        tagged = spawn(["sleep", "60"], name="tagged", registry=Registry(registry.path / "other"))
        # a record for ``tagged``'s tag but claiming a start time after it began: not the same process
        registry.add(procs.Record(tagged.pid + 1, tagged.start + 10**9, tagged.tag, dead.pid, 1,
                                   procs.boot_id(), "later"))
        assert procs.reap_stale(registry) == []
        assert bystander.poll() is None and tagged.alive
        assert registry.records() == []
        tagged.stop()
    finally:
        bystander.kill()
        bystander.wait()


# ---------------------------------------------------------------------------------------------
# ports and readiness


def _services_with(binary: str):
    """``kvtier.harness.services``, or a skip when ``binary`` is not installed."""
    services = pytest.importorskip("kvtier.harness.services")
    try:
        services.find_binary(binary, "")
    except procs.BinaryMissing:
        pytest.skip(f"{binary} not installed")
    return services


def _listening_socket() -> socket.socket:
    """A socket listening on a free loopback port (a port some other process holds)."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    return blocker


def test_redis_start_retries_when_its_port_is_taken(registry, tmp_path, monkeypatch):
    """The first port handed to redis-server is held by a listening socket: the start is retried
    on a new port and the service answers there."""
    services = _services_with("redis-server")
    blocker = _listening_socket()
    calls = []
    real = procs.pick_ports

    def first_taken(n: int) -> list[int]:
        calls.append(n)
        return [blocker.getsockname()[1]] if len(calls) == 1 else real(n)

    monkeypatch.setattr(procs, "pick_ports", first_taken)
    try:
        with services.redis_server(tmp_path / "redis") as r:
            assert len(calls) == 2
            assert r.port != blocker.getsockname()[1]
            assert services.redis_pid(r.port) == r.pid
    finally:
        blocker.close()


def test_redis_start_is_not_fooled_by_another_redis_on_its_port(registry, tmp_path, monkeypatch):
    """Another redis already answers PING on the first port: readiness must check that the answer
    comes from the process just started, retry, and end up with its own server."""
    services = pytest.importorskip("kvtier.harness.services")
    try:
        other_cm = services.redis_server(tmp_path / "other")
        other = other_cm.__enter__()
    except procs.BinaryMissing:
        pytest.skip("redis-server not installed")
    calls = []
    real = procs.pick_ports
    monkeypatch.setattr(procs, "pick_ports",
                        lambda n: (calls.append(n), [other.port] if len(calls) == 1 else real(n))[1])
    try:
        with services.redis_server(tmp_path / "mine") as mine:
            assert mine.port != other.port
            assert mine.pid is not None and mine.pid != other.pid
            assert services.redis_pid(mine.port) == mine.pid
    finally:
        other_cm.__exit__(None, None, None)


def test_start_on_ports_gives_up_after_its_attempts():
    """A service whose port is always taken fails after the bounded number of attempts."""
    attempts = []

    def start(ports: list[int]) -> None:
        attempts.append(ports)
        raise procs.PortInUse("always taken")

    with pytest.raises(ServiceUnavailable, match=r"demo: no free ports after 3 attempts"):
        procs.start_on_ports(start, 2, "demo", attempts=3)
    assert len(attempts) == 3 and all(len(p) == 2 for p in attempts)


def test_pick_ports_avoids_the_ephemeral_range_and_repeats():
    lo, _ = procs.ephemeral_range()
    ports = procs.pick_ports(15)
    assert len(set(ports)) == 15
    assert all(10000 <= p < lo for p in ports)


def test_wait_ready_names_the_service_and_its_log_when_it_exits(registry, tmp_path):
    child = spawn(["sh", "-c", "echo boom-marker-42; exit 3"], name="boomer", log=tmp_path / "boom.log")
    with pytest.raises(ServiceUnavailable, match=r"boomer service exited with code 3: .*boom-marker-42"):
        wait_ready(child, lambda: False, 10, "boomer service")
    child.stop()


def test_wait_ready_times_out_with_the_log_tail(registry, tmp_path):
    log = tmp_path / "slow.log"
    log.write_text("output of an earlier start: address already in use\n")  # not this child's
    child = spawn(["sh", "-c", "echo still-starting; sleep 60"], name="slow", log=log)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable, match=r"slow thing not ready after 1 s: .*still-starting") as err:
            wait_ready(child, lambda: False, 1.0, "slow thing")
        assert not isinstance(err.value, procs.PortInUse)  # the earlier start's line is ignored
        assert time.monotonic() - t0 < 10
    finally:
        child.stop()
    assert not child.alive


def test_stop_kills_the_whole_group_and_drops_the_record(registry, tmp_path):
    child = spawn(["sh", "-c", "sleep 600 & echo $! > inner; wait"], name="group", cwd=tmp_path)
    deadline = time.monotonic() + 10
    while not (tmp_path / "inner").is_file() or not (tmp_path / "inner").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    inner = int((tmp_path / "inner").read_text())
    inner_ticks = start_ticks(inner)
    assert len(registry.records()) == 1
    child.stop(grace=2.0)
    assert _gone_within(inner, inner_ticks, 5.0), "a member of the child's group survived stop()"
    assert registry.records() == []


def test_stop_ends_a_stopped_child_gracefully(registry, tmp_path):
    """A SIGSTOPped service (as the hung-server tests leave it) still gets its SIGTERM at once
    and exits cleanly, instead of waiting out the grace period for a SIGKILL."""
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
            f"open({str(tmp_path / 'up')!r}, 'w').close(); time.sleep(600)")
    child = spawn([sys.executable, "-c", code], name="stoppable")
    deadline = time.monotonic() + 30
    while not (tmp_path / "up").exists():
        assert time.monotonic() < deadline and child.alive
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert child.stop(grace=8.0) == 0
    assert time.monotonic() - t0 < 6.0


def test_run_child_kills_the_child_on_timeout(registry, tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_child([sys.executable, "-c", code], timeout=3.0)
    pid = int(pid_file.read_text())
    assert not _alive(pid, start_ticks(pid))
    assert procs.run_child([sys.executable, "-c", "print('hi')"], timeout=60).stdout == "hi\n"


# ---------------------------------------------------------------------------------------------
# the offload benchmark's engine processes (a hung or crashing engine injected as the "python")


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable that stands in for the engine's interpreter: the injected fault."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_engine_that_never_gets_ready_fails_by_its_deadline_and_is_stopped(registry, tmp_path, monkeypatch):
    from kvtier.bench.offload import _Engine
    from kvtier.errors import KVTierError

    monkeypatch.setattr(_Engine, "READY_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    python = _fake_python(tmp_path, f"echo loading-weights >&2; echo $$ > {tmp_path}/engine.pid; exec sleep 600")
    engine = _Engine("hung", python, dict(os.environ), tmp_path / "spec.json", tmp_path)
    with pytest.raises(KVTierError, match=r"setting hung: no answer after 1 s:\n.*loading-weights"):
        with engine:
            engine.wait_ready()
    assert time.monotonic() - t0 < 30  # no polite minute-long wait for an engine that hangs
    pid = int((tmp_path / "engine.pid").read_text())
    assert not _alive(pid, start_ticks(pid))
    assert registry.records() == []


def test_engine_that_exits_reports_its_code_and_log(registry, tmp_path):
    from kvtier.bench.offload import _Engine
    from kvtier.errors import KVTierError

    python = _fake_python(tmp_path, "echo 'RuntimeError: boom' >&2; echo 'shutdown chatter' >&2; exit 7")
    with pytest.raises(KVTierError, match=r"setting crashy: engine exited \(code 7\):\nlast error: RuntimeError: boom"):
        with _Engine("crashy", python, dict(os.environ), tmp_path / "spec.json", tmp_path) as engine:
            engine.wait_ready()


def test_reap_owned_kills_only_this_process_s_forgotten_children(registry):
    forgotten = spawn(["sleep", "60"], name="forgotten")
    other = Registry(registry.path / "elsewhere")
    kept = spawn(["sleep", "60"], name="kept", registry=other)
    try:
        assert procs.reap_owned(registry) == [f"forgotten (pid {forgotten.pid})"]
        forgotten.popen.wait(timeout=5)
        assert kept.alive and registry.records() == []
    finally:
        forgotten.stop()
        kept.stop()


@pytest.mark.slow
def test_seaweedfs_start_retries_when_its_s3_port_is_taken(registry, tmp_path, monkeypatch):
    """``weed mini`` refuses to start when a port it was given is taken; the start is retried on
    new ports and S3 answers on the endpoint the service reports."""
    pytest.importorskip("boto3")
    services = _services_with("weed")
    blocker = _listening_socket()
    calls = []
    real = procs.pick_ports

    def s3_port_taken(n: int) -> list[int]:
        calls.append(n)
        ports = real(n)
        if len(calls) == 1:
            ports[services.WEED_S3_PORT] = blocker.getsockname()[1]
        return ports

    monkeypatch.setattr(procs, "pick_ports", s3_port_taken)
    try:
        with services.seaweedfs(tmp_path / "weed") as s3:
            assert len(calls) == 2
            assert not s3.endpoint_url.endswith(f":{blocker.getsockname()[1]}")
            s3.client().put_object(Bucket=s3.bucket, Key="k", Body=b"v")
            assert s3.client().get_object(Bucket=s3.bucket, Key="k")["Body"].read() == b"v"
    finally:
        blocker.close()


def test_cpu_hog_runs_the_command_under_load_and_leaves_nothing(registry, tmp_path):
    """The race-check wrapper passes the command's exit code through and stops its loops."""
    probe = f"import os; open({str(tmp_path / 'load')!r}, 'w').write(str(os.getloadavg()[0])); raise SystemExit(3)"
    env = dict(os.environ, PYTHONPATH=ROOT)
    rc = subprocess.call([sys.executable, "-m", "kvtier.harness.cpu_hog", "--procs", "2", "--",
                          sys.executable, "-c", "import time; time.sleep(2); " + probe], env=env, timeout=120)
    assert rc == 3
    assert (tmp_path / "load").read_text()
    assert registry.records() == []  # every loop was stopped (its record dropped)

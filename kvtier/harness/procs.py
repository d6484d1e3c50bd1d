"""Child processes of tests and benchmarks that die with whoever started them.

One helper for every spawner (redis-server, ``weed mini``, LMCache's server, vLLM engine
processes, benchmark children):

    child = spawn(["redis-server", ...], name="redis-server", log=path)
    wait_ready(child, ping, timeout=20, what="redis-server on port 1234")
    ...
    child.stop()

Contracts
---------
* ``spawn`` starts the child in a new session (its own process group, group id == its pid) and,
  on Linux, sets ``PR_SET_PDEATHSIG=SIGKILL`` in the child before ``exec``: when the parent
  dies, even by SIGKILL, the kernel kills the child. Elsewhere it degrades to the process
  group and the registry below (no parent-death signal).
* The kernel sends the parent-death signal when the *thread* that forked the child exits, not
  the process. ``spawn`` therefore forks on the calling thread only when it is the main thread;
  from any other thread it hands the fork to one long-lived daemon thread of this module, which
  ends only with the process. A child never dies early because a worker thread finished.
* The signal is armed by a ``preexec_fn`` (between fork and exec), which Python calls unsafe
  when other threads hold locks; it only calls ``prctl`` and ``getppid`` through a ctypes
  function resolved before the fork (no import, no lock). If the parent died before the
  signal was armed, the child exits at once.
* The parent-death signal reaches only the direct child. Grandchildren (vLLM's engine core,
  a server's workers) carry a tag in their environment (``KVTIER_PROC_TAG``, inherited), and
  ``Child.stop`` and ``reap_stale`` kill every process that carries the tag (a program that
  overwrites its environment area, as redis-server does for its process title, loses the tag:
  it is then found by its recorded pid and start time, or as a member of the child's group).
* A script started by code that does not use ``spawn`` can arm the signal itself with
  ``die_with_parent()``; in a module vLLM's spawned processes re-import (as ``__mp_main__``),
  calling it at import makes them die with their parent too.
* Every child is recorded in a registry directory (one JSON file per child: its pid and start
  time from ``/proc/PID/stat``, its tag, the owner's pid and start time, the boot id). The next
  ``spawn`` (or a direct ``reap_stale``) kills the processes of records whose owner is dead:
  the recorded child and its process group if that pid still has the recorded start time, and
  any process whose environment carries the record's tag and that started no earlier. A reused
  pid (another start time, no tag) is never killed.
* ``wait_ready`` polls the endpoint the caller will use with a deadline; on a timeout or an
  early exit it raises ``ServiceUnavailable`` naming the service and the tail of its log, and
  ``PortInUse`` when the log says a port could not be bound (``start_on_ports`` retries those
  on new ports a bounded number of times).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence, TypeVar

import psutil

from kvtier.errors import KVTierError

__all__ = [
    "ServiceUnavailable", "BinaryMissing", "PortInUse", "Child", "Registry", "spawn", "wait_ready",
    "start_on_ports", "pick_ports", "die_with_parent", "default_registry", "reap_stale", "reap_owned",
    "start_ticks", "run_child", "TAG_ENV", "REGISTRY_ENV", "Record", "boot_id", "libc_prctl",
    "ephemeral_range",
]

TAG_ENV = "KVTIER_PROC_TAG"  # the environment variable that carries a child's tag to its descendants
REGISTRY_ENV = "KVTIER_PROC_REGISTRY"  # overrides ``default_registry``'s directory (tests set it)
_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


class ServiceUnavailable(KVTierError):
    """A service did not start or did not become ready in time (the message names it and its log)."""


class BinaryMissing(ServiceUnavailable):
    """A service's binary is not installed (tests skip on this one, and only on this one)."""


class PortInUse(ServiceUnavailable):
    """A service could not bind a port it was given (another process holds it)."""


# ---------------------------------------------------------------------------------------------
# process facts (psutil lists processes and reads environments; state and start ticks come from one
# read of /proc/PID/stat, the boot id and the port range from /proc)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of ``pid`` from one read of ``/proc/PID/stat``; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[19])  # fields 3 (state) and 22 (start time) overall


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone.

    Read here rather than through psutil: psutil's ``create_time`` is wall-clock seconds (it moves
    when the clock is set), these ticks never change, and the registry compares them across
    processes and runs."""
    stat = _stat(pid)
    return stat[1] if stat else None


def _live_ticks(pid: int) -> int | None:
    """``start_ticks`` of ``pid`` while it runs; None if it is gone or a zombie/dead (dead, only
    not yet reaped): both from the one read of its stat line."""
    stat = _stat(pid)
    return stat[1] if stat and stat[0] not in "ZX" else None


def _group_members(pgid: int, not_before: int) -> list[int]:
    """Live processes of process group ``pgid`` that started at or after ``not_before`` ticks."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:  # gone meanwhile
            continue
        ticks = _live_ticks(pid)
        if ticks is not None and ticks >= not_before:
            found.append(pid)
    return found


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``); "" where there is none.

    A record written under another boot id names processes that cannot exist any more."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _is_same_process(pid: int, ticks: int | None) -> bool:
    """True while the process ``pid`` that started at ``ticks`` runs (a reused pid does not, nor a
    zombie: it is dead, only not yet reaped)."""
    return ticks is not None and _live_ticks(pid) == ticks


def _tagged(tag: str, not_before: int) -> list[int]:
    """Pids of live processes whose environment holds ``TAG_ENV=tag`` and that started at or after
    ``not_before`` ticks (processes of other users are unreadable and skipped)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_ENV) != tag:
                continue
        except psutil.Error:  # gone meanwhile, or another user's (AccessDenied)
            continue
        ticks = start_ticks(proc.pid)
        if ticks is not None and ticks >= not_before:
            found.append(proc.pid)
    return found


def _kill_tagged(tag: str, not_before: int, leader: int | None = None) -> list[int]:
    """SIGKILL every live process carrying ``tag`` (see ``_tagged``) and, when ``leader`` is the
    recorded child itself (same pid and start time), it and its process group: a program that
    rewrites its environment area (redis-server sets its process title there) loses the tag.
    The pids signalled."""
    if not os.path.isdir("/proc"):
        return []
    pids = set(_tagged(tag, not_before))
    if leader is not None and _is_same_process(leader, not_before):
        pids |= {leader, *_group_members(leader, not_before)}  # a live leader: its group is its own
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return sorted(pids)


# ---------------------------------------------------------------------------------------------
# parent-death signal


def libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, else None (resolved in the parent: nothing to look up after fork).

    ``die_with_parent`` and ``spawn`` look it up through this module's global on each call, so
    replacing it with ``lambda: None`` makes this process behave as on a system without the
    parent-death signal (the process group and the registry remain)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies.

    For a script run as a child by code that does not use ``spawn``. If the parent is already
    gone (``getppid() != parent_pid``; ``parent_pid`` defaults to the parent now), the process
    exits at once. False where unsupported (not Linux), True when set.
    """
    prctl = libc_prctl()
    expected = os.getppid() if parent_pid is None else parent_pid
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != expected:  # the parent died before the signal was armed
        os._exit(1)
    return True


def _preexec(parent_pid: int) -> Callable[[], None]:
    """The ``preexec_fn`` of ``spawn``: arm SIGKILL on parent death; exit if the parent is gone."""
    prctl = libc_prctl()

    def arm() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


class _Spawner:
    """One daemon thread that forks children asked for from non-main threads (it lives until the
    process exits, so the parent-death signal of its children fires only then)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked copy of this process has no such thread: it makes its own
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="kvtier-spawner", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed back to the caller's thread
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T]) -> T:
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


_spawner: _Spawner | None = None  # unavoidable process-wide state: the one long-lived forking thread
_spawner_lock = threading.Lock()


def _on_forking_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` (which forks) on the main thread if called there, else on the spawner thread."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None or _spawner.pid != os.getpid():
            _spawner = _Spawner()
    return _spawner.call(fn)


# ---------------------------------------------------------------------------------------------
# registry of children


@dataclass(frozen=True)
class Record:
    """One registry entry: the child ``pid`` and its ``start`` (``start_ticks``), its ``tag``
    (``TAG_ENV`` in its environment), the owner's ``owner_pid`` and ``owner_start``, the
    ``boot_id`` it was written under, and the child's ``name`` (for leak reports).

    ``reap_stale`` kills what a record names only while the owner is not that same process and
    the boot id is this boot's; ``to_json``/``from_json`` are the file format."""

    pid: int
    start: int
    tag: str
    owner_pid: int
    owner_start: int
    boot_id: str
    name: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str) -> "Record":
        d = json.loads(text)
        return Record(int(d["pid"]), int(d["start"]), str(d["tag"]), int(d["owner_pid"]),
                       int(d["owner_start"]), str(d["boot_id"]), str(d["name"]))


@dataclass(frozen=True)
class Registry:
    """A directory of JSON records, one per live child (``<pid>-<start>.json``); see ``reap_stale``."""

    path: Path

    def _dir(self) -> Path:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.path

    def add(self, record: Record) -> Path:
        """Write ``record`` atomically; its file's path."""
        final = self._dir() / f"{record.pid}-{record.start}.json"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(record.to_json())
        os.replace(tmp, final)
        return final

    def records(self) -> list[tuple[Path, Record | None]]:
        """Every record file with its record (None for a file that does not parse)."""
        if not self.path.is_dir():
            return []
        out: list[tuple[Path, Record | None]] = []
        for f in sorted(self.path.glob("*.json")):
            try:
                out.append((f, Record.from_json(f.read_text())))
            except (OSError, ValueError, KeyError, TypeError):
                out.append((f, None))
        return out


def default_registry() -> Registry:
    """``$KVTIER_PROC_REGISTRY``, else ``<tmp>/kvtier-procs-<uid>``."""
    configured = os.environ.get(REGISTRY_ENV)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Registry(Path(configured) if configured else Path(tempfile.gettempdir()) / f"kvtier-procs-{uid}")


def reap_stale(registry: Registry | None = None) -> list[int]:
    """Kill the processes of every record whose owner is dead; drop those records. Killed pids.

    Records of live owners are left alone. A record from another boot is dropped without
    killing (its processes cannot exist). Safe to run from several processes at once.
    """
    registry = registry or default_registry()
    boot = boot_id()
    killed: list[int] = []
    for path, rec in registry.records():
        if rec is not None and rec.boot_id == boot and _is_same_process(rec.owner_pid, rec.owner_start):
            continue  # its owner is alive and will stop it
        if rec is not None and rec.boot_id == boot:
            killed += _kill_tagged(rec.tag, rec.start, leader=rec.pid)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return killed


def reap_owned(registry: Registry | None = None) -> list[str]:
    """Kill the children this process spawned and never stopped; drop their records. Their names.

    For the end of a test session or benchmark: anything returned is a leak of the caller's."""
    registry = registry or default_registry()
    me, my_start = os.getpid(), start_ticks(os.getpid())
    names = []
    for path, rec in registry.records():
        if rec is not None and rec.owner_pid == me and rec.owner_start == my_start:
            _kill_tagged(rec.tag, rec.start, leader=rec.pid)
            names.append(f"{rec.name} (pid {rec.pid})")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return names


# ---------------------------------------------------------------------------------------------
# children


@dataclass
class Child:
    """A started child: ``popen`` (the ``subprocess.Popen``), its ``name`` and ``log`` path.

    ``stop`` ends it and everything it started; it is idempotent and safe after the child exited.
    Not thread-safe: one owner drives it.
    """

    popen: subprocess.Popen
    name: str
    tag: str
    start: int
    log: Path | None = None
    log_offset: int = 0  # the log's size when the child started: ``tail`` reads only its own output
    _record: Path | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """The child's pid (also its process group id)."""
        return self.popen.pid

    @property
    def alive(self) -> bool:
        """True until the child exits (it is reaped by this check once it has)."""
        return self.popen.poll() is None

    def tail(self, chars: int = 1500) -> str:
        """The last ``chars`` this child wrote to its log ("(no log)" when there is none)."""
        if self.log is None:
            return "(no log)"
        try:
            with open(self.log, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self.log_offset, size - chars))
                return f.read().decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` s, then SIGKILL any tagged
        descendant left; reap the child and drop its record. Its exit code (None if unreaped)."""
        if self.popen.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, sig)
                    os.killpg(self.popen.pid, signal.SIGCONT)  # a stopped (SIGSTOP) child acts on SIGTERM
                try:
                    self.popen.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # the leader is gone; members may remain
        _kill_tagged(self.tag, self.start)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self._record is not None:
            with contextlib.suppress(FileNotFoundError):
                self._record.unlink()
            self._record = None
        return self.popen.returncode

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(
    argv: Sequence[str],
    *,
    name: str | None = None,
    log: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    text: bool = False,
    registry: Registry | None = None,
) -> Child:
    """Start ``argv`` as a child that dies with this process (see the module's contracts).

    With ``log``, stdout and stderr are appended to that file (``stdout``/``stderr`` must then be
    None). Stale children of dead owners are reaped first. ``env`` defaults to ``os.environ``;
    the tag variable is added either way. Raises ``BinaryMissing`` if ``argv[0]`` is not found.
    """
    registry = registry or default_registry()
    reap_stale(registry)
    tag = uuid.uuid4().hex
    child_env = dict(os.environ if env is None else env)
    child_env[TAG_ENV] = tag
    name = name or os.path.basename(argv[0])
    log_path = Path(log) if log is not None else None
    if log_path is not None and (stdout is not None or stderr is not None):
        raise ValueError("spawn: give either log or stdout/stderr, not both")

    offset = log_path.stat().st_size if log_path is not None and log_path.exists() else 0

    def fork() -> subprocess.Popen:
        out = open(log_path, "ab") if log_path is not None else None
        try:
            return subprocess.Popen(
                list(argv), env=child_env, cwd=cwd, stdin=stdin,
                stdout=out if out is not None else stdout,
                stderr=subprocess.STDOUT if out is not None else stderr,
                text=text, start_new_session=True, preexec_fn=_preexec(os.getpid()),
            )
        finally:
            if out is not None:
                out.close()

    try:
        popen = _on_forking_thread(fork)
    except FileNotFoundError as exc:
        raise BinaryMissing(f"{name}: {argv[0]} not found ({exc.strerror})") from exc
    child = Child(popen, name, tag, start_ticks(popen.pid) or 0, log_path, offset)
    me = os.getpid()
    record = Record(popen.pid, child.start, tag, me, start_ticks(me) or 0, boot_id(), name)
    child._record = registry.add(record)
    return child


def run_child(argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
              name: str | None = None) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` but through
    ``spawn``: the child dies with this process, and on a timeout it (and its group) is killed
    before ``subprocess.TimeoutExpired`` propagates."""
    child = spawn(argv, name=name, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.popen.communicate(timeout=timeout)
    finally:
        child.stop(grace=1.0)
    return subprocess.CompletedProcess(list(argv), child.popen.returncode, out, err)


# ---------------------------------------------------------------------------------------------
# readiness and ports

_BIND_FAILURE = re.compile(r"address already in use|is not available .* cannot be used|failed listening on port",
                           re.IGNORECASE)


def wait_ready(child: Child, ready: Callable[[], bool], timeout: float, what: str,
               bind_failure: re.Pattern[str] | None = _BIND_FAILURE) -> None:
    """Call ``ready`` until it returns True (an exception counts as "not yet").

    Raises ``PortInUse`` as soon as the child's log matches ``bind_failure`` (the child is
    stopped first), ``ServiceUnavailable`` if the child exits or ``timeout`` s pass; both
    messages name ``what`` and end with the tail of the log.
    """
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        exited = child.popen.poll() is not None
        tail = child.tail() if (exited or bind_failure is not None) else ""
        if bind_failure is not None and bind_failure.search(tail):
            child.stop(grace=1.0)
            raise PortInUse(f"{what}: a port is taken: {_one_line(tail)}")
        if exited:
            raise ServiceUnavailable(f"{what} exited with code {child.popen.returncode}: {_one_line(tail)}")
        with contextlib.suppress(Exception):  # not up yet: any failure to answer means "poll again"
            if ready() and _still_ours(child, bind_failure):
                return
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"{what} not ready after {timeout:.0f} s: {_one_line(child.tail())}")
        time.sleep(delay)  # polling interval, not a wait for readiness
        delay = min(delay * 1.5, 0.25)


def _still_ours(child: Child, bind_failure: re.Pattern[str] | None) -> bool:
    """After a successful probe: the child still runs and has not logged a bind failure (else the
    answer came from another process on the port, and the next poll reports why)."""
    return child.popen.poll() is None and not (bind_failure is not None and bind_failure.search(child.tail()))


def _one_line(tail: str, chars: int = 600) -> str:
    return " | ".join(line.strip() for line in tail[-chars:].splitlines() if line.strip()) or "(no output)"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``net.ipv4.ip_local_port_range``), ``(low, high)``
    inclusive; Linux's default (32768, 60999) where it cannot be read. ``pick_ports`` stays below it."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def pick_ports(n: int, host: str = "127.0.0.1", rng: random.Random | None = None) -> list[int]:
    """``n`` distinct ports free on ``host`` now, chosen at random *below* the kernel's ephemeral
    range (10000 up to it), so that no outgoing connection is handed one of them meanwhile.

    Another process may still bind one before the service does: callers retry on ``PortInUse``
    (``start_on_ports``). Falls back to kernel-chosen ports if that range is too small.
    """
    rng = rng or random.Random()
    lo, hi = 10000, ephemeral_range()[0] - 1
    held: list[socket.socket] = []
    try:
        tries = 0
        while len(held) < n:
            tries += 1
            port = rng.randint(lo, hi) if hi - lo > 100 * n and tries < 50 * n else 0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def start_on_ports(start: Callable[[list[int]], T], n_ports: int, what: str, attempts: int = 5) -> T:
    """``start(ports)`` with ``n_ports`` fresh ports, again with new ports each time it raises
    ``PortInUse``, at most ``attempts`` times; then ``ServiceUnavailable`` naming ``what``."""
    last: PortInUse | None = None
    for _ in range(attempts):
        try:
            return start(pick_ports(n_ports))
        except PortInUse as exc:
            last = exc
    raise ServiceUnavailable(f"{what}: no free ports after {attempts} attempts ({last})")

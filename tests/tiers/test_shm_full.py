"""Shared memory that runs out (issue 9, item 4): refuse to start in one line, never SIGBUS.

The arena and the server's staging file are reserved in full at start. These tests make a small
tmpfs in a private mount namespace (``unshare -m``, as root), so the host's /dev/shm is never
filled; a child process then asks for more than fits and must exit cleanly (not rc 135, SIGBUS).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.errors import ConfigError, OutOfSpace
from kvtier.tiers import ram as ram_module
from kvtier.tiers.ram import RamTier, reserve_file

SIGBUS_RC = 128 + 7  # a shell reports a child killed by SIGBUS as 135


def _namespaces_unavailable() -> str | None:
    """Why a private mount namespace cannot be made here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a private mount namespace"
    if shutil.which("unshare") is None:
        return "unshare(1) not installed (util-linux)"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -m refused here: {probe.stderr.strip()}"
    return None


_WHY_NOT = _namespaces_unavailable()
needs_mountns = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def in_small_tmpfs(mount: Path, size: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``argv`` in a private mount namespace where ``mount`` is a fresh tmpfs of ``size``."""
    mount.mkdir(exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", size, str(mount), *argv],
                          capture_output=True, text=True, timeout=timeout)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


_ARENA_CHILD = """
    import os, sys
    from kvtier.errors import OutOfSpace
    from kvtier.tiers.ram import RamTier
    shm = sys.argv[1]
    {patch}
    try:
        tier = RamTier(RamTier.Config(capacity=int(sys.argv[2]), page_size=4096, prefault=True,
                                      shm_path=os.path.join(shm, "arena")), name="ram")
    except OutOfSpace as exc:
        print("REFUSED", exc)
        print("LEFT", sorted(os.listdir(shm)))
        sys.exit(3)
    data = os.urandom(1 << 20)
    assert tier.put(b"k" * 32, data) and tier.get(b"k" * 32) == data
    tier.close()
    print("STARTED", sorted(os.listdir(shm)))
"""

_NO_FALLOCATE = """
    import errno
    def _refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    os.posix_fallocate = _refuse  # a file system without fallocate: the pwrite fallback runs
"""


@needs_mountns
@pytest.mark.parametrize("patch", ["", _NO_FALLOCATE], ids=["fallocate", "touch-fallback"])
def test_arena_larger_than_tmpfs_refuses_in_one_line(tmp_path, patch):
    shm = tmp_path / "shm"
    code = _ARENA_CHILD.format(patch=textwrap.indent(textwrap.dedent(patch), "    ").strip())
    run = in_small_tmpfs(shm, "16m", _python(code) + [str(shm), str(64 << 20)])
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)  # not 135 (SIGBUS)
    refused = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1
    assert "64.0 MiB" in refused[0] and str(shm) in refused[0] and "free of 16.0 MiB" in refused[0]
    assert "LEFT []" in run.stdout  # the half-made file is removed


@needs_mountns
@pytest.mark.parametrize("patch", ["", _NO_FALLOCATE], ids=["fallocate", "touch-fallback"])
def test_arena_that_fits_starts_and_serves(tmp_path, patch):
    shm = tmp_path / "shm"
    code = _ARENA_CHILD.format(patch=textwrap.indent(textwrap.dedent(patch), "    ").strip())
    run = in_small_tmpfs(shm, "16m", _python(code) + [str(shm), str(8 << 20)])
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    assert "STARTED []" in run.stdout  # close removed the file


def _serve_config(tmp_path: Path, shm: Path, arena: str, staging: str) -> Path:
    config = tmp_path / "serve.yaml"
    config.write_text(textwrap.dedent(f"""
        listen: unix://{tmp_path}/kvtier.sock
        staging: {staging}
        shm_dir: {shm}
        store:
          tiers:
            - {{type: ram, capacity: {arena}, page_size: 64KiB}}
    """))
    return config


@needs_mountns
@pytest.mark.parametrize("arena, staging, which", [("64MiB", "1MiB", "arena"), ("4MiB", "64MiB", "staging")])
def test_serve_on_small_shm_refuses_in_one_line(tmp_path, arena, staging, which):
    shm = tmp_path / "shm"
    config = _serve_config(tmp_path, shm, arena, staging)
    check_left = "import os, sys; print('LEFT', sorted(os.listdir(sys.argv[1])))"
    run = in_small_tmpfs(shm, "16m", ["sh", "-c", '"$0" -m kvtier.cli serve --config "$1"; rc=$?; '
                                      '"$0" -c "$3" "$2"; exit $rc',
                                      sys.executable, str(config), str(shm), check_left])
    assert run.returncode == 2, (run.returncode, run.stderr)  # refused, not 135 (SIGBUS)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvtier serve: error: ram tier ")
    assert "64.0 MiB" in lines[0] and str(shm) in lines[0] and "free of 16.0 MiB" in lines[0]
    assert f"-{which}" in lines[0]
    assert "LEFT []" in run.stdout  # neither shared-memory file is left behind


def test_fallback_writes_every_byte_when_fallocate_is_missing(tmp_path, monkeypatch):
    def refuse(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(ram_module.os, "posix_fallocate", refuse)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = 3 * (1 << 20) + 12345
        os.ftruncate(fd, size)
        reserve_file(fd, size, str(path), "test")
        assert os.fstat(fd).st_blocks * 512 >= size  # allocated, not a sparse hole
    finally:
        os.close(fd)


def test_out_of_space_is_a_one_line_config_error(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ram_module.os, "posix_fallocate", full)
    path = tmp_path / "arena"
    with pytest.raises(OutOfSpace) as info:
        RamTier(RamTier.Config(capacity=1 << 20, page_size=4096, shm_path=str(path)), name="ram")
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert "\n" not in message and "1.0 MiB" in message and str(tmp_path) in message and "free of" in message
    assert not path.exists()

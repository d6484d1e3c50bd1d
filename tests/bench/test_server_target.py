"""kvtier.bench.server: the "server" target of ``kvtier bench tiers`` starts a real ``kvtier serve``
through kvtier.harness.procs, answers through ServerStore, and leaves no process behind."""

from __future__ import annotations

import os

import pytest

from kvtier.harness.procs import ServiceUnavailable
from kvtier.bench.server import ServerTarget

MiB = 1024 * 1024


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_server_target_round_trip_and_stop(tmp_path):
    target = ServerTarget(str(tmp_path / "srv"), capacity=8 * MiB, timeout=60.0)
    pid = target._child.pid
    try:
        key = bytes(range(32))
        assert target.put(key, b"x" * 4096)
        out = bytearray(4096)
        assert target.get_into(key, out) == 4096 and out == b"x" * 4096
        assert target.delete(key)
    finally:
        target.close()
    assert _gone(pid)


def test_server_that_cannot_start_is_service_unavailable(tmp_path):
    with pytest.raises(ServiceUnavailable):
        ServerTarget(str(tmp_path / "srv"), capacity=-1, timeout=60.0)

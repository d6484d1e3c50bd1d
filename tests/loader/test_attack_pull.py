"""`kvtier pull` attacked once more (issue 24 follow-up): a tenant who can write the node's cache
directory plants FIFOs and oversized bookkeeping files; a hostile S3 endpoint drips its answers.

Each test runs `kvtier pull` as a real process against the tests' own hostile S3 endpoint, with a
wall-clock bound: a pull never blocks on a name another user planted, and never reads more of a
bookkeeping file than a real one can hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvtier.loader.cache import MARKER, PROGRESS, cache_path

from tests.loader.hostile_s3 import HostileS3

pytest.importorskip("boto3")

PREFIX = "models/m/"
URI = f"s3://b/{PREFIX}"


@pytest.fixture
def s3():
    server = HostileS3("b")
    yield server
    server.close()


def _pull(s3: HostileS3, cache, *extra: str, timeout: float = 15) -> tuple[int, str, float]:
    """`kvtier pull URI` as a real process: (exit code, stderr, seconds); -9 when it ran past
    ``timeout`` (killed: a hang)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "us-east-1"}
    cmd = [sys.executable, "-m", "kvtier.cli", "pull", URI, "--cache-dir", str(cache), "--endpoint-url",
           s3.endpoint_url, "--no-progress", "--block-size", "64KiB", "--concurrency", "1", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err.decode().strip(), time.monotonic() - start


@pytest.mark.parametrize("planted", [MARKER, PROGRESS, "w.bin.partial", "w.bin.partial.done"])
def test_a_fifo_planted_in_the_cache_never_hangs_a_pull(s3, tmp_path, planted):
    """Bound: the pull ends within 15 s (it blocked forever in open() before) and the file is right."""
    data = os.urandom(200_000)
    s3.put(PREFIX + "w.bin", data)
    dest = cache_path(str(tmp_path / "c"), URI)
    os.makedirs(dest)
    if planted.endswith(".done"):
        with open(os.path.join(dest, "w.bin.partial"), "wb") as f:
            f.write(b"\0" * len(data))
    os.mkfifo(os.path.join(dest, planted))
    rc, err, secs = _pull(s3, tmp_path / "c")
    assert rc != -9, f"kvtier pull hung on a FIFO at {planted} ({secs:.0f} s)"
    assert rc == 0, err
    with open(os.path.join(dest, "w.bin"), "rb") as f:
        assert f.read() == data


def test_a_huge_journal_is_not_read_whole(s3, tmp_path):
    """A journal with the right header and then gigabytes of lines (a tenant's, or a symlink's
    target) is read at most as far as a real one reaches: the pull finishes under 20 s and
    within 200 MiB of RSS, and every block is fetched again (the journal is not trusted)."""
    data = os.urandom(200_000)
    s3.put(PREFIX + "w.bin", data)
    dest = cache_path(str(tmp_path / "c"), URI)
    os.makedirs(dest)
    with open(os.path.join(dest, "w.bin.partial"), "wb") as f:
        f.write(b"\0" * len(data))
    header = "kvtier-journal " + json.dumps({"size": len(data), "block": 65536, "version": s3.objects[
        PREFIX + "w.bin"].etag}, sort_keys=True)
    with open(os.path.join(dest, "w.bin.partial.done"), "w") as f:
        f.write(header + "\n")
        f.truncate(f.tell() + 3 * 2**30)  # 3 GiB of NUL bytes: a sparse file, no newline at all
    env_cmd = [sys.executable, "-c", "import resource, subprocess, sys; "
               "p = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(p.returncode)"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "us-east-1"}
    start = time.monotonic()
    proc = subprocess.run(env_cmd + [sys.executable, "-m", "kvtier.cli", "pull", URI, "--cache-dir",
                                     str(tmp_path / "c"), "--endpoint-url", s3.endpoint_url, "--no-progress",
                                     "--block-size", "64KiB", "--concurrency", "1"],
                          capture_output=True, env=env, timeout=120)
    secs = time.monotonic() - start
    rss_kib = int(proc.stderr.decode().strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr.decode()
    assert rss_kib * 1024 < 200 * 2**20 and secs < 20, (rss_kib, secs)
    with open(os.path.join(dest, "w.bin"), "rb") as f:
        assert f.read() == data

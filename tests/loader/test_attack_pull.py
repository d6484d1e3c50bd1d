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


def _pull(s3: HostileS3, cache, *extra: str, timeout: float = 15, uri: str = URI) -> tuple[int, str, float]:
    """`kvtier pull URI` as a real process: (exit code, stderr, seconds); -9 when it ran past
    ``timeout`` (killed: a hang)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "us-east-1"}
    cmd = [sys.executable, "-m", "kvtier.cli", "pull", uri, "--cache-dir", str(cache), "--endpoint-url",
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


def test_a_dripping_endpoint_is_cut_at_the_get_deadline(s3, tmp_path):
    """A server that sends one byte every 0.2 s (each within the read timeout) held a 64 KiB
    GET for 3.6 hours; now a GET's body must arrive within ``get_timeout_s``. Bound: the pull
    (2 s deadline, one retry) fails in one line within 15 s."""
    from kvtier.errors import LoaderError
    from kvtier.loader.cache import pull
    from kvtier.loader.sources.s3 import S3Config

    s3.put(PREFIX + "w.bin", os.urandom(65536))
    s3.drip_s = 0.2
    config = S3Config(endpoint_url=s3.endpoint_url, access_key="AK", secret_key="SK", region="us-east-1",
                      read_timeout_s=5.0, get_timeout_s=2.0, retries=1, backoff_s=0.1)
    error = _within(15, lambda: pull(URI, str(tmp_path / "c"), concurrency=1, block_size=65536,
                                     source_kwargs={"config": config}))
    assert isinstance(error, LoaderError) and "short read" in str(error) and "get_timeout_s" in str(error), error
    assert "\n" not in str(error)
    assert len([g for g in s3.gets if g[0].endswith("w.bin")]) <= 2


def test_a_dripping_listing_is_cut_at_the_deadline(s3, tmp_path):
    """A listing page sent one byte every 0.2 s (botocore reads a page whole, each read within
    the read timeout) held the pull for minutes. Bound: one line within 15 s (2 s deadline)."""
    from kvtier.errors import LoaderError
    from kvtier.loader.cache import pull
    from kvtier.loader.sources.s3 import S3Config

    s3.put(PREFIX + "w.bin", os.urandom(1000))
    s3.drip_listing_s = 0.2
    config = S3Config(endpoint_url=s3.endpoint_url, access_key="AK", secret_key="SK", region="us-east-1",
                      read_timeout_s=5.0, get_timeout_s=2.0, retries=0)
    error = _within(15, lambda: pull(URI, str(tmp_path / "c"), source_kwargs={"config": config}))
    assert isinstance(error, LoaderError) and "listing page" in str(error) and "\n" not in str(error), error


def _within(seconds: float, fn) -> BaseException | None:
    """Run ``fn`` on a daemon thread; what it raised (None if nothing), failing the test if it
    is still running after ``seconds`` (a hang)."""
    import threading

    box: list = []

    def run() -> None:
        try:
            fn()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001  (returned to the test)
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert box, f"still running after {time.monotonic() - t0:.0f} s (a hang)"
    return box[0]


def test_the_get_deadline_is_range_checked():
    from kvtier.errors import ConfigError
    from kvtier.loader.sources.s3 import S3Config

    for bad in (0, -1.0, "5"):
        with pytest.raises(ConfigError, match="get_timeout_s"):
            S3Config(get_timeout_s=bad)


@pytest.mark.parametrize("problem", ["cache dir is a file", "a segment too long"])
def test_a_cache_directory_that_cannot_be_made_is_one_line(s3, tmp_path, problem):
    """A careless --cache-dir (a regular file) or a URI segment longer than NAME_MAX ended in
    an OSError traceback; now exit 2 with one line naming the cache directory."""
    cache = tmp_path / "c"
    uri = URI
    if problem == "cache dir is a file":
        cache.write_text("not a directory")
    else:
        uri = "s3://b/" + "a" * 300 + "/"
    rc, err, _ = _pull(s3, cache, uri=uri)
    assert rc == 2 and err.startswith("kvtier pull: error: ") and "\n" not in err, err
    assert "cache directory" in err and "Traceback" not in err, err

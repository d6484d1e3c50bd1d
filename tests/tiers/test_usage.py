"""``used_bytes`` of self-managed tiers is a counter, never a walk or a listing (issue 25 item 1).

The fs tier answers from its own counters (this process's puts and deletes, exactly) plus a
background scan every ``usage_refresh_s`` for what other writers change; the s3 tier likewise
from a running total plus a background listing every ``list_interval_s``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from kvtier import entry
from kvtier.tiers.fs import FsConfig, FsTier

TENANT = 12345


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def fill(root, count: int, payload: int) -> int:
    """``count`` entry files written straight to disk (as other nodes would); their payload total."""
    for i in range(count):
        k = key(10_000 + i)
        sub = os.path.join(root, f"{k[0]:02x}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, k.hex()), "wb") as f:
            f.write(entry.encode_header(k, memoryview(bytes(payload))) + bytes(payload))
    return count * payload


def test_fs_used_bytes_is_a_counter_not_a_walk(tmp_path):
    root = tmp_path / "shared"
    total = fill(root, 3000, 64)
    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=3600), name="fs")
    try:
        assert wait_for(lambda: tier.used_bytes() == total)  # the first background scan
        calls = []
        for _ in range(300):
            t = time.perf_counter()
            tier.used_bytes()
            calls.append(time.perf_counter() - t)
        t = time.perf_counter()
        walked = sum(1 for _ in tier._walk())
        walk_s = time.perf_counter() - t
        assert walked == 3000
        median = statistics.median(calls)
        p95 = sorted(calls)[int(0.95 * len(calls))]
        print(f"fs used_bytes over 3000 entries: median {median * 1e6:.1f} us, p95 {p95 * 1e6:.1f} us; "
              f"one walk {walk_s * 1e3:.1f} ms")
        assert median < 1e-4 and p95 < 1e-3
        assert walk_s > 20 * median
        assert tier.put(key(1), b"a" * 1000) and tier.used_bytes() == total + 1000  # own put: at once
        assert tier.delete(key(1)) and tier.used_bytes() == total
    finally:
        tier.close()


def test_fs_used_bytes_reflects_other_writers_after_a_refresh_and_the_thread_stops(tmp_path):
    root = tmp_path / "shared"
    before = set(threading.enumerate())  # other tests' tiers may still be alive: judge only ours
    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=0.2), name="fs")
    other = FsTier(FsConfig(path=str(root), usage_refresh_s=0), name="other")
    try:
        assert tier.put(key(1), b"a" * 500)
        assert tier.used_bytes() == 500
        for i in range(5):
            assert other.put(key(100 + i), b"b" * 2000)
        assert wait_for(lambda: tier.used_bytes() == 10_500, timeout_s=5.0)
        assert other.delete(key(100))
        assert wait_for(lambda: tier.used_bytes() == 8_500, timeout_s=5.0)
    finally:
        tier.close()
        other.close()
    assert tier._thread is not None and not tier._thread.is_alive()
    assert not [t for t in set(threading.enumerate()) - before if t.name == "kvtier-fs-usage"]


def test_fs_own_changes_during_scans_are_counted_exactly(tmp_path, monkeypatch):
    """Puts, overwrites and deletes racing a scan that never stops: the count stays exact. The
    changes go on until three scans have ended (a scan's walk runs in a helper process, which
    may take a while to start on a busy machine), so the last ones saw the other writer's files."""
    tier = FsTier(FsConfig(path=str(tmp_path / "shared"), usage_refresh_s=0.001), name="fs")
    scans = []
    listing = tier._listing
    monkeypatch.setattr(tier, "_listing", lambda: (lambda got: scans.append(got is not None) or got)(listing()))
    try:
        fill(tmp_path / "shared", 200, 10)  # make each scan take a while
        expected = {}
        r = 0
        while (r < 300 or sum(scans) < 3) and r < 1_000_000:
            r += 1
            k = key(r % 40)
            if r % 7 == 3:
                if tier.delete(k):
                    expected.pop(k)
            else:
                assert tier.put(k, bytes(100 + r))
                expected[k] = 100 + r
        tier.close()  # no scan after this one
        tier._thread.join()
        assert tier.used_bytes() == sum(expected.values()) + 2000
    finally:
        tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a writer as another uid")
def test_fs_used_bytes_follows_a_writer_of_another_uid(tmp_path):
    base = tempfile.mkdtemp(prefix="kvtier-shared-")  # outside pytest's private tmp, so uid 12345 can reach it
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "kv")
        tier = FsTier(FsConfig(path=root, mode="0666", usage_refresh_s=0.2), name="fs")  # shared deliberately
        writer = textwrap.dedent("""
            import grp, os, sys
            from kvtier.tiers.fs import FsConfig, FsTier  # imported first: the interpreter may be root's only
            os.setgid(12345); os.setuid(12345)
            tier = FsTier(FsConfig(path=sys.argv[1], mode="0666", usage_refresh_s=0), name="tenant")
            for i in range(4):
                assert tier.put((500 + i).to_bytes(4, "little") * 8, b"t" * 3000), i
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", writer, root], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert wait_for(lambda: tier.used_bytes() == 12_000, timeout_s=5.0)
        owners = {os.stat(os.path.join(root, k.hex()[:2], k.hex())).st_uid for k in (key(500 + i) for i in range(4))}
        assert owners == {TENANT}
        tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -------------------------------------------------------------------------------------- s3


@pytest.mark.s3
def test_s3_used_bytes_never_lists_and_follows_other_nodes(s3_server, s3_bucket, monkeypatch):
    pytest.importorskip("boto3")
    from kvtier.tiers.s3 import S3Tier

    def make(**kw):
        config = S3Tier.Config(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url,
                               access_key=s3_server.access_key, secret_key=s3_server.secret_key, **kw)
        return S3Tier(config, name="s3")

    with make(list_interval_s=3600) as quiet:
        lists = []
        real = quiet._list
        monkeypatch.setattr(quiet, "_list", lambda: lists.append(1) or real())
        assert quiet.put(key(1), b"q" * 700)
        for _ in range(50):
            assert quiet.used_bytes() == 700
        assert lists == []  # the caller's thread never listed
    with make(list_interval_s=0.3) as tier, make(list_interval_s=0) as other:
        assert other.put(key(2), b"o" * 1200)
        assert wait_for(lambda: tier.used_bytes() == 1900, timeout_s=10.0)
        assert tier.put(key(3), b"t" * 100) and tier.used_bytes() == 2000
        assert other.delete(key(2))
        assert wait_for(lambda: tier.used_bytes() == 800, timeout_s=10.0)
    assert not [t for t in threading.enumerate() if t.name == "kvtier-s3-usage" and t.is_alive()
                and not wait_for(lambda t=t: not t.is_alive(), 2.0)]


def test_fs_files_it_cannot_remove_do_not_make_every_put_walk(tmp_path, monkeypatch):
    """Over budget with files this process may not remove (another user's): puts rescan at most
    about once a second, not once each."""
    import kvtier.tiers.fs as fs_mod

    root = tmp_path / "shared"
    fill(root, 50, 1000)
    monkeypatch.setattr(fs_mod, "unlink_at", lambda *a, **kw: False)  # a fault: every removal refused
    tier = FsTier(FsConfig(path=str(root), capacity=10_000, usage_refresh_s=0), name="fs")
    try:
        assert tier.used_bytes() == 50_000
        walks = []
        real_listing = tier._listing
        monkeypatch.setattr(tier, "_listing", lambda: walks.append(1) or real_listing())
        start = time.monotonic()
        for i in range(40):
            assert tier.put(key(i), b"n" * 100)
        took = time.monotonic() - start
        assert len(walks) <= 2 + took / 1.0, (len(walks), took)
        assert tier.used_bytes() >= 50_000
    finally:
        tier.close()


# ------------------------------------------------------------------------------ fs scans off the GIL (issue 25)


def test_fs_scan_walks_in_a_helper_process_not_on_this_interpreter(tmp_path, monkeypatch):
    """A usage scan of 100,000 entries cost ~0.5 s of this process's CPU, mostly holding the
    interpreter lock the engine's threads need (``kvtier bench store --lower fs``: RAM-hit p99
    over 5 x alone's). The walk's stat calls now run in a helper process: none in this one, and
    the count is the same."""
    root = tmp_path / "shared"
    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=0), name="fs")
    try:
        total = fill(root, 300, 10)
        assert tier.put(key(1), b"m" * 500)
        stats_here = []
        real_stat = os.stat
        me = threading.get_ident()

        def counting_stat(*args, **kwargs):
            if threading.get_ident() == me and kwargs.get("dir_fd") is not None:
                stats_here.append(args[0])
            return real_stat(*args, **kwargs)

        monkeypatch.setattr(os, "stat", counting_stat)
        tier._scan()
        monkeypatch.setattr(os, "stat", real_stat)
        assert tier.used_bytes() == total + 500
        assert len(stats_here) < 10, f"{len(stats_here)} stat calls in this process for 301 entries"
    finally:
        tier.close()


@pytest.mark.parametrize("helper", [True, False], ids=["through-the-helper", "no-helper-walks-here"])
def test_fs_scan_counts_removes_stale_temps_and_counts_foreign_names(tmp_path, monkeypatch, helper):
    """A scan through the helper process, and (a fault: the helper cannot be started, fork
    refused) one that walks in this process instead: the same count, stale temps removed and
    foreign names counted."""
    root = tmp_path / "shared"
    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=0, stale_tmp_s=0), name="fs")
    try:
        total = fill(root, 50, 10)
        stale = root / f"{key(10_000)[0]:02x}" / ".junk.tmp"
        stale.write_bytes(b"x")
        os.utime(stale, (1, 1))
        (root / "zz").mkdir()  # not a fan-out name: ignored
        os.symlink(str(tmp_path), str(root / "ff"))  # a foreign fan-out name: skipped, counted
        if not helper:
            def refuse(*args, **kwargs):
                raise OSError(11, "Resource temporarily unavailable")

            monkeypatch.setattr("kvtier.tiers.fs.subprocess.Popen", refuse)
        errors = tier.stats.errors
        tier._scan()
        assert tier.used_bytes() == total
        assert not stale.exists()
        assert tier.stats.errors == errors + 1
    finally:
        tier.close()


def test_fs_close_stops_a_scan_under_way_and_its_helper(tmp_path, monkeypatch):
    """``close`` during a scan: the helper is killed, the partial scan is discarded (the count
    keeps its value) and no helper process is left behind."""
    import kvtier.tiers.fs as fs_mod

    root = tmp_path / "shared"
    tier = FsTier(FsConfig(path=str(root), usage_refresh_s=0), name="fs")
    fill(root, 20, 10)
    started = threading.Event()
    helpers = []
    real_popen = fs_mod.subprocess.Popen

    def slow_helper(cmd, **kwargs):  # the helper, held back by a sleep before it walks
        proc = real_popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"], **kwargs)
        helpers.append(proc)
        started.set()
        return proc

    monkeypatch.setattr(fs_mod.subprocess, "Popen", slow_helper)
    scan = threading.Thread(target=tier._scan)
    scan.start()
    assert started.wait(10.0)
    tier.close()
    scan.join(10.0)
    assert not scan.is_alive()
    assert helpers[0].poll() is not None
    assert tier.used_bytes() == 0  # the scan at start saw an empty directory; the killed one counts nothing

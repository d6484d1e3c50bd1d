"""`kvtier pull` and the S3 source against a hostile S3 endpoint of the tests' own (issue 24, 1-4).

The endpoint (``hostile_s3.HostileS3``) lists names that climb out of the cache, claims sizes no
disk holds, answers ranged GETs with the whole object or a lying Content-Range, and replaces
objects in the middle of a pull. Each test drives the public CLI (``kvtier pull``, in-process or
as a real process) or the public ``StreamReader`` through kvtier's real boto3 client.
Bounds: every refusal is one line on stderr within seconds; a pull of an object listed at 2**62
bytes ends within 20 s at under 64 MiB above the peak RSS of a pull refused for a bad name (each
process's own ``ru_maxrss``, from ``os.wait4``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvtier.errors import LoaderError
from kvtier.loader.cache import MARKER, cache_path

from tests.loader.hostile_s3 import HostileS3

pytest.importorskip("boto3")

PREFIX = "models/m/"
URI = f"s3://b/{PREFIX}"
KiB = 1024


@pytest.fixture
def s3(monkeypatch):
    server = HostileS3("b")
    for k, v in {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": server.endpoint_url}.items():
        monkeypatch.setenv(k, v)
    yield server
    server.close()


def _pull(s3: HostileS3, cache, capsys, *extra: str) -> tuple[int, str]:
    """Run `kvtier pull URI` in-process; (exit code, stderr stripped)."""
    from kvtier.cli import main

    rc = main(["pull", URI, "--cache-dir", str(cache), "--endpoint-url", s3.endpoint_url, "--no-progress",
               "--block-size", "64KiB", "--concurrency", "1", *extra])
    return rc, capsys.readouterr().err.strip()


def _one_error_line(rc: int, err: str) -> None:
    assert rc == 2 and err.startswith("kvtier pull: error: ") and "\n" not in err, (rc, err)


def _files(root) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


# -- 1. names that leave the cache ---------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "../../../../../escaped.txt",          # climbs out of the cache directory
    "ABS/abs.txt",                         # models/m//<tmp>/abs.txt: an absolute part
    "a//b.txt", "./x.txt", "sub/../../x.txt", "x\x00y.txt", "\\abs\\x.txt", "c:\\x.txt",
    MARKER, "w.safetensors.partial",       # kvtier's own bookkeeping names
])
def test_pull_refuses_names_that_leave_the_cache(s3, tmp_path, capsys, name):
    if name.startswith("ABS"):
        name = str(tmp_path) + name[3:]  # "/tmp/.../abs.txt": joined, it replaces the cache path
    s3.put(PREFIX + "config.json", b"{}")
    s3.fallback = s3.put(PREFIX + name, b"planted by the bucket\n")  # also for a normalised path
    s3.listing = [(PREFIX + "config.json", 2), (PREFIX + name, 22)]
    before = _files(tmp_path)
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert "object name" in err and repr(name)[1:-1][:40] in err, err
    dest = cache_path(str(tmp_path / "c"), URI)
    new = _files(tmp_path) - before
    assert all(p.startswith(dest + os.sep) or p == dest + ".lock" for p in new), new  # nothing outside the cache
    assert not os.path.exists(os.path.join(dest, MARKER))
    assert not any(g[0] != PREFIX + "config.json" for g in s3.gets), s3.gets  # refused before any GET


def test_nested_relative_names_still_pull(s3, tmp_path, capsys):
    """A name with clean relative segments lands in a subdirectory of the cache, as listed."""
    s3.put(PREFIX + "config.json", b"{}")
    s3.put(PREFIX + "sub/w.bin", b"w" * 1000)
    s3.listing = [(PREFIX + "config.json", 2), (PREFIX + "sub/w.bin", 1000)]
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    dest = cache_path(str(tmp_path / "c"), URI)
    assert open(os.path.join(dest, "sub", "w.bin"), "rb").read() == b"w" * 1000


def test_pull_refuses_a_name_that_is_also_a_directory(s3, tmp_path, capsys):
    s3.put(PREFIX + "sub", b"file")
    s3.put(PREFIX + "sub/w.bin", b"w")
    s3.listing = [(PREFIX + "sub", 4), (PREFIX + "sub/w.bin", 1)]
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert "'sub/w.bin'" in err and not s3.gets


def test_pull_refuses_a_symlinked_subdirectory_that_leaves_the_cache(s3, tmp_path, capsys):
    """A cache subdirectory replaced by a link elsewhere: the resolved path leaves the cache."""
    s3.put(PREFIX + "sub/w.bin", b"w" * 1000)
    dest = cache_path(str(tmp_path / "c"), URI)
    os.makedirs(dest)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", os.path.join(dest, "sub"))
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert "outside" in err and os.listdir(tmp_path / "elsewhere") == []


# -- 2. a ranged GET must be answered with that range ---------------------------------------------

@pytest.mark.parametrize("fault", ["200", "start", "end", "total"])
def test_pull_refuses_an_answer_that_is_not_the_range(s3, tmp_path, capsys, fault):
    data = os.urandom(256 * KiB)
    s3.put(PREFIX + "w.safetensors", data)
    if fault == "200":
        s3.ignore_range_after = 1  # a proxy that drops Range from the second request on
    else:
        lie = {"start": lambda a, b, t: f"bytes 0-{b - a}/{t}", "end": lambda a, b, t: f"bytes {a}-{b + 1}/{t}",
               "total": lambda a, b, t: f"bytes {a}-{b}/{t + 1}"}[fault]
        s3.content_range = lambda a, b, t: lie(a, b, t) if a else f"bytes {a}-{b}/{t}"
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert ("206" if fault == "200" else "Content-Range") in err, err
    dest = cache_path(str(tmp_path / "c"), URI)
    assert not os.path.exists(os.path.join(dest, "w.safetensors")) and not os.path.exists(os.path.join(dest, MARKER))


# -- 3. one version per file --------------------------------------------------------------------

@pytest.mark.parametrize("honor_if_match", [True, False])
def test_an_object_replaced_mid_pull_is_pulled_again_whole(s3, tmp_path, capsys, honor_if_match):
    """The object changes (same size) after two blocks: the file restarts and holds only the new version."""
    old, new = os.urandom(512 * KiB), os.urandom(512 * KiB)
    s3.put(PREFIX + "w.safetensors", old)
    s3.honor_if_match = honor_if_match  # False: the new bytes come back with their new ETag

    def swap(server, key, n):
        if n == 3:
            server.put(key, new)
    s3.on_get = swap
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    dest = cache_path(str(tmp_path / "c"), URI)
    assert open(os.path.join(dest, "w.safetensors"), "rb").read() == new
    assert all(g[2] is not None for g in s3.gets)  # every ranged GET carried If-Match


def test_an_object_that_keeps_changing_ends_in_one_line(s3, tmp_path, capsys):
    s3.put(PREFIX + "w.safetensors", os.urandom(256 * KiB))
    s3.on_get = lambda server, key, n: server.put(key, os.urandom(256 * KiB))
    start = time.monotonic()
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert "changed" in err and time.monotonic() - start < 30, err
    dest = cache_path(str(tmp_path / "c"), URI)
    assert not os.path.exists(os.path.join(dest, "w.safetensors")) and not os.path.exists(os.path.join(dest, MARKER))


def test_a_resumed_pull_restarts_when_the_object_changed_at_the_same_size(s3, tmp_path, capsys):
    old, new = os.urandom(512 * KiB), os.urandom(512 * KiB)
    s3.put(PREFIX + "w.safetensors", old)
    s3.fail_gets_after = 3  # the first pull dies after three blocks
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 2, err
    dest = cache_path(str(tmp_path / "c"), URI)
    assert os.path.exists(os.path.join(dest, "w.safetensors.partial"))
    s3.fail_gets_after = None
    s3.put(PREFIX + "w.safetensors", new)
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    assert open(os.path.join(dest, "w.safetensors"), "rb").read() == new


def test_a_resumed_pull_of_an_unchanged_object_fetches_only_the_rest(s3, tmp_path, capsys):
    data = os.urandom(512 * KiB)
    s3.put(PREFIX + "w.safetensors", data)
    s3.fail_gets_after = 3
    assert _pull(s3, tmp_path / "c", capsys)[0] == 2
    s3.fail_gets_after = None
    s3.gets.clear()
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    assert len(s3.gets) == 8 - 3  # 512 KiB in 64 KiB blocks, three already journaled
    assert open(os.path.join(cache_path(str(tmp_path / "c"), URI), "w.safetensors"), "rb").read() == data


def test_a_resume_without_any_version_to_check_starts_over(s3, tmp_path, capsys):
    """A server that sends no ETag: nothing proves the journaled blocks are of today's object."""
    s3.send_etag = False
    old, new = os.urandom(512 * KiB), os.urandom(512 * KiB)
    s3.put(PREFIX + "w.safetensors", old)
    s3.fail_gets_after = 3
    assert _pull(s3, tmp_path / "c", capsys)[0] == 2
    s3.fail_gets_after = None
    s3.put(PREFIX + "w.safetensors", new)
    s3.gets.clear()
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    assert len(s3.gets) == 8
    assert open(os.path.join(cache_path(str(tmp_path / "c"), URI), "w.safetensors"), "rb").read() == new


def test_a_resume_with_another_block_size_restarts(s3, tmp_path, capsys):
    """The journal's block numbers mean nothing at another block size: start over, never trust them."""
    data = os.urandom(512 * KiB)
    s3.put(PREFIX + "w.safetensors", data)
    s3.fail_gets_after = 3
    assert _pull(s3, tmp_path / "c", capsys)[0] == 2
    s3.fail_gets_after = None
    from kvtier.cli import main

    assert main(["pull", URI, "--cache-dir", str(tmp_path / "c"), "--no-progress", "--block-size", "256KiB"]) == 0
    assert open(os.path.join(cache_path(str(tmp_path / "c"), URI), "w.safetensors"), "rb").read() == data


def test_a_finished_file_is_pulled_again_when_its_object_changed(s3, tmp_path, capsys):
    """A.bin completed, B.bin failed; A changes at the same size before the rerun: A is fetched again."""
    s3.put(PREFIX + "a.bin", os.urandom(100 * KiB))
    s3.put(PREFIX + "b.bin", os.urandom(300 * KiB))
    s3.fail_gets_after = 3  # a.bin's two blocks, then b.bin fails
    assert _pull(s3, tmp_path / "c", capsys)[0] == 2
    dest = cache_path(str(tmp_path / "c"), URI)
    assert os.path.exists(os.path.join(dest, "a.bin"))
    s3.fail_gets_after = None
    new_a = os.urandom(100 * KiB)
    s3.put(PREFIX + "a.bin", new_a)
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    assert open(os.path.join(dest, "a.bin"), "rb").read() == new_a


def _safetensors(seed: int) -> bytes:
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    return save({"a": torch.randn(256, 256, generator=g), "b": torch.randn(128, 256, generator=g)})


@pytest.mark.parametrize("honor_if_match", [True, False])
def test_the_streaming_reader_refuses_an_object_replaced_mid_stream(s3, honor_if_match):
    from kvtier.loader.reader import ReaderConfig, StreamReader

    old, new = _safetensors(1), _safetensors(2)
    assert len(old) == len(new)
    s3.put(PREFIX + "w.safetensors", old)
    s3.honor_if_match = honor_if_match
    s3.on_get = lambda server, key, n: server.put(key, new) if n == 4 else None
    cfg = ReaderConfig(block_size="64KiB", concurrency=1, endpoint_url=s3.endpoint_url)
    with StreamReader([URI + "w.safetensors"], cfg) as reader:
        with pytest.raises(LoaderError, match="changed"):
            list(reader.stream())


def test_the_streaming_reader_refuses_a_200_to_a_ranged_get(s3):
    from kvtier.loader.reader import ReaderConfig, StreamReader

    s3.put(PREFIX + "w.safetensors", _safetensors(1))
    cfg = ReaderConfig(block_size="64KiB", concurrency=1, endpoint_url=s3.endpoint_url)
    with StreamReader([URI + "w.safetensors"], cfg) as reader:
        s3.ignore_range_after = len(s3.gets)  # the header was read; every tensor read gets the whole object
        with pytest.raises(LoaderError, match="206"):
            list(reader.stream())


def test_the_streaming_reader_reads_a_well_behaved_object(s3):
    import torch
    from safetensors.torch import load

    data = _safetensors(3)
    s3.put(PREFIX + "w.safetensors", data)
    cfg = ReaderConfig_ = None  # noqa: F841
    from kvtier.loader.reader import ReaderConfig, load_tensors

    got = load_tensors(URI + "w.safetensors", ReaderConfig(block_size="64KiB", concurrency=2,
                                                           endpoint_url=s3.endpoint_url))
    ref = load(data)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


# -- 4. sizes no disk holds ---------------------------------------------------------------------

def _pull_process(s3: HostileS3, cache, *extra: str) -> tuple[int, str, int, float]:
    """`kvtier pull` as a real process: (exit code, stderr, its peak RSS in bytes, seconds)."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_REGION": "us-east-1"}
    cmd = [sys.executable, "-m", "kvtier.cli", "pull", URI, "--cache-dir", str(cache), "--endpoint-url",
           s3.endpoint_url, "--no-progress", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err.strip(), usage.ru_maxrss * 1024, time.monotonic() - start


_BASELINE: list[int] = []


def _baseline_rss(s3: HostileS3, tmp_path) -> int:
    """Peak RSS of a `kvtier pull` process refused at its listing for a name (imports, one listing)."""
    if not _BASELINE:
        saved = s3.listing
        s3.listing = [(PREFIX + "../x", 1)]
        rc, err, rss, _ = _pull_process(s3, tmp_path / "baseline")
        s3.listing = saved
        assert rc == 2, err
        _BASELINE.append(rss)
    return _BASELINE[0]


@pytest.mark.parametrize("size", [2**62, 2**45, 2**40 + 1])
def test_pull_refuses_a_listed_size_beyond_the_maximum(s3, tmp_path, size):
    """Bound: refused within 20 s, at most 64 MiB above the RSS of a pull refused for a name."""
    s3.put(PREFIX + "config.json", b"{}")
    s3.fallback = s3.put(PREFIX + "w.safetensors", b"", size=size)
    base = _baseline_rss(s3, tmp_path)
    rc, err, rss, secs = _pull_process(s3, tmp_path / "c")
    _one_error_line(rc, err)
    assert "w.safetensors" in err and "max-object-size" in err, err
    assert rss < base + 64 * 2**20 and secs < 20, (rss, base, secs)
    assert not any(g[0].endswith("w.safetensors") for g in s3.gets)


def test_pull_refuses_a_listing_larger_than_the_free_space(s3, tmp_path, capsys):
    cache = tmp_path / "c"
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    s3.put(PREFIX + "a.bin", b"", size=free // 2 + 2**30)
    s3.put(PREFIX + "b.bin", b"", size=free // 2 + 2**30)  # each fits, both do not
    rc, err = _pull(s3, cache, capsys, "--max-object-size", str(2**60))
    _one_error_line(rc, err)
    assert "free" in err, err
    assert not s3.gets


def test_max_object_size_flag(s3, tmp_path, capsys):
    s3.put(PREFIX + "w.bin", os.urandom(200 * KiB))
    rc, err = _pull(s3, tmp_path / "c", capsys, "--max-object-size", "100KiB")
    _one_error_line(rc, err)
    assert "204800" in err.replace(",", "") and "--max-object-size" in err, err
    rc, err = _pull(s3, tmp_path / "c", capsys, "--max-object-size", "1MiB")
    assert rc == 0, err


def test_load_refuses_an_object_beyond_its_max_object_size(s3, capsys):
    """`kvtier load s3://...` (the streaming reader, no cache): the HEAD's size is bounded too."""
    from kvtier.cli import main

    s3.put(PREFIX + "w.safetensors", _safetensors(1))
    rc = main(["load", URI, "--endpoint-url", s3.endpoint_url, "--no-progress", "--max-object-size", "64KiB"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("kvtier load: error: ") and "\n" not in err, err
    assert "maximum object size 65,536 bytes" in err and not s3.gets, err


@pytest.mark.parametrize("size", ["-1", "12abc"])
def test_pull_refuses_a_size_that_is_not_a_size(s3, tmp_path, capsys, size):
    s3.put(PREFIX + "w.bin", b"x")
    s3.listing = [(PREFIX + "w.bin", size)]
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)


def test_pull_refuses_a_head_that_disagrees_with_the_listing(s3, tmp_path, capsys):
    s3.put(PREFIX + "w.bin", os.urandom(100 * KiB))
    s3.listing = [(PREFIX + "w.bin", 50 * KiB)]
    rc, err = _pull(s3, tmp_path / "c", capsys)
    _one_error_line(rc, err)
    assert "size" in err


def test_a_clean_pull_records_versions_in_the_marker(s3, tmp_path, capsys):
    s3.put(PREFIX + "w.bin", os.urandom(100 * KiB))
    s3.put(PREFIX + "config.json", b"{}")
    rc, err = _pull(s3, tmp_path / "c", capsys)
    assert rc == 0, err
    marker = json.load(open(os.path.join(cache_path(str(tmp_path / "c"), URI), MARKER)))
    assert marker["files"] == {"config.json": 2, "w.bin": 100 * KiB}
    assert marker["versions"]["w.bin"] == s3.objects[PREFIX + "w.bin"].etag

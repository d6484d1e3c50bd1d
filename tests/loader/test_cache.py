"""The node cache with a local source (no server needed): journal, resume, two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.loader.cache import MARKER, _read_journal, cache_path, is_complete, pull


def _src(tmp_path, size=300_000):
    d = tmp_path / "remote"
    d.mkdir()
    (d / "a.safetensors").write_bytes(os.urandom(size))
    (d / "config.json").write_text("{}")
    return d


def test_journal_ignores_a_cut_line(tmp_path):
    j = tmp_path / "j"
    j.write_text("H\n0\n1\n12")
    assert _read_journal(str(j), "H", 100) == {0, 1}
    assert _read_journal(str(j), "another header", 100) == set()


def test_marker_is_checked_against_sizes(tmp_path):
    d = _src(tmp_path)
    uri = f"file://{d}"
    res = pull(uri, str(tmp_path / "c"), block_size=65536)
    assert res.downloaded and is_complete(res.path)
    with open(os.path.join(res.path, "a.safetensors"), "ab") as f:
        f.write(b"x")
    assert not is_complete(res.path)
    again = pull(uri, str(tmp_path / "c"), block_size=65536)  # repaired: the bad file is fetched again
    assert again.downloaded
    assert open(os.path.join(again.path, "a.safetensors"), "rb").read() == (d / "a.safetensors").read_bytes()


def test_stale_journal_without_partial_is_ignored(tmp_path):
    d = _src(tmp_path)
    uri = f"file://{d}"
    dest = cache_path(str(tmp_path / "c"), uri)
    os.makedirs(dest)
    with open(os.path.join(dest, "a.safetensors.partial.done"), "w") as f:
        f.write("0\n1\n2\n3\n4\n")
    res = pull(uri, str(tmp_path / "c"), block_size=65536)
    assert open(os.path.join(res.path, "a.safetensors"), "rb").read() == (d / "a.safetensors").read_bytes()


@pytest.mark.slow
def test_two_processes_one_download(tmp_path):
    d = _src(tmp_path, 8_000_000)
    cmd = [sys.executable, "-m", "kvtier.cli", "pull", f"file://{d}", "--cache-dir", str(tmp_path / "c"),
           "--json", "--no-progress", "--block-size", "256KiB", "--concurrency", "2"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    assert sorted(o["downloaded"] for o in outs) == [False, True]
    assert os.path.exists(os.path.join(outs[0]["path"], MARKER))
    assert open(os.path.join(outs[0]["path"], "a.safetensors"), "rb").read() == (d / "a.safetensors").read_bytes()


def test_pull_prints_the_directory_alone(tmp_path, capsys):
    """`vllm serve "$(kvtier pull URI)"` needs the cached directory, and nothing else, on stdout."""
    from kvtier.cli import main

    d = _src(tmp_path)
    args = ["pull", f"file://{d}", "--cache-dir", str(tmp_path / "c"), "--no-progress"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out == cache_path(str(tmp_path / "c"), f"file://{d}") + "\n" and is_complete(out.strip())
    assert "downloaded" in err
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert is_complete(out.strip()) and "already cached" in err

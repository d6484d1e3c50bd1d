"""The S3 source, the node cache and `kvtier pull` against SeaweedFS on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.errors import LoaderError
from kvtier.loader.cache import MARKER, cache_path, pull
from kvtier.loader.reader import ReaderConfig, StreamReader, load_tensors, model_files
from kvtier.loader.sources.s3 import S3Config, S3Source

pytestmark = pytest.mark.s3


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.access_key,
           "AWS_SECRET_ACCESS_KEY": s3_server.secret_key, "AWS_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def model(tmp_path, s3_server, s3_bucket, s3_env):
    """A two-file model with an index, uploaded under s3://BUCKET/m/."""
    g = torch.Generator().manual_seed(2)
    local = tmp_path / "m"
    local.mkdir()
    save_file({"a": torch.randn(300, 200, generator=g), "b": torch.arange(7)}, str(local / "x-1.safetensors"))
    save_file({"c": torch.randn(1000, generator=g).to(torch.bfloat16)}, str(local / "x-2.safetensors"))
    (local / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "x-1.safetensors", "b": "x-1.safetensors", "c": "x-2.safetensors"}}))
    client = s3_server.client()
    for name in os.listdir(local):
        client.upload_file(str(local / name), s3_bucket, f"m/{name}")
    return str(local), f"s3://{s3_bucket}/m/"


def _reference(local: str) -> dict:
    out = {}
    for name in sorted(os.listdir(local)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(local, name)))
    return out


def test_s3_round_trip(model):
    local, uri = model
    files = model_files(uri)
    assert [f.rsplit("/", 1)[1] for f in files] == ["x-1.safetensors", "x-2.safetensors"]
    got = load_tensors(uri, ReaderConfig(block_size="64KiB", memory_limit="256KiB", concurrency=4))
    ref = _reference(local)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_s3_slices(model):
    _, uri = model
    with StreamReader(model_files(uri), ReaderConfig(block_size="64KiB")) as r:
        got = dict(r.stream(tensor_names=["a"], slices={"a": (1, 50, 150)}))["a"]
    assert torch.equal(got, _reference(model[0])["a"][:, 50:150])


def test_missing_object_is_one_line_error(s3_bucket, s3_env):
    with pytest.raises(LoaderError, match="S3 error"):
        S3Source(f"s3://{s3_bucket}/nope.safetensors").size()


def test_transient_errors_are_retried(model, s3_env):
    """The first two GETs fail with 503; the read still succeeds (a fault injected by a wrapper)."""
    from botocore.exceptions import ClientError

    from kvtier.loader.sources.s3 import make_client

    real = make_client(S3Config())
    fails = [2]

    class Flaky:
        def __getattr__(self, name):
            return getattr(real, name)

        def get_object(self, **kw):
            if fails[0]:
                fails[0] -= 1
                raise ClientError({"Error": {"Code": "ServiceUnavailable"},
                                   "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
            return real.get_object(**kw)

    src = S3Source(model[1] + "x-2.safetensors", S3Config(backoff_s=0.001), client=Flaky())
    assert src.read(0, 8) == open(os.path.join(model[0], "x-2.safetensors"), "rb").read(8)
    assert fails[0] == 0


@pytest.mark.parametrize("journal", ["current", "unversioned"])
def test_pull_resumes_a_partial_download(model, tmp_path, s3_server, s3_bucket, journal):
    """A journal of this object's ETag and block size resumes; one without them (an older
    kvtier's, or another version's) is discarded and the file is fetched whole."""
    from kvtier.loader.cache import _journal_header

    local, uri = model
    cache = str(tmp_path / "cache")
    dest = cache_path(cache, uri)
    os.makedirs(dest)
    name = "x-1.safetensors"
    data = open(os.path.join(local, name), "rb").read()
    block = 64 * 1024
    etag = s3_server.client().head_object(Bucket=s3_bucket, Key=f"m/{name}")["ETag"]
    with open(os.path.join(dest, name + ".partial"), "wb") as f:  # block 0 done by a killed pull
        f.write(data[:block])
    with open(os.path.join(dest, name + ".partial.done"), "w") as f:
        f.write((_journal_header(len(data), block, etag) + "\n" if journal == "current" else "") + "0\n")
    result = pull(uri, cache, concurrency=4, block_size=block)
    sizes = {n: os.path.getsize(os.path.join(local, n)) for n in os.listdir(local)}
    assert result.downloaded
    assert result.bytes_downloaded == sum(sizes.values()) - (block if journal == "current" else 0)
    for n in sizes:
        assert open(os.path.join(dest, n), "rb").read() == open(os.path.join(local, n), "rb").read()
    assert not os.path.exists(os.path.join(dest, name + ".partial"))
    again = pull(uri, cache)
    assert not again.downloaded and again.path == dest


def test_two_processes_pull_once(model, tmp_path, s3_env):
    local, uri = model
    cache = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "kvtier.cli", "pull", uri, "--cache-dir", cache, "--json", "--no-progress",
           "--block-size", "64KiB", "--concurrency", "4"]
    env = {**os.environ, **s3_env}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    assert sorted(o["downloaded"] for o in outs) == [False, True]
    dest = outs[0]["path"]
    assert outs[1]["path"] == dest and os.path.exists(os.path.join(dest, MARKER))
    ref = _reference(local)
    got = load_tensors(dest)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_cli_load_through_cache(model, tmp_path, s3_env):
    from kvtier.cli import main

    assert main(["load", model[1], "--cache-dir", str(tmp_path / "c"), "--json", "--no-progress"]) == 0
    assert os.path.exists(os.path.join(cache_path(str(tmp_path / "c"), model[1]), MARKER))


def test_shard_pulls_an_s3_model_into_the_node_cache_first(model, tmp_path, capsys):
    """`kvtier shard s3://...` shards the node cache's copy (this model has no config.json, so the
    check after the pull stops it, naming the cached directory, before any engine starts)."""
    from kvtier.cli import main

    _, uri = model
    cache = str(tmp_path / "cache")
    assert main(["shard", uri, "--tp", "1", "--out", str(tmp_path / "o"), "--cache-dir", cache]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{cache_path(cache, uri)}: not a model directory with a config.json" in err
    assert os.path.exists(os.path.join(cache_path(cache, uri), MARKER))


def test_shard_of_a_malformed_s3_checkpoint_fails_before_pulling(model, tmp_path, s3_server, s3_bucket, capsys):
    """Issue 9, item 16 for s3://: every remote header is checked before a byte of weights is
    pulled into the node cache and before an engine starts; one line naming the object."""
    from kvtier.cli import main

    local, _ = model
    bad = b'{"w": {"dtype": "F32", "shape": [18446744073709551616, 0], "data_offsets": [0, 0]}}'
    with open(os.path.join(local, "x-2.safetensors"), "wb") as f:
        f.write(len(bad).to_bytes(8, "little") + bad)
    with open(os.path.join(local, "config.json"), "w") as f:
        f.write("{}")
    client = s3_server.client()
    for name in os.listdir(local):
        client.upload_file(os.path.join(local, name), s3_bucket, f"broken/{name}")
    uri = f"s3://{s3_bucket}/broken/"
    cache = tmp_path / "cache"
    assert main(["shard", uri, "--tp", "1", "--out", str(tmp_path / "o"), "--cache-dir", str(cache),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvtier shard: error: {uri}x-2.safetensors: tensor 'w': shape ") and "\n" not in err, err
    assert not cache.exists() and not (tmp_path / "o").exists()

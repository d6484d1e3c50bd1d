"""Per-rank slices equal ``safe_open(...).get_slice``; the pre-sharded writer round-trips."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtier.errors import LoaderError
from kvtier.loader.reader import ReaderConfig, StreamReader
from kvtier.loader.shard import rank_slices, shard_file_name, write_presharded


@pytest.fixture
def model(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(48, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(48, 128, generator=g),
        "model.norm.weight": torch.randn(48, generator=g),
        "cube": torch.randn(4, 8, 6, generator=g),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("mode", ["auto", "mmap", "read", "direct"])
def test_slices_equal_get_slice(model, dim, mode):
    cfg = ReaderConfig(block_size="4KiB", memory_limit="16KiB", local_mode=mode, concurrency=3)
    with StreamReader([model], cfg) as r, safe_open(model, "pt") as f:
        size = r.index["cube"][1].shape[dim]
        for start, stop in [(0, size // 2), (size // 2, size), (1, size - 1), (0, size)]:
            got = dict(r.stream(tensor_names=["cube"], slices={"cube": (dim, start, stop)}))["cube"]
            sl = f.get_slice("cube")
            idx = tuple([slice(None)] * dim + [slice(start, stop)])
            assert torch.equal(got, sl[idx])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_slices_match_get_slice(model, world):
    cfg = ReaderConfig(block_size="4KiB", memory_limit="16KiB", concurrency=4)
    with StreamReader([model], cfg) as r, safe_open(model, "pt") as f:
        for rank in range(world):
            pick = rank_slices(rank, world)
            for name, got in r.stream(slices=pick):
                spec = pick(r.index[name][1])
                if spec is None:
                    assert torch.equal(got, f.get_tensor(name))
                else:
                    dim, a, b = spec
                    assert torch.equal(got, f.get_slice(name)[tuple([slice(None)] * dim + [slice(a, b)])])


def test_uneven_split_is_an_error(model):
    with StreamReader([model]) as r:
        with pytest.raises(LoaderError, match="does not split evenly"):
            list(r.stream(slices=rank_slices(0, 5)))


def test_write_presharded(model, tmp_path):
    out = str(tmp_path / "tp2")
    paths = write_presharded([model], out, 2, ReaderConfig(block_size="4KiB", memory_limit="16KiB"),
                             max_part_bytes=8000)
    assert all(os.path.basename(p).startswith("model-rank-") for p in paths)
    assert os.path.join(out, shard_file_name(1, 0)) in paths
    with safe_open(model, "pt") as src:
        for rank in range(2):
            pick = rank_slices(rank, 2)
            seen = set()
            for p in [p for p in paths if f"-rank-{rank}-" in p]:
                with safe_open(p, "pt") as f:
                    assert f.metadata()["kvtier_tp_rank"] == str(rank)
                    for name in f.keys():
                        seen.add(name)
                        with StreamReader([model]) as r:
                            spec = pick(r.index[name][1])
                        want = src.get_tensor(name) if spec is None else \
                            src.get_slice(name)[tuple([slice(None)] * spec[0] + [slice(spec[1], spec[2])])]
                        assert torch.equal(f.get_tensor(name), want)
            assert seen == set(src.keys())

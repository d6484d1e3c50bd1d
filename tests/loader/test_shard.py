"""Per-rank slices equal ``safe_open(...).get_slice``; a pre-sharded layout gives each rank its own files."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtier.errors import LoaderError
from kvtier.loader.reader import ReaderConfig, StreamReader
from kvtier.loader.shard import ShardedLayout, rank_slices, shard_file_name


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


def test_layout_gives_each_rank_its_own_files():
    names = [shard_file_name(r, p) for r in range(4) for p in range(2)] + ["config.json", "model.safetensors"]
    layout = ShardedLayout.find(reversed(names), "d")
    assert (layout.tp_size, layout.pp_size) == (4, 1)
    for rank in range(4):
        assert layout.rank_files(rank, 4) == [shard_file_name(rank, 0), shard_file_name(rank, 1)]


def test_pipeline_layout():
    names = [shard_file_name(t, 0, pp_rank=p) for p in range(2) for t in range(2)]
    layout = ShardedLayout.find(names, "d")
    assert (layout.tp_size, layout.pp_size) == (2, 2)
    assert layout.rank_files(1, 2, pp_rank=1, pp_size=2) == ["model-pp-1-tp-1-part-0.safetensors"]


def test_no_layout():
    assert ShardedLayout.find(["model-00001-of-00002.safetensors", "config.json", "model-rank-x-part-0.safetensors"]) is None


def test_layout_for_another_world_size_is_refused():
    layout = ShardedLayout.find([shard_file_name(r, 0) for r in range(2)], "d")
    with pytest.raises(LoaderError, match=r"pre-sharded for tensor_parallel_size=2.*kvtier shard MODEL --tp 4"):
        layout.rank_files(0, 4)
    with pytest.raises(LoaderError, match="pipeline_parallel_size=2"):
        layout.rank_files(0, 2, 0, 2)


@pytest.mark.parametrize("names, problem", [
    ([shard_file_name(0, 0), shard_file_name(2, 0)], "lacks the files of tp rank 1"),
    ([shard_file_name(0, 0), shard_file_name(1, 1)], "part 0 of that rank is not"),
    ([shard_file_name(0, 0), shard_file_name(0, 0, pp_rank=0)], "both model-rank-"),
])
def test_incomplete_layout_is_an_error(names, problem):
    with pytest.raises(LoaderError, match=problem):
        ShardedLayout.find(names, "d")


def test_cpu_bind_gives_each_rank_its_own_cpus():
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm.shard import cpu_bind

    assert cpu_bind(2, [0, 1]) == "0|1"
    assert cpu_bind(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert cpu_bind(1, [3, 5]) == "3,5"
    with pytest.raises(ConfigError, match="needs at least 4 CPUs"):
        cpu_bind(4, [0, 1])

"""The streaming reader against safetensors itself: every dtype, both local modes, filters, errors."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.errors import ConfigError, LoaderError
from kvtier.loader.reader import ReaderConfig, StreamReader, load_tensors, model_files

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16, torch.bfloat16,
          torch.int32, torch.uint32, torch.float32, torch.int64, torch.uint64, torch.float64,
          torch.float8_e4m3fn, torch.float8_e5m2]


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@pytest.fixture
def every_dtype(tmp_path):
    tensors = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).split(".")[1]
        tensors[f"{name}.big"] = _tensor(dt, (257, 129), i)
        tensors[f"{name}.small"] = _tensor(dt, (3,), 100 + i)
        tensors[f"{name}.scalar"] = _tensor(dt, (), 200 + i)
        tensors[f"{name}.empty"] = _tensor(dt, (0, 4), 300 + i)
    path = str(tmp_path / "all.safetensors")
    save_file(tensors, path)
    return path


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].reshape(-1).view(torch.uint8) if b[k].numel() else b[k]), k


@pytest.mark.parametrize("mode", ["auto", "mmap", "read", "direct"])
@pytest.mark.parametrize("block", ["4KiB", "16MiB"])
def test_round_trip_every_dtype(every_dtype, mode, block):
    cfg = ReaderConfig(block_size=block, memory_limit="64KiB" if block == "4KiB" else "64MiB",
                       local_mode=mode, concurrency=4)
    _same(load_tensors(every_dtype, cfg), load_file(every_dtype))


def test_yielded_tensors_are_owned(every_dtype):
    """Tensors kept by the caller stay intact while the reader reuses its staging buffers."""
    names = [n for n in load_file(every_dtype) if n.endswith("small")]  # gaps -> staging buffers
    cfg = ReaderConfig(block_size="4KiB", memory_limit="8KiB", local_mode="read", concurrency=3)
    with StreamReader([every_dtype], cfg) as r:
        kept = dict(r.stream(tensor_names=names))
    ref = load_file(every_dtype)
    _same(kept, {n: ref[n] for n in names})


def test_memory_limit_bounds_allocations(tmp_path, monkeypatch):
    path = str(tmp_path / "m.safetensors")
    save_file({f"t{i}": torch.full((256, 256), float(i)) for i in range(16)}, path)  # 256 KiB each
    live, peak = [0], [0]
    real_empty = torch.empty

    def counting_empty(n, *a, **k):
        t = real_empty(n, *a, **k)
        if isinstance(n, int) and n >= 256 * 1024:
            live[0] += n
            peak[0] = max(peak[0], live[0])
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    cfg = ReaderConfig(block_size="64KiB", memory_limit="512KiB", local_mode="read", concurrency=4)
    with StreamReader([path], cfg) as r:
        for name, t in r.stream():
            assert torch.all(t == float(name[1:]))
            live[0] -= t.nbytes
    assert peak[0] <= 512 * 1024 + 256 * 1024


def test_filter_and_unknown_name(every_dtype):
    with StreamReader([every_dtype]) as r:
        got = dict(r.stream(tensor_names=["float32.big"]))
        assert list(got) == ["float32.big"]
        with pytest.raises(LoaderError, match="nope"):
            list(r.stream(tensor_names=["nope"]))


def test_check_values_rejects_nan(tmp_path):
    path = str(tmp_path / "nan.safetensors")
    save_file({"ok": torch.ones(4), "bad": torch.tensor([1.0, float("nan")])}, path)
    with pytest.raises(LoaderError, match="'bad' holds NaN"):
        load_tensors(path, ReaderConfig(check_values=True))
    assert load_tensors(path)["bad"].isnan().any()


def test_truncated_file_is_an_error(tmp_path):
    path = str(tmp_path / "t.safetensors")
    save_file({"a": torch.ones(1024)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(LoaderError, match="past the end"):
        load_tensors(path)


@pytest.mark.parametrize("shape", [[2**64, 0], [2**62, 4, 0]])
def test_shape_beyond_int64_is_refused_before_reading(tmp_path, shape):
    """Issue 9, item 15: such a shape passed validation and ended in a TypeError/RuntimeError in reshape."""
    raw = json.dumps({"z": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(LoaderError) as info:
        load_tensors(str(path))
    assert str(info.value).startswith(f"{path}: tensor 'z': shape ") and "\n" not in str(info.value)


def test_duplicate_tensor_names_are_refused(tmp_path):
    """Issue 9, item 15: json.loads kept the last of two entries of one name, silently."""
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}'
    raw = ('{"w": %s, "w": %s}' % (entry % (0, 4), entry % (4, 8))).encode()
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(LoaderError, match=r"dup\.safetensors: tensor 'w' appears more than once"):
        load_tensors(str(path))


def test_huge_index_is_refused_without_reading_it(tmp_path):
    """An index file is read whole: a 1 TB (sparse) one is refused before any allocation."""
    save_file({"a": torch.ones(1)}, str(tmp_path / "m-1.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(LoaderError, match=r"index\.json: index of 1099511627776 bytes exceeds"):
        model_files(str(tmp_path))


def test_file_shrinking_during_read_is_a_short_read(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_file({"a": torch.ones(1 << 16)}, path)
    with StreamReader([path], ReaderConfig(local_mode="read")) as r:
        with open(path, "r+b") as f:
            f.truncate(1000)
        with pytest.raises(LoaderError, match="short read"):
            list(r.stream())


def test_model_dir_with_index(tmp_path):
    from kvtier.loader.header import INDEX_NAME
    import json

    save_file({"a": torch.ones(3)}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "m-2.safetensors"))
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}))
    files = model_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["m-1.safetensors", "m-2.safetensors"]
    with StreamReader(files) as r:
        assert sorted(dict(r.stream())) == ["a", "b"]


def test_config_errors():
    with pytest.raises(ConfigError, match="memory_limit"):
        ReaderConfig(block_size="16MiB", memory_limit="1MiB")
    with pytest.raises(ConfigError, match="local_mode"):
        ReaderConfig(local_mode="fast")


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache, by ``mincore`` (which, unlike a probing read, starts
    no readahead)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:  # writable for ctypes, never written
        anchor = ctypes.c_char.from_buffer(m)  # the mapping's address; released before the unmap
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
        del anchor
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def _make_cold(path: str) -> None:
    """Drop ``path`` (only: other work shares the machine) from the page cache, retrying: one
    ``fadvise(DONTNEED)`` misses pages still held in another CPU's LRU batch. Skips where the
    kernel keeps them anyway (tmpfs), since then no file can be cold."""
    import time

    from kvtier.loader.probe import drop_file_cache

    for _ in range(20):
        drop_file_cache(path, system=False)
        if _resident_pages(path) == 0:
            return
        time.sleep(0.05)
    pytest.skip("the page cache keeps this file after fadvise(DONTNEED) (tmpfs?): nothing can be cold here")


def test_auto_mode_reads_ahead_a_cold_file(every_dtype):
    """Auto mode sees a file out of the page cache (readahead first) and a cached one (none)."""
    _make_cold(every_dtype)
    cfg = ReaderConfig(block_size="4KiB", memory_limit="64KiB", concurrency=4)
    with StreamReader([every_dtype], cfg) as r:
        got = dict(r.stream())
        assert r._cold == {every_dtype: True}
    _same(got, load_file(every_dtype))
    with StreamReader([every_dtype], cfg) as r:  # now cached: mapped, no I/O requests
        _same(dict(r.stream()), load_file(every_dtype))
        assert r._cold == {every_dtype: False}

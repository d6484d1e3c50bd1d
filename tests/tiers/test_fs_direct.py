"""The fs tier's ``o_direct`` writes: exact files that bypass this node's page cache, readable by
a buffered tier on the same directory, and a file system that refuses O_DIRECT (at start or at a
write) gets buffered writes, never a lost entry or a leftover temp file."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

import numpy as np
import pytest

import kvtier.tiers.direct as direct_mod
import kvtier.tiers.fs as fs_mod
from kvtier.tiers.fs import FsTier
from tests.tiers.test_disk_direct_attack import _bounces


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def make(path, **options) -> FsTier:
    return FsTier(FsTier.Config(path=str(path), usage_refresh_s=0, **options), name="fs")


def direct_tier(path, **options) -> FsTier:
    tier = make(path, o_direct=True, **options)
    if not tier.direct_io:
        tier.close()
        pytest.skip("the test directory's file system refuses O_DIRECT")
    return tier


def entry_files(root) -> list[str]:
    return [os.path.join(root, sub, name) for sub in os.listdir(root) if len(sub) == 2
            for name in os.listdir(os.path.join(root, sub))]


def resident_pages(path: str) -> int:
    """Pages of the file at ``path`` in the page cache now (``mincore`` on a private mapping
    that is never touched)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        finally:
            del anchor
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        m.close()


@pytest.mark.parametrize("size", [1, 4095, 4096, 65_537, (1 << 20) + 3])
def test_direct_entries_read_back_exactly_and_skip_the_page_cache(tmp_path, size):
    tier = direct_tier(tmp_path)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert tier.put(key(1), data)
    (path,) = entry_files(tmp_path)
    assert resident_pages(path) == 0  # what the writer wrote is not cached on its node
    header_bytes = os.path.getsize(path) - size
    assert 0 < header_bytes < 256  # exactly header + payload: the padding was truncated away
    assert tier.get(key(1)) == data
    with make(tmp_path) as buffered:  # another process (or node) reading it buffered
        assert buffered.get(key(1)) == data
    assert tier.stats.errors == 0 and tier.stats.corrupt == 0
    tier.close()


def test_coded_entries_are_written_direct_too(tmp_path):
    pytest.importorskip("blosc2")
    tier = direct_tier(tmp_path, codec="lossless")
    kv = (np.random.default_rng(3).standard_normal(1 << 17).astype(np.float32).view(np.uint32) >> 16)
    raw = kv.astype(np.uint16)
    assert tier.put(key(2), raw, dtype="bfloat16", shape=raw.shape)
    assert tier.stats.coded == 1
    (path,) = entry_files(tmp_path)
    assert os.path.getsize(path) < raw.nbytes and resident_pages(path) == 0
    out = np.zeros_like(raw)
    assert tier.get_into(key(2), out) == raw.nbytes and np.array_equal(out, raw)
    tier.close()


def test_a_refused_probe_leaves_the_tier_buffered_with_one_info_line(tmp_path, monkeypatch, caplog):
    def refusing(*args, **kwargs):  # a fake only to inject the fault: a file system without O_DIRECT
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_mod, "create_exclusive_at", refusing)
    with caplog.at_level(logging.INFO, logger=fs_mod.__name__):
        tier = make(tmp_path, o_direct=True)
    assert not tier.direct_io
    assert [r.levelno for r in caplog.records if "O_DIRECT" in r.getMessage()] == [logging.INFO]
    assert tier.put(key(1), b"x" * 5000) and tier.get(key(1)) == b"x" * 5000
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no probe left behind
    tier.close()


def test_einval_at_a_write_turns_the_tier_buffered_and_the_entry_still_lands(tmp_path, monkeypatch, caplog):
    tier = direct_tier(tmp_path)
    real = direct_mod.write_all

    def refusing(fd, bufs):  # a fake only to inject the fault: O_DIRECT refused on this file
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(direct_mod, "write_all", refusing)
    with caplog.at_level(logging.INFO, logger=fs_mod.__name__):
        assert tier.put(key(1), b"a" * 10_000)
        assert tier.put(key(2), b"b" * 10_000)
    monkeypatch.setattr(direct_mod, "write_all", real)
    assert not tier.direct_io
    assert len([r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]) == 1
    assert tier.get(key(1)) == b"a" * 10_000 and tier.get(key(2)) == b"b" * 10_000
    assert sorted(os.path.basename(p) for p in entry_files(tmp_path)) == sorted([key(1).hex(), key(2).hex()])
    assert tier.stats.errors == 0
    tier.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_direct_write_fault_is_a_counted_false_put_with_no_temp_left(tmp_path, monkeypatch, code):
    tier = direct_tier(tmp_path)
    assert tier.put(key(1), b"old" * 3000)

    def failing(fd, bufs):  # a fake only to inject the fault
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(direct_mod, "write_all", failing)
    assert tier.put(key(1), b"new" * 3000) is False
    assert tier.put(key(2), b"new" * 3000) is False
    assert tier.stats.errors == 2 and tier.direct_io  # a fault is not a refusal: still direct
    monkeypatch.undo()
    assert tier.get(key(1)) == b"old" * 3000 and tier.get(key(2)) is None
    assert [os.path.basename(p) for p in entry_files(tmp_path)] == [key(1).hex()]
    tier.close()


def test_close_unmaps_the_buffers_and_a_later_put_still_works(tmp_path):
    tier = direct_tier(tmp_path)
    assert tier.put(key(1), b"z" * 300_000)
    tier.close()
    idle = _bounces(tier)
    assert len(idle) == fs_mod._DIRECT_SLOTS and all(buf._map is None for buf in idle)
    assert tier.put(key(2), b"y" * 300_000) and tier.get(key(2)) == b"y" * 300_000
    tier.close()

"""A coded RAM arena (``RamConfig.codec: lossless``, ``kvtier serve``'s arena): entries are
written raw and coded in place by the tier's coder thread; readers get raw bytes or a miss.

The stored pages are forged the way another process that maps the arena file writable could
(a direct-write client): through the shared file, never through the tier's internals.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

import numpy as np
import pytest

from kvtier.config import build
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import KEY_BYTES
from kvtier.tiers.ram import CODED_BUDGET, RamConfig, RamTier

pytest.importorskip("blosc2")

MiB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * (KEY_BYTES // 4)


def _kv(i: int, nbytes: int = MiB) -> np.ndarray:
    """bf16-like KV bytes (normal values, the upper 16 bits of float32): they shrink ~1.2-1.4 x."""
    x = np.random.default_rng(i).normal(0, 1, nbytes // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


@pytest.fixture
def coded(tmp_path):
    made = []

    def make(capacity: int = 16 * MiB, page: int = 16 * 1024) -> RamTier:
        path = tmp_path / f"arena-{len(made)}"
        tier = RamTier(RamConfig(capacity=capacity, page_size=page, shm_path=str(path), codec="lossless"))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def _poke(tier: RamTier, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of the arena through its shared file (another process's view)."""
    fd = os.open(tier.config.shm_path, os.O_RDWR)
    try:
        with mmap.mmap(fd, tier.arena_bytes) as m:
            m[offset : offset + len(data)] = data
    finally:
        os.close(fd)


def _stored_offset(tier: RamTier, key: bytes) -> tuple[int, int]:
    with tier.borrow_stored(key) as stored:
        assert stored is not None and stored.codec == 1
        return tier.offset_of(stored.segments[0]), sum(int(s.size) for s in stored.segments)


def test_entries_are_coded_in_the_background_and_read_back_bit_exact(coded):
    tier = coded()
    chunks = [_kv(i) for i in range(6)]
    for i, c in enumerate(chunks):
        assert tier.put(_key(i), c)
    assert tier.drain(30)
    state = tier.codec_state()
    assert state["entries_coded"] == 6 and state["pending"] == 0
    assert tier.used_bytes() < 6 * MiB  # stored bytes, coded
    assert tier.free_bytes() > tier.arena_bytes - 6 * MiB  # the pages the coding freed are free
    assert tier.capacity_bytes == CODED_BUDGET * tier.arena_bytes  # raw-byte budget; pages are the limit
    out = np.empty(MiB, dtype=np.uint8)
    for i, c in enumerate(chunks):
        assert tier.size_of(_key(i)) == MiB  # the raw length, for the store's index
        assert tier.get_into(_key(i), out) == MiB and np.array_equal(out, c)
        assert np.array_equal(tier.views(_key(i), count=False)[0], c)
        with tier.borrow(_key(i)) as segs:
            assert np.array_equal(np.concatenate(list(segs)), c)


def test_a_coded_arena_holds_more_entries_than_a_raw_one_of_the_same_pages(coded, tmp_path):
    raw = RamTier(RamConfig(capacity=8 * MiB, page_size=16 * 1024))
    tier = coded(capacity=8 * MiB)
    try:
        for store in (raw, tier):
            i = 0
            while store.put(_key(i), _kv(i)):
                store.drain(30)
                i += 1
        assert len(list(tier.keys())) > len(list(raw.keys())) == 8
    finally:
        raw.close()


@pytest.mark.parametrize("forge", ["raw_length_lies", "codec_bytes_garbage", "truncated", "body_garbage"])
def test_a_forged_coded_entry_is_a_counted_miss_never_wrong_bytes(coded, forge):
    tier = coded()
    assert tier.put(_key(1), _kv(1)) and tier.drain(30)
    offset, stored = _stored_offset(tier, _key(1))
    # the Blosc2 chunk header: version, versionlz, flags, typesize, nbytes u32, blocksize u32, cbytes u32
    if forge == "raw_length_lies":
        _poke(tier, offset + 4, struct.pack("<I", 64 * MiB))
    elif forge == "codec_bytes_garbage":
        _poke(tier, offset, b"\xff\xfe\xfd\xfc")
    elif forge == "truncated":
        _poke(tier, offset + 12, struct.pack("<I", stored - 100))
    else:
        _poke(tier, offset + stored // 2, bytes(range(256)) * 16)
    out = np.full(MiB, 7, dtype=np.uint8)
    assert tier.get_into(_key(1), out) is None
    assert tier.views(_key(1)) is None
    with tier.borrow(_key(1)) as segs:
        with pytest.raises(CorruptEntry):
            segs[0]
    assert tier.stats.corrupt == 3 and tier.codec_state()["corrupt"] == 3


def test_a_reader_racing_a_delete_keeps_the_coded_pages_until_it_is_done(coded):
    tier = coded(capacity=4 * MiB)
    assert tier.put(_key(1), _kv(1)) and tier.drain(30)
    with tier.borrow_stored(_key(1)) as stored:
        before = [bytes(s) for s in stored.segments]
        assert tier.delete(_key(1))
        i = 2
        while tier.put(_key(i), _kv(i)):  # fill the arena: no page of the leased entry is reused
            tier.drain(30)
            i += 1
        assert [bytes(s) for s in stored.segments] == before
    free = tier.free_bytes()
    assert free >= len(before[0])  # released: its pages are back


def test_the_coder_never_moves_an_entry_a_reader_holds(coded):
    tier = coded()
    data = _kv(3)
    with tier.borrow(_key(3)) as segs:
        assert segs is None
    assert tier.put(_key(3), data)
    with tier.borrow(_key(3)) as segs:  # may be raw or already coded: either way stable while held
        snapshot = np.concatenate(list(segs)).copy()
        tier.drain(30)
        assert np.array_equal(np.concatenate(list(segs)), snapshot)
    assert np.array_equal(snapshot, data)


def test_readers_writers_deletes_and_the_coder_race_without_a_wrong_byte(coded):
    tier = coded(capacity=8 * MiB)
    data = {i: _kv(i, 256 * 1024) for i in range(24)}
    stop = threading.Event()
    wrong: list[int] = []

    def writer():
        n = 0
        while not stop.is_set():
            i = n % 24
            tier.delete(_key(i))
            tier.put(_key(i), data[i])
            n += 1

    def reader():
        out = np.empty(256 * 1024, dtype=np.uint8)
        n = 0
        while not stop.is_set():
            i = n % 24
            if tier.get_into(_key(i), out) is not None and not np.array_equal(out, data[i]):
                wrong.append(i)
            with tier.borrow(_key(i)) as segs:
                if segs is not None and not np.array_equal(np.concatenate(list(segs)), data[i]):
                    wrong.append(i)
            n += 1

    threads = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    stop.wait(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not wrong
    assert tier.stats.corrupt == 0
    for key in list(tier.keys()):
        tier.delete(key)
    assert tier.drain(30)
    assert tier.free_bytes() == tier.arena_bytes and tier.used_bytes() == 0  # no page leaked


def test_codec_on_an_engines_own_ram_tier_is_refused():
    with pytest.raises(ConfigError, match="kvtier serve's arena"):
        RamTier(RamConfig(capacity=MiB, page_size=4096, codec="lossless"))


@pytest.mark.parametrize("value", ["fp8", "auto", "zstd"])
def test_a_codec_a_ram_tier_does_not_take_is_one_line_listing_the_valid_ones(value):
    with pytest.raises(ConfigError) as info:
        build(RamConfig, {"codec": value}, "ram")
    message = str(info.value)
    assert "\n" not in message and "none" in message and "lossless" in message


def test_an_entry_evicted_while_the_coder_encodes_it_frees_its_pages_at_once(coded, monkeypatch):
    """Defect found by the arena benchmark: the coder pinned the entry it encoded, so an eviction
    of it freed nothing until the encode ended, and the store evicted one entry more."""
    from kvtier.codecs import Codec

    started, go = threading.Event(), threading.Event()
    encode = Codec.encode

    def slow_encode(self, raw, itemsize):  # fault injection: hold the coder inside its encode
        started.set()
        go.wait(10)
        return encode(self, raw, itemsize)

    monkeypatch.setattr(Codec, "encode", slow_encode)
    tier = coded(capacity=4 * MiB)
    assert tier.put(_key(1), _kv(1))
    assert started.wait(10)
    free = tier.free_bytes()
    assert tier.delete(_key(1))
    assert tier.free_bytes() == free + MiB  # back now, not when the encode ends
    assert tier.put(_key(2), _kv(2))  # may take the freed pages while the coder still reads them
    go.set()
    assert tier.drain(30)
    out = np.empty(MiB, dtype=np.uint8)
    assert tier.get_into(_key(2), out) == MiB and np.array_equal(out, _kv(2))
    assert tier.delete(_key(2)) and tier.drain(30)
    assert tier.free_bytes() == tier.arena_bytes and tier.used_bytes() == 0


def test_an_entry_in_several_runs_of_pages_is_coded_and_read_back(coded):
    tier = coded(capacity=4 * MiB, page=64 * 1024)
    assert tier.put(_key(1), _kv(1, 256 * 1024)) and tier.put(_key(2), _kv(2, 256 * 1024))
    assert tier.put(_key(3), _kv(3, 256 * 1024)) and tier.drain(30)
    assert tier.delete(_key(2))  # a hole between 1 and 3: the next entry takes it and pages after 3
    assert tier.put(_key(4), _kv(4, 2 * MiB)) and tier.drain(30)
    with tier.borrow_stored(_key(4)) as stored:
        assert stored.codec == 1
    out = np.empty(2 * MiB, dtype=np.uint8)
    assert tier.get_into(_key(4), out) == 2 * MiB and np.array_equal(out, _kv(4, 2 * MiB))
    for i in (1, 3):
        assert np.array_equal(tier.views(_key(i))[0], _kv(i, 256 * 1024))

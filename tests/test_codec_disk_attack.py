"""Hostile review of the bit-shuffle ``lossless`` coder and the O_DIRECT bounce copies through
``copy_pairs``: forged and truncated Blosc2 frames through a real fs tier (a counted miss, never
a crash, a write past the buffer or wrong bytes), odd lengths and element widths, determinism,
odd inputs and ``out`` buffers on a direct disk tier, concurrent direct puts/gets, and a direct
put or read after (or racing) ``close``."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("blosc2")

from kvtier import codecs, entry  # noqa: E402
from kvtier.errors import CorruptEntry  # noqa: E402
from kvtier.tiers.disk import DiskTier  # noqa: E402
from kvtier.tiers.fs import FsConfig, FsTier  # noqa: E402

KEY = hashlib.sha256(b"codec-disk-attack").digest()


def _kv(n: int, seed: int = 3) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 0.5, n).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _direct(path, **kw) -> DiskTier:
    kw.setdefault("capacity", 1 << 28)
    tier = DiskTier(DiskTier.Config(path=str(path), o_direct=True, **kw), name="disk")
    if not tier.direct_io:
        tier.close()
        pytest.skip("O_DIRECT unsupported here")
    return tier


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


# --- the coder --------------------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8, 255, 300])
@pytest.mark.parametrize("n", [4096, 4097, 4099, (256 << 10) - 1, 256 << 10, (256 << 10) + 3, 3 * (256 << 10) + 5])
def test_lossless_round_trips_odd_lengths_and_element_widths_deterministically(itemsize, n):
    """Lengths that are not a multiple of the element width, of the 256 KiB block, or just above
    the 4 KiB floor, at every element width (clamped to Blosc2's 255): bit-exact, and the same
    input codes to the same bytes (an entry rewritten by another writer is the same entry)."""
    raw = memoryview(np.ascontiguousarray(_kv(n // 2 + 2).view(np.uint8)[:n])).cast("B")
    coded = codecs.LOSSLESS.encode(raw, itemsize)
    if coded is None:  # declined: only where a frame at this width costs more than it saves
        assert n < 64 * 1024 and itemsize >= 255
        return
    assert len(coded) < n
    assert codecs.LOSSLESS.encode(raw, itemsize) == coded
    out = bytearray(n + 64)
    out[n:] = b"\xee" * 64
    codecs.decode_into(codecs.LOSSLESS_ID, memoryview(coded), memoryview(out)[:n], itemsize)
    assert bytes(out[:n]) == bytes(raw) and out[n:] == b"\xee" * 64


def test_noise_is_declined_and_an_unaligned_view_codes_like_an_aligned_copy():
    """A payload that does not shrink is stored raw (None), and a view that starts one byte into
    its buffer codes exactly as its aligned copy does."""
    noise = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert codecs.LOSSLESS.encode(memoryview(noise), 2) is None
    kv = _kv(200_001).view(np.uint8)
    odd = memoryview(kv[1:300_002]).cast("B")
    assert codecs.LOSSLESS.encode(odd, 2) == codecs.LOSSLESS.encode(memoryview(bytes(odd)), 2)


def _forgeries(frame: bytes) -> list[tuple[str, bytes]]:
    """Mutations of a real frame: each byte of the 32-byte Blosc2 header set to several values
    (flags, typesize, nbytes, blocksize, cbytes, filters, split/lazy/dict bits), truncations,
    a frame cut at each block boundary's bstarts and a frame padded with junk."""
    out = []
    for pos in range(32):
        for value in (0, 1, 2, 3, 4, 8, 0x10, 0x20, 0x7F, 0x80, 0xFF, frame[pos] ^ 0x01, frame[pos] ^ 0x10):
            forged = bytearray(frame)
            forged[pos] = value
            if bytes(forged) != frame:
                out.append((f"byte{pos}={value:#x}", bytes(forged)))
    for cut in (0, 1, 16, 31, 32, 33, 48, 64, len(frame) // 2, len(frame) - 1):
        out.append((f"cut{cut}", frame[:cut]))
    out.append(("padded", frame + b"\x00" * 64))
    return out


def test_forged_bitshuffle_frames_through_an_fs_tier_are_counted_misses(tmp_path):
    """A peer writing into a shared fs tier forges the Blosc2 frame of a coded entry (header
    fields, split flags, typesize, blocksize, truncation) under a header whose checksum and
    length are the real ones: each read is a counted corrupt miss or the exact bytes, never an
    exception, never a byte written past the entry's length in the caller's buffer."""
    kv = _kv(300_001)
    raw = memoryview(kv).cast("B")
    frame = codecs.LOSSLESS.encode(raw, 2)
    assert frame is not None
    tier = FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=1 << 26, codec="lossless"), name="fs")
    path = os.path.join(str(tmp_path / "fs"), f"{KEY[0]:02x}", KEY.hex())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    misses = 0
    for what, body in _forgeries(frame):
        header = entry.encode_header(KEY, raw, "bfloat16", None, None, body, codecs.LOSSLESS_ID)
        with open(path, "wb") as f:
            f.write(header + body)
        out = bytearray(raw.nbytes + 4096)
        out[raw.nbytes:] = b"\xab" * 4096
        before = tier.stats.corrupt
        got = tier.get_into(KEY, out)
        assert out[raw.nbytes:] == b"\xab" * 4096, what
        if got is None:
            assert tier.stats.corrupt == before + 1, what
            misses += 1
        else:
            assert got == raw.nbytes and bytes(out[:got]) == bytes(raw), what
    assert misses > 0
    tier.close()


def test_decode_into_takes_forged_frames_as_corrupt_entries_only():
    """``decode_into`` on forged new-style frames: CorruptEntry or a return, no other exception,
    and never a write outside ``out`` (canaries on both sides)."""
    raw = memoryview(_kv(150_001)).cast("B")
    frame = codecs.LOSSLESS.encode(raw, 4)
    for what, body in _forgeries(frame):
        buf = bytearray(raw.nbytes + 128)
        buf[:64] = buf[-64:] = b"\xcd" * 64
        try:
            codecs.decode_into(codecs.LOSSLESS_ID, memoryview(body), memoryview(buf)[64:-64], 4)
        except CorruptEntry:
            pass
        assert buf[:64] == b"\xcd" * 64 and buf[-64:] == b"\xcd" * 64, what


# --- the direct disk tier ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, (256 << 10) + 1, (1 << 20) + 4095])
def test_direct_round_trips_odd_lengths_into_larger_and_smaller_buffers(tmp_path, n):
    """Through the bounce buffer and ``copy_pairs``: payloads of odd lengths come back exact
    into a larger ``out`` whose tail is left alone; a smaller ``out`` is a counted error."""
    with _direct(tmp_path / "d") as tier:
        data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        assert tier.put(_key(1), data)
        out = np.full(n + 5000, 0x5A, np.uint8)
        assert tier.get_into(_key(1), out) == n
        assert np.array_equal(out[:n], data) and (out[n:] == 0x5A).all()
        if n:
            assert tier.get_into(_key(1), np.zeros(n - 1, np.uint8)) is None
            assert tier.stats.errors == 1


def test_direct_takes_typed_readonly_and_bytes_inputs_and_refuses_strided_ones(tmp_path):
    """Inputs to ``put`` on a direct tier: a float16 array of odd length, a 0-d array, a
    read-only array and bytes round-trip as their bytes (into a float32 ``out``); a strided view
    is refused before anything is written (TypeError, as on the buffered path), no file left."""
    with _direct(tmp_path / "d") as tier:
        inputs = [np.arange(2049, dtype=np.float16), np.array(7, np.int64),
                  np.frombuffer(b"r" * 300_001, np.uint8), b"b" * 4097]
        for i, data in enumerate(inputs):
            want = memoryview(data).tobytes()
            assert tier.put(_key(i), data)
            out = np.zeros(len(want) // 4 + 2, np.float32)
            assert tier.get_into(_key(i), out) == len(want)
            assert out.tobytes()[: len(want)] == want
        with pytest.raises(TypeError):
            tier.put(_key(9), np.arange(20_000, dtype=np.uint8)[::2])
        assert not tier.contains(_key(9))


def test_concurrent_direct_puts_and_gets_return_only_whole_payloads(tmp_path):
    """Six threads put and read six keys of odd sizes on a direct tier with two pooled bounce
    buffers (readers and writers share them, copies without the GIL): every hit is exactly one
    of the payloads put under that key, with no exception."""
    pool = np.random.default_rng(0).integers(0, 256, (1 << 20) + 64 * 1024, dtype=np.uint8)
    sizes = [0, 1, 4095, 4097, (256 << 10) + 1, (1 << 20) + 7]
    bad, errors, stop = [], [], threading.Event()
    tier = _direct(tmp_path / "d", max_writes_in_flight=2)

    def work(seed):
        rng = np.random.default_rng(seed)
        out = np.empty((1 << 20) + 4096, np.uint8)
        try:
            while not stop.is_set():
                k, n = int(rng.integers(6)), int(rng.choice(sizes))
                if rng.random() < 0.5:
                    tier.put(_key(k), pool[k * 1013 : k * 1013 + n])
                else:
                    got = tier.get_into(_key(k), out)
                    if got is not None and not np.array_equal(out[:got], pool[k * 1013 : k * 1013 + got]):
                        bad.append((k, got))
        except Exception as exc:  # noqa: BLE001 - any exception is the failure this test looks for
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(30)
    tier.close()
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and bad == [] and tier.stats.corrupt == 0


def _finishes(fn, timeout: float = 10.0):
    """``fn()`` on a daemon thread: (finished, result)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result


def _after_open(monkeypatch, action) -> None:
    """Fault injection: ``action(tier)`` runs right after a read opened its entry's file."""
    real = DiskTier._open_indexed

    def open_then_act(self, key, room):
        opened = real(self, key, room)
        action(self)
        return opened

    monkeypatch.setattr(DiskTier, "_open_indexed", open_then_act)


def test_a_direct_put_after_close_does_not_wait_forever_for_a_bounce_buffer(tmp_path):
    """``close`` freed the bounce buffers by taking them out of the pool: a direct put that ran
    after it (a writer thread that had not stopped yet) waited on the empty pool forever."""
    tier = _direct(tmp_path / "d")
    assert tier.put(_key(1), b"x" * 10_000)
    tier.close()
    done, result = _finishes(lambda: tier.put(_key(2), b"y" * 10_000))
    assert done, "a direct put after close hung on the emptied bounce pool"
    assert result == [True]


def test_a_direct_read_racing_close_does_not_wait_forever(tmp_path, monkeypatch):
    """A read that opened its entry just before ``close`` (fault injected: ``close`` runs
    between the open and the bounce read) finishes, exact or a miss; it waited forever."""
    tier = _direct(tmp_path / "d")
    data = np.random.default_rng(4).integers(0, 256, 70_001, dtype=np.uint8)
    assert tier.put(_key(1), data)
    _after_open(monkeypatch, DiskTier.close)
    out = np.zeros_like(data)
    done, result = _finishes(lambda: tier.get_into(_key(1), out))
    assert done, "a direct read racing close hung on the emptied bounce pool"
    assert result in ([data.nbytes], [None])
    if result == [data.nbytes]:
        assert np.array_equal(out, data)


def test_a_read_that_opened_direct_when_a_writer_fell_back_keeps_the_entry(tmp_path, monkeypatch):
    """A writer's O_DIRECT refusal turns the tier buffered while a reader holds a descriptor it
    opened with O_DIRECT (fault injected between the open and the read): that read may miss
    (a counted error), but the entry is neither dropped as corrupt nor wrong on the next read."""
    tier = _direct(tmp_path / "d")
    data = np.random.default_rng(6).integers(0, 256, 70_001, dtype=np.uint8)
    assert tier.put(_key(1), data)
    # a writer's EINVAL fallback
    _after_open(monkeypatch, lambda self: self._direct.refuse("write", OSError(errno.EINVAL, "refused")))
    out = np.zeros_like(data)
    got = tier.get_into(_key(1), out)
    assert got is None or (got == data.nbytes and np.array_equal(out, data))
    monkeypatch.undo()
    assert tier.stats.corrupt == 0
    out[:] = 0
    assert tier.get_into(_key(1), out) == data.nbytes and np.array_equal(out, data)
    tier.close()


def test_a_coded_ram_arena_codes_float32_entries_of_odd_length_bit_exactly(tmp_path):
    """The coded arena (``codec: lossless``) runs the new coder at the store's element width:
    float32 (4-byte elements) on an entry whose length is no multiple of 4 or of the 256 KiB
    block is coded in the background and reads back exact into a larger buffer."""
    from kvtier.tiers.ram import RamConfig, RamTier

    tier = RamTier(RamConfig(capacity=16 << 20, page_size=16 * 1024, shm_path=str(tmp_path / "arena"),
                             codec="lossless"))
    try:
        tier.set_element_dtype("float32")
        x = np.random.default_rng(0).normal(0, 1, 300_001).astype(np.float32).view(np.uint8)[: 1_200_003]
        assert tier.put(_key(1), x) and tier.drain(30)
        assert tier.codec_state()["entries_coded"] == 1
        out = np.full(x.nbytes + 100, 0x77, np.uint8)
        assert tier.get_into(_key(1), out) == x.nbytes
        assert np.array_equal(out[: x.nbytes], x) and (out[x.nbytes :] == 0x77).all()
    finally:
        tier.close()

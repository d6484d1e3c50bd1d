"""The entry format's fixed decision: every kind of corruption is the corruption error
(``CorruptEntry``) when parsed, and a counted miss (never wrong bytes, never a crash) when a
tier reads it (real files under a temp dir, through the ``fs`` and ``disk`` tiers)."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from typing import Callable

import numpy as np
import pytest

from kvtier import entry
from kvtier.errors import CorruptEntry, InvalidKey
from kvtier.tiers.disk import DiskConfig, DiskTier, entry_path
from kvtier.tiers.fs import FsConfig, FsTier

KEY = hashlib.sha256(b"entry").digest()
OTHER = hashlib.sha256(b"other").digest()
PAYLOAD = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()


def _good() -> bytes:
    return entry.encode(KEY, PAYLOAD)


def _patch_fixed(buf: bytes, offset: int, fmt: str, value, recrc: bool = True) -> bytes:
    """``buf`` with one fixed-header field replaced (and the header CRC made valid again, so
    only that field is wrong)."""
    out = bytearray(buf)
    struct.pack_into(fmt, out, offset, value)
    if recrc:
        fixed = entry._FIXED.size
        ndim = out[7]
        dims = bytes(out[entry.FIXED_BYTES : entry.FIXED_BYTES + 8 * ndim])
        struct.pack_into("<I", out, fixed, zlib.crc32(bytes(out[:fixed]) + dims))
    return bytes(out)


def _flip_payload_byte(buf: bytes) -> bytes:
    out = bytearray(buf)
    out[-1] ^= 0xFF
    return bytes(out)


def _forged_length(buf: bytes) -> bytes:
    """A header (valid CRC, shape agreeing) that announces 2**40 bytes before the real payload."""
    length = 1 << 40
    fixed = struct.pack("<4sHBBI32sQQQ", entry.MAGIC, entry.VERSION, entry.DTYPES["uint8"][0], 1, 0, KEY, length, 0,
                        length)
    dims = struct.pack("<Q", length)
    return fixed + struct.pack("<II", zlib.crc32(fixed + dims), 0) + dims + PAYLOAD


# name -> (corruption of a good entry, the reason CorruptEntry names)
CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "bad magic": (lambda b: _patch_fixed(b, 0, "<4s", b"XXXX"), "bad magic"),
    "unknown version": (lambda b: _patch_fixed(b, 4, "<H", entry.VERSION + 1), "version"),
    "unknown dtype": (lambda b: _patch_fixed(b, 6, "<B", 200), "dtype"),
    "header crc": (lambda b: _patch_fixed(b, 4 + 2 + 1 + 1 + 4 + 32, "<Q", 10_001, recrc=False), "header checksum"),
    "short header": (lambda b: b[: entry.FIXED_BYTES - 1], "short header"),
    "short shape": (lambda b: b[: entry.FIXED_BYTES + 4], "short header"),
    "short payload": (lambda b: b[:-1], "payload is"),
    "long payload": (lambda b: b + b"\0", "payload is"),
    "payload checksum": (_flip_payload_byte, "payload checksum"),
    "forged length": (_forged_length, "exceeds"),
    "empty": (lambda b: b"", "short header"),
}


def test_a_good_entry_round_trips():
    header, payload = entry.decode(_good(), expected_key=KEY, max_length=len(PAYLOAD))
    assert bytes(payload) == PAYLOAD and header.key == KEY and header.length == len(PAYLOAD)


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_every_corruption_is_the_corruption_error(kind):
    corrupt, reason = CORRUPTIONS[kind]
    with pytest.raises(CorruptEntry, match=reason):
        entry.decode(corrupt(_good()), expected_key=KEY, max_length=1 << 20)


def test_an_entry_of_another_key_is_the_corruption_error():
    with pytest.raises(CorruptEntry, match="another key"):
        entry.decode(entry.encode(OTHER, PAYLOAD), expected_key=KEY)


def test_a_length_over_the_readers_bound_is_corrupt_before_any_payload_is_read():
    header = entry.encode_header(KEY, PAYLOAD)
    with pytest.raises(CorruptEntry, match="exceeds"):
        entry.decode_header(header, max_length=len(PAYLOAD) - 1)
    assert entry.decode_header(header, max_length=len(PAYLOAD)).length == len(PAYLOAD)


def test_a_key_that_is_not_a_digest_is_refused_when_encoding():
    with pytest.raises(InvalidKey):
        entry.encode(b"short", PAYLOAD)


@pytest.fixture(params=["fs", "disk"])
def tier_and_path(request, tmp_path):
    """A real tier over a temp dir and the function giving an entry's file."""
    if request.param == "fs":
        tier = FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=1 << 30), name="fs")
        path = lambda k: os.path.join(str(tmp_path / "fs"), f"{k[0]:02x}", k.hex())  # noqa: E731
    else:
        tier = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity=1 << 24, drop_cache=False), name="disk")
        path = lambda k: entry_path(str(tmp_path / "disk"), k, True)  # noqa: E731
    yield tier, path
    tier.close()


@pytest.mark.parametrize("kind", ["bad magic", "unknown version", "short payload", "payload checksum",
                                  "forged length", "header crc"])
def test_a_corrupt_file_is_a_counted_miss_in_a_tier(tier_and_path, kind):
    tier, path = tier_and_path
    assert tier.put(KEY, np.frombuffer(PAYLOAD, dtype=np.uint8))
    with open(path(KEY), "wb") as f:  # the bytes rot under the tier
        f.write(CORRUPTIONS[kind][0](_good()))
    out = bytearray(len(PAYLOAD))
    assert tier.get_into(KEY, out) is None
    assert tier.get(KEY) is None
    assert tier.stats.as_dict()["corrupt"] >= 1
    assert not os.path.exists(path(KEY))  # a corrupt entry is removed, not served again


def test_an_entry_of_another_key_in_a_tier_is_a_counted_miss(tier_and_path):
    tier, path = tier_and_path
    assert tier.put(KEY, np.frombuffer(PAYLOAD, dtype=np.uint8))
    with open(path(KEY), "wb") as f:  # another key's (valid) entry under this key's name
        f.write(entry.encode(OTHER, PAYLOAD))
    assert tier.get(KEY) is None
    assert tier.stats.as_dict()["corrupt"] >= 1

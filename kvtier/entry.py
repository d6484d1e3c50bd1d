"""The entry format: a small fixed binary header followed by the raw payload bytes.

Layout (little-endian)::

    magic      4s   b"KVTE"
    version    u16  1
    dtype      u8   code from DTYPES
    ndim       u8   0..8
    flags      u32  0 (reserved)
    key        32s  the chunk key
    length     u64  payload bytes
    checksum   u64  xxh3-64 of the payload
    hdr_crc    u32  crc32 of everything above and the shape
    pad        u32  0
    shape      ndim x u64

Parsing never trusts the header: the magic, version, dtype and ndim are checked, the header's own
crc32 must match, shape x itemsize must equal the length, and the payload's checksum must match.
Every failure raises CorruptEntry, which readers turn into a counted miss. No pickle.

A header's length is never trusted for an allocation: readers pass ``max_length`` (what the tier
can hold, what the store expects a chunk to weigh) and a larger length is a corrupt entry.

Keys are fixed-length digests (``KEY_BYTES``, as ``kvtier.keys`` makes them); ``check_key`` is the
one validation every entry point (store, tiers, server protocol) uses.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvtier.errors import CorruptEntry, InvalidKey

KEY_BYTES = 32  # a chunk key is a sha256/blake3 digest (kvtier.keys.KEY_BYTES)
MAGIC = b"KVTE"
VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHBBI32sQQ")  # up to and including the checksum
_TAIL = struct.Struct("<II")  # hdr_crc, pad
FIXED_BYTES = _FIXED.size + _TAIL.size  # 68
MAX_HEADER_BYTES = FIXED_BYTES + 8 * MAX_NDIM

# name -> (code, itemsize). Codes are part of the format: never renumber.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "uint16": (3, 2),
    "int16": (4, 2),
    "uint32": (5, 4),
    "int32": (6, 4),
    "uint64": (7, 8),
    "int64": (8, 8),
    "float16": (9, 2),
    "bfloat16": (10, 2),
    "float32": (11, 4),
    "float64": (12, 8),
    "float8_e4m3fn": (13, 1),
    "float8_e5m2": (14, 1),
    "bool": (15, 1),
}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


@dataclass(frozen=True)
class EntryHeader:
    """What the header of one entry says."""

    key: bytes
    dtype: str
    shape: tuple[int, ...]
    length: int
    checksum: int

    @property
    def header_bytes(self) -> int:
        """Size of the encoded header."""
        return FIXED_BYTES + 8 * len(self.shape)


def is_valid_key(key) -> bool:
    """Whether ``key`` is a chunk key: a bytes-like object of exactly ``KEY_BYTES`` bytes."""
    if isinstance(key, (bytes, bytearray)):
        return len(key) == KEY_BYTES
    if isinstance(key, memoryview):
        return key.nbytes == KEY_BYTES
    return False


def check_key(key) -> bytes:
    """``key`` as bytes if it is a chunk key (``KEY_BYTES`` bytes); InvalidKey (a ValueError) with
    one line saying what is wrong otherwise. Bytes are returned as they are (no copy)."""
    if isinstance(key, bytes) and len(key) == KEY_BYTES:
        return key
    if is_valid_key(key):
        return bytes(key)
    if isinstance(key, (bytes, bytearray, memoryview)):
        n = key.nbytes if isinstance(key, memoryview) else len(key)
        raise InvalidKey(f"a chunk key is {KEY_BYTES} bytes (a digest), got {n} bytes")
    raise InvalidKey(f"a chunk key is {KEY_BYTES} bytes (a digest), got {type(key).__name__}")


def checksum(payload) -> int:
    """xxh3-64 of a bytes-like payload (about 10+ GB/s, so it never dominates I/O)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(key: bytes, payload, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bytes:
    """Header bytes for ``payload`` (any buffer). ``shape`` defaults to ``(len,)``."""
    view = memoryview(payload).cast("B")
    length = view.nbytes
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    code, itemsize = DTYPES[dtype]
    shape = tuple(int(d) for d in (shape if shape is not None else (length // itemsize,)))
    if len(shape) > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {len(shape)}")
    if _prod(shape) * itemsize != length:
        raise ValueError(f"shape {shape} x {dtype} does not match {length} payload bytes")
    check_key(key)
    fixed = _FIXED.pack(MAGIC, VERSION, code, len(shape), 0, key, length, checksum(view))
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    crc = zlib.crc32(fixed + dims)
    return fixed + _TAIL.pack(crc, 0) + dims


def encode(key: bytes, payload, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> bytes:
    """Header + payload as one bytes object (for wire protocols that want a single value)."""
    return encode_header(key, payload, dtype, shape) + bytes(memoryview(payload).cast("B"))


def decode_header(buf, max_length: int | None = None) -> EntryHeader:
    """Parse and check a header at the start of ``buf``; CorruptEntry if anything is off.

    ``max_length``: the largest payload the caller can accept (what its tier can hold); a header
    announcing more is corrupt, so no reader ever sizes a buffer from a forged length.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < FIXED_BYTES:
        raise CorruptEntry(f"short header ({view.nbytes} bytes)")
    magic, version, code, ndim, flags, key, length, csum = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != VERSION:
        raise CorruptEntry(f"unknown entry version {version}")
    if code not in _BY_CODE:
        raise CorruptEntry(f"unknown dtype code {code}")
    if ndim > MAX_NDIM or flags != 0:
        raise CorruptEntry("bad ndim or flags")
    end = FIXED_BYTES + 8 * ndim
    if view.nbytes < end:
        raise CorruptEntry("short header")
    hdr_crc, _pad = _TAIL.unpack_from(view, _FIXED.size)
    dims_bytes = bytes(view[FIXED_BYTES:end])
    if zlib.crc32(bytes(view[: _FIXED.size]) + dims_bytes) != hdr_crc:
        raise CorruptEntry("header checksum mismatch")
    shape = struct.unpack(f"<{ndim}Q", dims_bytes)
    dtype = _BY_CODE[code]
    if _prod(shape) * DTYPES[dtype][1] != length:
        raise CorruptEntry("shape does not match length")
    if max_length is not None and length > max_length:
        raise CorruptEntry(f"length {length} exceeds the {max_length} bytes an entry may have here")
    return EntryHeader(bytes(key), dtype, tuple(shape), length, csum)


def verify(header: EntryHeader, payload, expected_key: bytes | None = None) -> None:
    """Check the payload against its header (length, checksum, key); CorruptEntry if not."""
    view = memoryview(payload).cast("B")
    if expected_key is not None and header.key != expected_key:
        raise CorruptEntry("entry holds another key")
    if view.nbytes != header.length:
        raise CorruptEntry(f"payload is {view.nbytes} bytes, header says {header.length}")
    if checksum(view) != header.checksum:
        raise CorruptEntry("payload checksum mismatch")


def decode(buf, expected_key: bytes | None = None, max_length: int | None = None) -> tuple[EntryHeader, memoryview]:
    """Parse a whole entry (header + payload); returns the header and a view of the payload."""
    header = decode_header(buf, max_length)
    view = memoryview(buf).cast("B")
    payload = view[header.header_bytes :]
    verify(header, payload, expected_key)
    return header, payload


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

"""Forged entries for hardening tests: a header whose own CRC is valid but whose length lies.

Such a header passes every check a reader can make before it reads the payload, so it is what an
attacker with write access to a shared tier (a directory, a Redis, a bucket) would store.
"""

from __future__ import annotations

import struct
import zlib

from kvtier import entry


def forged_header(key: bytes, length: int) -> bytes:
    """A header for ``key`` announcing ``length`` uint8 payload bytes, CRC included (no payload)."""
    fixed = struct.pack("<4sHBBI32sQQQ", entry.MAGIC, entry.VERSION, entry.DTYPES["uint8"][0], 1, 0,
                        key, length, 0, length)
    dims = struct.pack("<Q", length)
    header = fixed + struct.pack("<II", zlib.crc32(fixed + dims), 0) + dims
    assert entry.decode_header(header).length == length  # it parses: only the length lies
    return header

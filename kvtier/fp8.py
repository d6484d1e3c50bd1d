"""FP8 (E4M3, ``float8_e4m3fn``) quantization of 16- and 32-bit float KV, with one float32 scale
per group of ``GROUP`` consecutive elements, in numpy (no torch: ``kvtier serve`` and the tiers
run without it).

E4M3 has 4 exponent bits (bias 7), 3 mantissa bits, no infinity and a largest finite value of
448; each group is scaled so that its largest magnitude maps to 448, then every element is
rounded to the nearest E4M3 value (ties to even). The groups run along the innermost
dimension of the KV (``GROUP`` = 128 elements: one head of a 128-wide head, two of a 64-wide
one), so a scale never spans more than a few heads of one token. Stored bytes: one per element
plus 4 per group, 0.516 x bf16/fp16, 0.258 x float32. The error bound per element is half an
E4M3 step at the element's magnitude (relative 2^-4 for normal values) plus, below the group's
smallest normal (amax x 2^-6 / 448), an absolute amax x 2^-9 / 448 / 2.

Payload (little-endian): ``version u8`` (1), ``dtype u8`` (the source dtype's entry code, see
``kvtier.entry.DTYPES``), ``group u16``, ``count u32`` (elements), then ``ceil(count/group)``
float32 scales, then ``count`` E4M3 codes. ``dequantize_into`` checks every length against the
output buffer before it reads a byte, and ValueError for anything that does not fit.

Imports: numpy only.
"""

from __future__ import annotations

import struct

import numpy as np

GROUP = 128
E4M3_MAX = 448.0
VERSION = 1
_HEAD = struct.Struct("<BBHI")
SOURCE_DTYPES = {"bfloat16": 10, "float16": 9, "float32": 11}  # name -> entry dtype code
_ITEMSIZE = {10: 2, 9: 2, 11: 4}
_MIN_NORMAL = 2.0 ** -6


def _table() -> np.ndarray:
    """The float32 value of each of the 256 E4M3 codes (0x7F and 0xFF: NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    value = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    value = (sign * value).astype(np.float32)
    value[[0x7F, 0xFF]] = np.nan
    return value


TABLE = _table()


def _code_lut() -> np.ndarray:
    """The E4M3 code of every bfloat16 bit pattern (the top 16 bits of a float32), where the
    pattern's lowest bit also stands for any lower float32 bit (a sticky bit: it only ever
    decides a tie, which it breaks upward as exact rounding does). Non-finite patterns: 0x7E/0xFE."""
    patterns = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    with np.errstate(invalid="ignore"):
        codes = _encode_e4m3(np.where(np.isfinite(patterns), patterns, np.copysign(E4M3_MAX, patterns)))
    return codes.astype(np.uint8)


def stored_bytes(count: int, group: int = GROUP) -> int:
    """Bytes of the payload for ``count`` elements."""
    return _HEAD.size + 4 * (-(-count // group)) + count


def _to_float32(raw: memoryview, dtype: str) -> np.ndarray:
    """The elements of ``raw`` (of ``dtype``) as float32 (a copy for 16-bit types)."""
    if dtype == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    return np.frombuffer(raw, np.float32)


def _write_from_float32(values: np.ndarray, code: int, out: memoryview) -> None:
    """Round float32 ``values`` to the source dtype (ties to even) into ``out``."""
    if code == 10:
        u = values.view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
        np.frombuffer(out, np.uint16)[:] = u
    elif code == 9:
        np.frombuffer(out, np.float16)[:] = values
    else:
        np.frombuffer(out, np.float32)[:] = values


def _encode_e4m3(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) of float32 ``y`` with ``|y| <= 448`` (larger magnitudes clamp to 448)."""
    a = np.minimum(np.abs(y), np.float32(E4M3_MAX))
    bits = a.view(np.uint32)
    rounded = bits + np.uint32(0x7FFFF) + ((bits >> 20) & np.uint32(1))  # to 3 mantissa bits, ties even
    normal = ((rounded >> 23).astype(np.int32) - 120) << 3 | ((rounded >> 20) & np.uint32(7)).astype(np.int32)
    sub = np.rint(a * np.float32(512.0)).astype(np.int32)  # multiples of 2^-9; 8 is the smallest normal
    code = np.where(a < np.float32(_MIN_NORMAL), sub, normal).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << 7)


def _round_to_e4m3(y: np.ndarray) -> np.ndarray:
    """``_encode_e4m3(y)``, through one 64 Ki-entry table lookup (several times faster)."""
    u = y.view(np.uint32)
    index = (u >> 16).astype(np.uint16)
    index |= (u & np.uint32(0xFFFF)) != 0
    return _LUT[index]


def quantize(raw: memoryview, dtype: str, group: int = GROUP) -> tuple[bytes, bytes] | None:
    """(payload, dequantized raw bytes) for ``raw`` of ``dtype``, or None when it cannot be
    coded: another dtype, a size that is not whole elements, or a non-finite element (kept
    exact: stored raw). The dequantized bytes are what ``dequantize_into`` will give a reader,
    so a writer can checksum them."""
    code = SOURCE_DTYPES.get(dtype)
    if code is None or raw.nbytes % _ITEMSIZE[code] or raw.nbytes == 0:
        return None
    x = _to_float32(raw, dtype)
    count = x.size
    groups = -(-count // group)
    if count % group:
        padded = np.zeros(groups * group, np.float32)
        padded[:count] = x
        x = padded
    blocks = x.reshape(groups, group)
    amax = np.abs(blocks).max(axis=1)
    if not np.isfinite(amax).all():
        return None
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    codes = _round_to_e4m3(blocks / scales[:, None]).reshape(-1)[:count]
    payload = b"".join((_HEAD.pack(VERSION, code, group, count), scales.tobytes(), codes.tobytes()))
    dequantized = bytearray(raw.nbytes)
    _dequantize(codes, scales, group, code, memoryview(dequantized))
    return payload, bytes(dequantized)


def _dequantize(codes: np.ndarray, scales: np.ndarray, group: int, code: int, out: memoryview) -> None:
    count = codes.size
    groups = scales.size
    values = np.zeros(groups * group, np.float32)
    values[:count] = TABLE[codes]
    values = (values.reshape(groups, group) * scales[:, None]).reshape(-1)[:count]
    _write_from_float32(np.ascontiguousarray(values), code, out)


def dequantize_into(payload: memoryview, out: memoryview, dtype: str | None = None) -> None:
    """Decode ``payload`` into exactly ``out`` (whose size is the entry's raw length). ValueError
    when the payload's version, source dtype (and ``dtype`` when given), group, element count,
    length or scales do not fit ``out``; nothing is allocated beyond ``out``'s size before that."""
    if payload.nbytes < _HEAD.size:
        raise ValueError("fp8 payload shorter than its header")
    version, code, group, count = _HEAD.unpack_from(payload)
    if version != VERSION:
        raise ValueError(f"fp8 payload version {version}")
    if code not in _ITEMSIZE or (dtype is not None and SOURCE_DTYPES.get(dtype) != code):
        raise ValueError(f"fp8 payload of source dtype code {code} for an entry of {dtype}")
    if not 1 <= group <= 1 << 15 or count * _ITEMSIZE[code] != out.nbytes:
        raise ValueError(f"fp8 payload of {count} elements for {out.nbytes} bytes")
    if payload.nbytes != stored_bytes(count, group):
        raise ValueError(f"fp8 payload of {payload.nbytes} bytes, its header says {stored_bytes(count, group)}")
    groups = -(-count // group)
    scales = np.frombuffer(payload, np.float32, groups, _HEAD.size)
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError("fp8 payload with a non-finite or non-positive scale")
    codes = np.frombuffer(payload, np.uint8, count, _HEAD.size + 4 * groups)
    _dequantize(codes, scales, group, code, out)


_LUT = _code_lut()

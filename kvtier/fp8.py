"""FP8 (E4M3, ``float8_e4m3fn``) quantization of 16- and 32-bit float KV, with one power-of-two
scale per group of ``GROUP`` consecutive elements (the OCP Microscaling MXFP8 layout: E4M3
elements, an E8M0 scale per 32), in numpy (no torch: ``kvtier serve`` and the tiers run without it).

E4M3 has 4 exponent bits (bias 7), 3 mantissa bits, no infinity and a largest finite value of
448. Each group's scale is the smallest power of two ``2^k`` with ``amax / 2^k <= 448``; every
element divided by it (exact) is rounded to the nearest E4M3 value (ties to even). A power of
two costs at most one binade at the bottom of a group's range and nothing in relative precision
(2^-4 for every element above ``2^k x 2^-6``), and it makes decoding to bfloat16 exact and
cheap: the element's bf16 bits from a 256-entry table plus ``k`` in the exponent field. The
groups run along the innermost dimension of the KV (a head's dimension), so a scale never spans
more than one head of one token. Stored bytes: one per element, one per group and 8 per entry:
0.516 x bf16/fp16, 0.258 x float32. Groups whose largest magnitude is below 2^-118 (far under
any KV) lose their smallest elements to zero.

Payload (little-endian): ``version u8`` (1), ``dtype u8`` (the source dtype's entry code, see
``kvtier.entry.DTYPES``), ``group u16``, ``count u32`` (elements), then ``ceil(count/group)``
scale bytes (``k + 127``, 0..254), then ``count`` E4M3 codes. ``dequantize_into`` checks every
length against the output buffer before it reads a byte, and ValueError for anything that does
not fit.

Imports: numpy and ``kvtier.entry`` (its dtype codes).
"""

from __future__ import annotations

import struct

import numpy as np

from kvtier.entry import DTYPES

GROUP = 32
E4M3_MAX = 448.0
VERSION = 1
_HEAD = struct.Struct("<BBHI")
SOURCE_DTYPES = {name: DTYPES[name][0] for name in ("bfloat16", "float16", "float32")}  # name -> entry code
_ITEMSIZE = {DTYPES[name][0]: DTYPES[name][1] for name in SOURCE_DTYPES}
_BF16, _FP16 = SOURCE_DTYPES["bfloat16"], SOURCE_DTYPES["float16"]
_MIN_NORMAL = 2.0 ** -6
_BIAS = 127  # a group's scale byte is k + 127 (E8M0), k in [-127, 127]
_FAST_K = (-117, 119)  # k for which every nonzero E4M3 value x 2^k is a normal bfloat16
# above these magnitudes a value's rounding up (at most 1/16) may pass the dtype's largest finite value
_BF16_MAX = 3.3895e38  # (2 - 2^-7) x 2^127: numpy has no bfloat16
_LARGEST = {_FP16: float(np.finfo(np.float16).max), _BF16: _BF16_MAX,
            SOURCE_DTYPES["float32"]: float(np.finfo(np.float32).max)}
_SAFE_MAX = {code: largest / 1.0625 for code, largest in _LARGEST.items()}


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
    return _HEAD.size + (-(-count // group)) + count


def _to_float32(raw: memoryview, dtype: str) -> np.ndarray:
    """The elements of ``raw`` (of ``dtype``) as float32 (a copy for 16-bit types)."""
    if dtype == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    return np.frombuffer(raw, np.float32)


def _write_from_float32(values: np.ndarray, code: int, out: memoryview) -> None:
    """Round float32 ``values`` to the source dtype (ties to even) into ``out``."""
    if code == _BF16:
        u = values.view(np.uint32)
        u = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
        np.frombuffer(out, np.uint16)[:] = u
    elif code == _FP16:
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
    return np.take(_LUT, index)


def _row_max(a: np.ndarray) -> np.ndarray:
    """The largest value of each row of ``a`` (NaN when a row holds one), by halving the rows
    (faster than ``max(axis=1)`` over short rows); odd widths fall back to it."""
    while a.shape[1] > 1 and a.shape[1] % 2 == 0:
        half = a.shape[1] // 2
        a = np.maximum(a[:, :half], a[:, half:])  # propagates NaN, as the finite check needs
    return a.max(axis=1)


def quantize(raw: memoryview, dtype: str, group: int = GROUP) -> tuple[bytes, bytes] | None:
    """(payload, dequantized raw bytes) for ``raw`` of ``dtype``, or None when it cannot be
    coded: another dtype, a size that is not whole elements, a non-finite element, or one so
    near the dtype's largest value that its rounding would overflow it (kept exact: stored
    raw). The dequantized bytes are what ``dequantize_into`` will give a reader, so a writer
    can checksum them."""
    code = SOURCE_DTYPES.get(dtype)
    if code is None or raw.nbytes % _ITEMSIZE[code] or raw.nbytes == 0:
        return None
    if code == _BF16 and raw.nbytes % (2 * group) == 0:
        fast = _quantize_bf16(raw, group)
        if fast is not NotImplemented:
            return fast
    x = _to_float32(raw, dtype)
    count = x.size
    groups = -(-count // group)
    if count % group:
        padded = np.zeros(groups * group, np.float32)
        padded[:count] = x
        x = padded
    blocks = x.reshape(groups, group)
    amax = _row_max(np.abs(blocks))
    if not np.isfinite(amax).all():
        return None
    k = np.clip(np.frexp(amax / np.float32(E4M3_MAX))[1], -_BIAS, _BIAS).astype(np.int32)  # amax / 2^k <= 448
    inverse = np.ldexp(np.float32(1.0), -k).astype(np.float32)  # a power of two: the product is exact
    codes = _round_to_e4m3(blocks * inverse[:, None])  # (groups, group): padding codes 0
    return _sealed(codes, k, count, code, group, float(amax.max()), raw.nbytes)


def _sealed(codes: np.ndarray, k: np.ndarray, count: int, code: int, group: int, amax: float,
            nbytes: int) -> "tuple[bytes, bytes] | None":
    """``quantize``'s answer from the groups' ``codes`` and exponents ``k``: (payload,
    dequantized bytes), or None when rounding up carried an element past the source dtype's
    largest value (``amax`` near it; kept exact: stored raw)."""
    payload = b"".join((_HEAD.pack(VERSION, code, group, count), (k + _BIAS).astype(np.uint8).tobytes(),
                        codes.reshape(-1)[:count].tobytes()))
    dequantized = bytearray(nbytes)
    _dequantize(codes, k, count, code, memoryview(dequantized))
    if amax > _SAFE_MAX[code] and not _all_finite(memoryview(dequantized), code):
        return None
    return payload, bytes(dequantized)


def _quantize_bf16(raw: memoryview, group: int) -> "tuple[bytes, bytes] | None":
    """``quantize`` of bfloat16 KV in whole groups, on its 16-bit patterns (about twice as fast:
    no float32 copy). A bf16 magnitude's pattern orders like its value, so a group's largest
    pattern is its amax; dividing by the group's ``2^k`` subtracts ``k`` from every exponent
    field, which is exact while the result stays a normal bf16 value, and below that (under
    2^-126, far under E4M3's smallest 2^-9) the code is zero: the same codes as the float32
    path, bit for bit. NotImplemented (the float32 path decides) when an element is a bf16
    subnormal (scaled up, it would need renormalizing); None for a non-finite element."""
    bits = np.frombuffer(raw, np.uint16)
    mag = bits & np.uint16(0x7FFF)
    if mag.max() >= 0x7F80:  # inf or NaN: stored raw
        return None
    if ((mag - np.uint16(1)) < np.uint16(0x7F)).any():  # 1..0x7F: subnormal (0 wraps to 0xFFFF)
        return NotImplemented
    count = bits.size
    blocks = mag.reshape(-1, group)
    amax = (_row_max(blocks).astype(np.uint32) << 16).view(np.float32)
    k = np.clip(np.frexp(amax / np.float32(E4M3_MAX))[1], -_BIAS, _BIAS).astype(np.int32)  # amax / 2^k <= 448
    shift = (k << 7).astype(np.uint16)  # k < 0 wraps: adding -k to the exponent field, exact
    scaled = blocks - shift[:, None]
    if k.max() > 0:  # a group of large values: its tiny elements' fields would go below 1
        scaled[blocks < ((np.maximum(k, 0) + 1) << 7).astype(np.uint16)[:, None]] = 0
    scaled |= (bits & np.uint16(0x8000)).reshape(-1, group)
    return _sealed(np.take(_LUT, scaled), k, count, _BF16, group, float(amax.max()), raw.nbytes)


def _all_finite(out: memoryview, code: int) -> bool:
    """Whether every element of ``out`` (of the source dtype ``code``) is finite."""
    if code == _BF16:
        return bool(((np.frombuffer(out, np.uint16) & 0x7F80) != 0x7F80).all())
    return bool(np.isfinite(np.frombuffer(out, np.float16 if code == _FP16 else np.float32)).all())


def _dequantize(blocks: np.ndarray, k: np.ndarray, count: int, code: int, out: memoryview) -> None:
    """Write the first ``count`` codes of ``blocks`` (one row per group) x their group's ``2^k``
    into ``out`` as the source dtype."""
    if code == _BF16 and _FAST_K[0] <= k.min() and k.max() <= _FAST_K[1]:  # exact: the exponent moves by k
        bits = np.take(_BF16_BITS, blocks)
        shifted = bits + (k << 7).astype(np.uint16)[:, None]  # wraps modulo 2^16 for k < 0: still exact
        np.frombuffer(out, np.uint16)[:] = np.where((blocks & 0x7F) != 0, shifted, bits).reshape(-1)[:count]
        return
    values = (np.take(TABLE, blocks) * np.ldexp(np.float32(1.0), k).astype(np.float32)[:, None]).reshape(-1)[:count]
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
    scales = np.frombuffer(payload, np.uint8, groups, _HEAD.size)
    if groups and scales.max() > 2 * _BIAS:
        raise ValueError("fp8 payload with a scale byte over 254")
    codes = np.frombuffer(payload, np.uint8, count, _HEAD.size + groups)
    if count % group:  # the last group is short: pad it with zero codes
        codes = np.concatenate([codes, np.zeros(groups * group - count, np.uint8)])
    _dequantize(codes.reshape(groups, group), scales.astype(np.int32) - _BIAS, count, code, out)


_LUT = _code_lut()
_BF16_BITS = (TABLE.view(np.uint32) >> 16).astype(np.uint16)  # exact: E4M3 values are bfloat16 values

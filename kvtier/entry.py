"""The entry format: a small fixed binary header followed by the stored payload bytes.

Version 2 (written; little-endian)::

    magic      4s   b"KVTE"
    version    u16  2
    dtype      u8   code from DTYPES
    ndim       u8   0..8
    flags      u32  bit 0: authenticated (a tag follows the shape); bits 8..15: codec id
                    (0 none, 1 lossless, 2 fp8: ``kvtier.codecs``); bits 16..23: the tag's algorithm
                    (1 keyed BLAKE3, 2 HMAC-SHA256; 0 without a tag); every other bit 0
    key        32s  the chunk key
    length     u64  raw payload bytes (what a reader gets: shape x itemsize)
    checksum   u64  xxh3-64 of the raw payload (for a lossy codec: of the decoded bytes)
    stored     u64  payload bytes as stored after the header (== length without a codec)
    hdr_crc    u32  crc32 of everything above and the shape
    pad        u32  0
    shape      ndim x u64
    tag        32s  only when authenticated: a MAC (``EntryAuth``: keyed BLAKE3, or HMAC-SHA256
                    where the blake3 package is missing) over every header byte before it and
                    the stored payload

Version 1 (read only) is the same without ``stored``, ``flags`` always 0 and no tag. A v1 entry
is read as it always was when no auth key is configured, and is a miss (CorruptEntry) when one
is: nobody can tell who wrote it.

Parsing never trusts the header: the magic, version, dtype, flags and ndim are checked, the
header's own crc32 must match, shape x itemsize must equal the length, a codec entry's stored
length must be smaller than its raw length, and both lengths are bounded by ``max_length``
before anything is allocated or decoded. With an auth key (``EntryAuth``) the tag is checked
before a stored byte is decoded or reported: an entry without a valid tag, or with a tag when
no key is configured, is corrupt. The raw payload's checksum is checked after decoding. Every
failure raises CorruptEntry, which readers turn into a counted miss. No pickle.

Keys are fixed-length digests (``KEY_BYTES``, as ``kvtier.keys`` makes them); ``check_key`` is the
one validation every entry point (store, tiers, server protocol) uses.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass, field

import xxhash

from kvtier.errors import CorruptEntry, InvalidKey

KEY_BYTES = 32  # a chunk key is a sha256/blake3 digest (kvtier.keys.KEY_BYTES)
MAGIC = b"KVTE"
VERSION = 2
MAX_NDIM = 8
TAG_BYTES = 32
FLAG_AUTH = 0x1
_CODEC_SHIFT = 8
_ALGO_SHIFT = 16
TAG_BLAKE3, TAG_HMAC_SHA256 = 1, 2  # tag algorithm ids: part of the format, never renumber
_KNOWN_FLAGS = FLAG_AUTH | (0xFF << _CODEC_SHIFT) | (0xFF << _ALGO_SHIFT)
_FIXED_V1 = struct.Struct("<4sHBBI32sQQ")  # up to and including the checksum
_FIXED = struct.Struct("<4sHBBI32sQQQ")  # v2: ... checksum, stored
_TAIL = struct.Struct("<II")  # hdr_crc, pad
FIXED_BYTES_V1 = _FIXED_V1.size + _TAIL.size  # 68
FIXED_BYTES = _FIXED.size + _TAIL.size  # 76
MAX_HEADER_BYTES = FIXED_BYTES + 8 * MAX_NDIM + TAG_BYTES

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


class EntryAuth:
    """The entry-authentication key of one trust domain (derived from its ``auth_key``).

    ``tag(parts)`` is a 32-byte MAC over the concatenation of ``parts`` with ``algo``: keyed
    BLAKE3 (``TAG_BLAKE3``, ~2 GB/s on one core here) when the ``blake3`` package is installed,
    else HMAC-SHA256 (``TAG_HMAC_SHA256``, ~0.5 GB/s); keyed BLAKE2b was measured at ~0.2 GB/s
    (``kvtier bench auth``). Readers check an entry with the algorithm its header names (each
    with its own key derived from the secret); a BLAKE3 entry where blake3 is missing is a miss.
    ``check`` compares in constant time. The key never appears in ``repr``/``str`` or a message.
    """

    __slots__ = ("_keys", "algo")

    def __init__(self, secret: bytes):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("an auth key must be at least 16 bytes")
        # domain-separated from each other and from the chunk keys (kvtier.keys.keyed_namespace)
        self._keys = {algo: hmac.new(bytes(secret), b"kvtier-entry-tag-v2\x00%d" % algo, hashlib.sha256).digest()
                      for algo in (TAG_BLAKE3, TAG_HMAC_SHA256)}
        self.algo = TAG_BLAKE3 if _blake3() is not None else TAG_HMAC_SHA256

    def tag(self, *parts, algo: int | None = None) -> bytes:
        """The 32-byte tag of ``parts`` (bytes-like), in order, with ``algo`` (default: this
        process's choice). ValueError for an algorithm not available here."""
        algo = self.algo if algo is None else algo
        key = self._keys.get(algo)
        if key is None:
            raise ValueError(f"unknown tag algorithm {algo}")
        if algo == TAG_BLAKE3:
            lib = _blake3()
            if lib is None:
                raise ValueError("keyed BLAKE3 tag, but the blake3 package is not installed here")
            h = lib.blake3(key=key)
        else:
            h = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()

    def check(self, tag: bytes, *parts, algo: int | None = None) -> bool:
        """Whether ``tag`` is the tag of ``parts`` (constant-time; False for an algorithm that
        is unknown or unavailable here)."""
        try:
            return hmac.compare_digest(tag, self.tag(*parts, algo=algo))
        except ValueError:
            return False

    def __repr__(self) -> str:
        return "EntryAuth(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never serialized (pickle, copy across processes)
        raise TypeError("EntryAuth is not serializable")


_BLAKE3 = None


def _blake3():
    """The blake3 module, or None when it is not installed (imported once)."""
    global _BLAKE3
    if _BLAKE3 is None:
        try:
            import blake3
        except ImportError:
            _BLAKE3 = False
        else:
            _BLAKE3 = blake3
    return _BLAKE3 or None


@dataclass(frozen=True)
class EntryHeader:
    """What the header of one entry says. ``length`` is the raw payload a reader gets;
    ``stored`` the bytes after the header; ``codec`` the codec id (0: stored raw); ``tag`` the
    authentication tag (None: unauthenticated); ``signed`` the header bytes the tag covers."""

    key: bytes
    dtype: str
    shape: tuple[int, ...]
    length: int
    checksum: int
    stored: int = -1
    codec: int = 0
    tag: bytes | None = None
    version: int = VERSION
    tag_algo: int = 0
    signed: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        if self.stored < 0:
            object.__setattr__(self, "stored", self.length)

    @property
    def header_bytes(self) -> int:
        """Size of the encoded header (the tag included)."""
        fixed = FIXED_BYTES if self.version >= 2 else FIXED_BYTES_V1
        return fixed + 8 * len(self.shape) + (TAG_BYTES if self.tag is not None else 0)

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPES[self.dtype][1]


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


def encode_header(key: bytes, payload, dtype: str = "uint8", shape: tuple[int, ...] | None = None,
                  auth: EntryAuth | None = None, body=None, codec: int = 0) -> bytes:
    """Header bytes for the raw ``payload`` (any buffer). ``shape`` defaults to ``(len,)``.

    ``body``: the bytes stored after the header when they differ from ``payload`` (a coded
    payload, codec id ``codec``). With ``auth`` the header ends in the tag over itself and the
    stored bytes. ValueError for a bad dtype, shape or codec; InvalidKey for a bad key.
    """
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
    stored_view = view if body is None else memoryview(body).cast("B")
    if not 0 <= codec <= 0xFF or (codec == 0) != (body is None):
        raise ValueError("a coded body needs a codec id in 1..255, a raw one codec 0")
    flags = (codec << _CODEC_SHIFT) | ((FLAG_AUTH | auth.algo << _ALGO_SHIFT) if auth is not None else 0)
    fixed = _FIXED.pack(MAGIC, VERSION, code, len(shape), flags, key, length, checksum(view), stored_view.nbytes)
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    crc = zlib.crc32(fixed + dims)
    head = fixed + _TAIL.pack(crc, 0) + dims
    return head + auth.tag(head, stored_view) if auth is not None else head


def encode(key: bytes, payload, dtype: str = "uint8", shape: tuple[int, ...] | None = None,
           auth: EntryAuth | None = None) -> bytes:
    """Header + raw payload as one bytes object (for wire protocols that want a single value)."""
    return encode_header(key, payload, dtype, shape, auth) + bytes(memoryview(payload).cast("B"))


def decode_header(buf, max_length: int | None = None, auth: EntryAuth | None = None,
                  check_auth: bool = True) -> EntryHeader:
    """Parse and check a header at the start of ``buf``; CorruptEntry if anything is off.

    ``max_length``: the largest payload the caller can accept (what its tier can hold, a chunk's
    size); a header announcing more, raw or stored, is corrupt, so no reader ever sizes a buffer
    from a forged length. ``auth``: the reader's key (None: none configured); an entry whose
    authentication does not match the reader's configuration (tagged without a key, untagged
    or v1 with one) is corrupt here, unless ``check_auth`` is False (an index rebuilt from
    headers before the key is known; every read still checks). The tag itself is checked by
    ``verify``/``open_into``.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < FIXED_BYTES_V1:
        raise CorruptEntry(f"short header ({view.nbytes} bytes)")
    version = struct.unpack_from("<H", view, 4)[0]
    if version == 1:
        magic, version, code, ndim, flags, key, length, csum = _FIXED_V1.unpack_from(view, 0)
        stored, fixed_struct, fixed_bytes = length, _FIXED_V1, FIXED_BYTES_V1
    elif version == VERSION:
        if view.nbytes < FIXED_BYTES:
            raise CorruptEntry(f"short header ({view.nbytes} bytes)")
        magic, version, code, ndim, flags, key, length, csum, stored = _FIXED.unpack_from(view, 0)
        fixed_struct, fixed_bytes = _FIXED, FIXED_BYTES
    else:
        if bytes(view[:4]) != MAGIC:
            raise CorruptEntry("bad magic")
        raise CorruptEntry(f"unknown entry version {version}")
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if code not in _BY_CODE:
        raise CorruptEntry(f"unknown dtype code {code}")
    if ndim > MAX_NDIM or flags & ~_KNOWN_FLAGS or (version == 1 and flags):
        raise CorruptEntry("bad ndim or flags")
    dims_end = fixed_bytes + 8 * ndim
    tagged = bool(flags & FLAG_AUTH)
    tag_algo = (flags >> _ALGO_SHIFT) & 0xFF
    if tag_algo not in ((TAG_BLAKE3, TAG_HMAC_SHA256) if tagged else (0,)):
        raise CorruptEntry("bad tag algorithm")
    end = dims_end + (TAG_BYTES if tagged else 0)
    if view.nbytes < end:
        raise CorruptEntry("short header")
    hdr_crc, _pad = _TAIL.unpack_from(view, fixed_struct.size)
    dims_bytes = bytes(view[fixed_bytes:dims_end])
    if zlib.crc32(bytes(view[: fixed_struct.size]) + dims_bytes) != hdr_crc:
        raise CorruptEntry("header checksum mismatch")
    if check_auth and tagged and auth is None:
        raise CorruptEntry("authenticated entry, but no auth key is configured here")
    if check_auth and not tagged and auth is not None:
        raise CorruptEntry("unauthenticated entry, but an auth key is configured here")
    shape = struct.unpack(f"<{ndim}Q", dims_bytes)
    dtype = _BY_CODE[code]
    if _prod(shape) * DTYPES[dtype][1] != length:
        raise CorruptEntry("shape does not match length")
    codec = (flags >> _CODEC_SHIFT) & 0xFF
    if (codec == 0 and stored != length) or (codec != 0 and not 0 < stored < length):
        raise CorruptEntry("stored length does not fit the codec")
    if max_length is not None and length > max_length:
        raise CorruptEntry(f"length {length} exceeds the {max_length} bytes an entry may have here")
    tag = bytes(view[dims_end:end]) if tagged else None
    signed = bytes(view[:dims_end]) if tagged else b""
    return EntryHeader(bytes(key), dtype, tuple(shape), length, csum, stored=stored, codec=codec, tag=tag,
                       version=version, signed=signed, tag_algo=tag_algo)


def verify(header: EntryHeader, payload, expected_key: bytes | None = None, auth: EntryAuth | None = None) -> None:
    """Check a raw-stored payload against its header (key, length, tag with ``auth``,
    checksum); CorruptEntry if not, and for a coded entry (use ``open_into``)."""
    view = memoryview(payload).cast("B")
    check_stored(header, view, expected_key, auth)
    if header.codec != 0:
        raise CorruptEntry("coded entry where a raw one was expected")
    if checksum(view) != header.checksum:
        raise CorruptEntry("payload checksum mismatch")


def check_stored(header: EntryHeader, stored, expected_key: bytes | None = None,
                 auth: EntryAuth | None = None) -> None:
    """Check the stored bytes before anything reads them: the key, the stored length, and the
    tag (keyed: with ``auth``; a header without a tag when ``auth`` is set is refused, and so
    is a tag when it is not). CorruptEntry if any is off."""
    view = memoryview(stored).cast("B")
    if expected_key is not None and header.key != expected_key:
        raise CorruptEntry("entry holds another key")
    if view.nbytes != header.stored:
        raise CorruptEntry(f"payload is {view.nbytes} bytes, header says {header.stored}")
    if (header.tag is None) != (auth is None):
        raise CorruptEntry("entry authentication does not match this reader's auth key")
    if auth is not None and not auth.check(header.tag, header.signed, view, algo=header.tag_algo):
        raise CorruptEntry("entry tag mismatch (written without this auth key, or altered)")


def open_into(header: EntryHeader, stored, out, expected_key: bytes | None = None,
              auth: EntryAuth | None = None, lossy_ok: bool = True) -> int:
    """Check the stored bytes (``check_stored``: the tag first), decode them into ``out`` (a
    writable buffer of at least ``header.length`` bytes; never more is written), then check the
    raw checksum. Returns ``header.length``. CorruptEntry for any failure, an unknown or
    unavailable codec included, and a lossy (fp8) entry when not ``lossy_ok`` (a reader that
    serves exact KV: ``out`` may then hold garbage: never report it)."""
    dest = memoryview(out).cast("B")
    if dest.nbytes < header.length:
        raise ValueError(f"output buffer of {dest.nbytes} bytes, entry holds {header.length}")
    view = memoryview(stored).cast("B")
    check_stored(header, view, expected_key, auth)
    target = dest[: header.length]
    if header.codec == 0:
        target[:] = view
    else:
        from kvtier.codecs import LOSSY_IDS, decode_into  # the codec libraries load only when needed

        if header.codec in LOSSY_IDS and not lossy_ok:
            raise CorruptEntry("a lossy (fp8) entry where exact KV is expected")
        decode_into(header.codec, view, target, header.itemsize, header.dtype)
    if checksum(target) != header.checksum:
        raise CorruptEntry("payload checksum mismatch")
    return header.length


def decode(buf, expected_key: bytes | None = None, max_length: int | None = None,
           auth: EntryAuth | None = None, lossy_ok: bool = True) -> tuple[EntryHeader, memoryview]:
    """Parse a whole entry (header + stored payload); returns the header and a view of the raw
    payload (a view into ``buf`` when stored raw, a new buffer when coded). ``lossy_ok``: as
    for ``open_into``."""
    header = decode_header(buf, max_length, auth)
    view = memoryview(buf).cast("B")
    stored = view[header.header_bytes :]
    if header.codec == 0:
        verify(header, stored, expected_key, auth)
        return header, stored
    out = bytearray(header.length)  # bounded: decode_header checked length <= max_length
    open_into(header, stored, out, expected_key, auth, lossy_ok)
    return header, memoryview(out)


def seal(key: bytes, payload, dtype: str = "uint8", shape: tuple[int, ...] | None = None,
         auth: EntryAuth | None = None, codec=None) -> tuple[bytes, memoryview]:
    """(header, stored bytes) of an entry for the raw ``payload``: coded with ``codec`` (a
    ``kvtier.codecs.Codec``; None: raw) when that makes it smaller, else raw; tagged with
    ``auth``. ValueError for a bad dtype/shape; InvalidKey for a bad key."""
    view = memoryview(payload).cast("B")
    if codec is not None and getattr(codec, "lossy", False):  # the checksum covers what readers get
        coded = codec.encode_lossy(view, dtype)
        if coded is not None:
            body, dequantized = coded
            return (encode_header(key, dequantized, dtype, shape, auth, body, codec.id),
                    memoryview(body).cast("B"))
    elif codec is not None and dtype in DTYPES:
        body = codec.encode(view, DTYPES[dtype][1])
        if body is not None and len(body) < view.nbytes:
            return encode_header(key, view, dtype, shape, auth, body, codec.id), memoryview(body).cast("B")
    return encode_header(key, view, dtype, shape, auth), view


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


MIN_SECRET_BYTES = 16


def load_auth_secret(file: str | None, env: str | None, where: str) -> bytes | None:
    """The trust domain's secret from ``file`` (its content, surrounding whitespace stripped) or
    the environment variable ``env``; None when neither is given. ConfigError (one line naming
    ``where`` and the problem, never the secret) when both are given, the file cannot be read,
    is not a regular file, is readable by other users (mode o+r/o+w), or the variable is unset,
    or the secret is shorter than ``MIN_SECRET_BYTES`` bytes."""
    import os
    import stat as stat_mod

    from kvtier.errors import ConfigError

    if file is not None and env is not None:
        raise ConfigError(f"{where}: give auth_key_file or auth_key_env, not both")
    if file is not None:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ConfigError(f"{where}.auth_key_file: cannot open it ({exc.strerror})") from exc
        try:
            st = os.fstat(fd)
            if not stat_mod.S_ISREG(st.st_mode):
                raise ConfigError(f"{where}.auth_key_file: not a regular file")
            if st.st_mode & (stat_mod.S_IROTH | stat_mod.S_IWOTH):
                raise ConfigError(f"{where}.auth_key_file: other users can read or write it "
                                  f"(mode {stat_mod.S_IMODE(st.st_mode):04o}); chmod 600 or 640")
            raw = os.read(fd, 4097)
        finally:
            os.close(fd)
        if len(raw) > 4096:
            raise ConfigError(f"{where}.auth_key_file: more than 4096 bytes; an auth key is one line")
        secret, what = raw.strip(), "auth_key_file"
    elif env is not None:
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"{where}.auth_key_env: the environment variable {env!r} is not set or empty")
        secret, what = value.strip().encode(), "auth_key_env"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}.{what}: the auth key is shorter than {MIN_SECRET_BYTES} bytes "
                          f"(e.g. make one with: head -c 32 /dev/urandom | base64)")
    return secret

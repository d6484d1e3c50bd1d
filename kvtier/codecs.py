"""KV codecs for the entries of slower tiers (``codec: none | lossless | fp8 | auto`` per tier).

``lossless``: Blosc2's bit-shuffle filter at the element width of the KV dtype (2 bytes for
bf16/fp16: the sign/exponent bits of every element line up, and they repeat), then LZ4, on one
thread. Chosen by measurement on the KV of the random Qwen2 test model (``kvtier bench codec``,
4 MiB of bf16 K/V, one core): 1.40 x at ~1.1 GB/s encode and ~2.4 GB/s decode; zstd-1 on the
raw bytes 1.28 x at 0.64/0.68 GB/s; byte planes + zstd-1 1.47 x but 0.24/0.51 GB/s; Blosc2
byte-shuffle + LZ4 1.16 x. Decoding must keep up with a tier's load path, so the fast decoder
with nearly the best ratio wins. The library is optional (``pip install 'kvtier[codec]'``): configuring
``lossless`` without it is a ConfigError, and reading a coded entry without it is a miss.

Safety: ``decode_into`` writes into the caller's buffer, whose size is the entry's declared raw
length (already bounded by the reader's ``max_length`` and equal to shape x itemsize); Blosc2's
own declared size must equal it before a byte is decoded, so a forged entry can neither
allocate nor write more. Any failure is CorruptEntry (a counted miss upstream).

``fp8`` (``FP8``, lossy, opt-in): bf16/fp16/float32 KV quantized to E4M3 with one power-of-two
scale per 32 elements (``kvtier.fp8``, the MXFP8 layout): 0.516 x the bytes of 16-bit KV. An
fp8 entry is a different KV, so a store with an fp8 tier says so in its key namespace
(``StoreConfig.lossy_codec``; the connector folds it in), and an engine configured without it
never reads a lossy entry. The entry's checksum covers the dequantized bytes (what a reader
gets). Other dtypes, non-finite values and payloads under 4 KiB are stored raw. ``auto`` never
picks ``fp8``.

``auto`` (``AutoChoice``): per tier, a chunk is coded only when ``S/E + S/(r B) + S/D < S/B``
(encode, move the coded bytes, decode, against moving the raw bytes): the document's break-even
rule applied to bytes, with ``B`` the moving average of the tier's own reads (stored bytes per
second, decode time excluded; before the first read, of its puts, encode time excluded), ``E``/``D``/``r`` measured on this machine at start (one 1 MiB
bf16-like sample) and refreshed from real chunks (every coded put, and a probe every
``PROBE_EVERY`` raw puts). Until the tier has been measured, chunks are stored raw.

Imports: ``kvtier.errors`` and, lazily, ``blosc2`` and ``kvtier.fp8`` (numpy).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal, get_args

from kvtier.errors import ConfigError, CorruptEntry

CodecName = Literal["none", "lossless", "fp8", "auto"]
CODEC_NAMES = get_args(CodecName)
LOSSY_CODECS = ("fp8",)  # codecs whose entries are a different KV (part of the key namespace)
LOSSLESS_ID = 1  # codec ids are part of the entry format: never renumber
FP8_ID = 2
_MIN_BYTES = 4096  # smaller payloads are stored raw: the frame costs more than it saves
_lock = threading.Lock()
_blosc2 = None


def _lib():
    """The blosc2 module, imported once; ConfigError (one line) when it is not installed."""
    global _blosc2
    if _blosc2 is None:
        with _lock:
            if _blosc2 is None:
                try:
                    import blosc2
                except ImportError as exc:
                    raise ConfigError("codec 'lossless' needs the blosc2 package (pip install 'kvtier[codec]'); "
                                      "valid codecs without it: none") from exc
                _blosc2 = blosc2
    return _blosc2


@dataclass(frozen=True)
class Codec:
    """A lossless codec: ``encode`` returns the coded bytes (None when not worth it)."""

    name: str
    id: int
    lossy = False

    def encode(self, raw: memoryview, itemsize: int) -> bytes | None:
        """Coded bytes of ``raw`` with elements of ``itemsize`` bytes, or None (store raw) when
        ``raw`` is too small to pay or the result is not smaller."""
        if raw.nbytes < _MIN_BYTES:
            return None
        lib = _lib()
        coded = lib.compress2(raw, typesize=max(1, min(itemsize, 255)), codec=lib.Codec.LZ4,
                              filters=[lib.Filter.BITSHUFFLE], clevel=5, nthreads=1)
        return coded if len(coded) < raw.nbytes else None


LOSSLESS = Codec("lossless", LOSSLESS_ID)


@dataclass(frozen=True)
class LossyCodec:
    """A lossy codec: ``encode_lossy`` returns the coded bytes and the raw bytes a reader will
    decode them to (the entry's checksum covers those), or None (store raw, exact)."""

    name: str
    id: int
    lossy = True

    def encode_lossy(self, raw: memoryview, dtype: str) -> tuple[bytes, bytes] | None:
        """(coded, dequantized) for ``raw`` of element type ``dtype``; None when ``raw`` is under
        4 KiB, of a dtype the codec does not take, holds a non-finite value, or does not shrink."""
        if raw.nbytes < _MIN_BYTES:
            return None
        from kvtier import fp8

        coded = fp8.quantize(raw, dtype)
        if coded is None or len(coded[0]) >= raw.nbytes:
            return None
        return coded


FP8 = LossyCodec("fp8", FP8_ID)


def get_codec(name: str, where: str = "codec") -> Codec | None:
    """The codec a tier's ``codec`` setting names (None for ``none``); ConfigError (one line,
    the valid choices) for another name or a missing library."""
    if name == "none":
        return None
    if name == "fp8":
        return FP8
    if name in ("lossless", "auto"):  # auto codes with lossless when it pays (AutoChoice)
        try:
            _lib()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return LOSSLESS
    raise ConfigError(f"{where}: unknown codec {name!r}; valid: {', '.join(CODEC_NAMES)}")


def decode_into(codec_id: int, stored: memoryview, out: memoryview, itemsize: int,
                dtype: str | None = None) -> None:
    """Decode ``stored`` (codec ``codec_id``) into exactly ``out`` (raw elements of ``dtype``,
    ``itemsize`` bytes each); CorruptEntry for an unknown codec, a missing library, a declared
    size other than ``out.nbytes`` or a bad stream."""
    if codec_id == FP8_ID:
        _decode_fp8(stored, out, dtype)
        return
    if codec_id != LOSSLESS_ID:
        raise CorruptEntry(f"entry of unknown codec id {codec_id}")
    try:
        lib = _lib()
    except ConfigError:
        raise CorruptEntry("lossless entry, but blosc2 is not installed here") from None
    try:
        declared, cbytes, _ = lib.get_cbuffer_sizes(stored)
    except Exception as exc:  # a header blosc2 cannot parse
        raise CorruptEntry(f"codec frame does not parse ({type(exc).__name__})") from None
    if declared != out.nbytes or cbytes != stored.nbytes:
        raise CorruptEntry(f"codec frame declares {declared} bytes, the entry {out.nbytes}")
    start = time.perf_counter()
    try:
        lib.decompress2(stored, dst=out, nthreads=1)
    except Exception as exc:  # blosc2 raises ValueError/RuntimeError for bad streams
        raise CorruptEntry(f"codec stream does not decode ({type(exc).__name__})") from None
    finally:
        CLOCK.decode_s = getattr(CLOCK, "decode_s", 0.0) + time.perf_counter() - start


def _decode_fp8(stored: memoryview, out: memoryview, dtype: str | None) -> None:
    """``kvtier.fp8.dequantize_into``, its ValueError a CorruptEntry (timed like lossless)."""
    from kvtier import fp8

    start = time.perf_counter()
    try:
        fp8.dequantize_into(stored, out, dtype)
    except ValueError as exc:
        raise CorruptEntry(f"fp8 entry does not decode: {exc}") from None
    finally:
        CLOCK.decode_s = getattr(CLOCK, "decode_s", 0.0) + time.perf_counter() - start


CLOCK = threading.local()  # decode_s: seconds this thread spent decoding (an auto tier's read timing)


PROBE_EVERY = 16  # raw puts between two probe encodes of an auto tier (refreshes E, D, r)
_EWMA = 0.2  # weight of the newest observation in the moving averages


class AutoChoice:
    """The break-even rule of one ``auto`` tier (thread-safe). ``observe_put`` feeds the tier's
    bandwidth; ``encode`` decides per chunk and returns the coded bytes or None (store raw);
    ``state()`` is the choice and its inputs (for the tier's metrics)."""

    def __init__(self, codec: Codec, itemsize: int = 2):
        self.codec = codec
        self._lock = threading.Lock()
        self.tier_bps: float | None = None  # what the rule uses: the read bandwidth once known
        self.write_bps: float | None = None
        self.read_bps: float | None = None
        self.encode_bps, self.decode_bps, self.ratio = _measure(codec, itemsize)
        self.coding = False
        self.coded = 0
        self.raw = 0
        self._since_probe = 0

    def pays(self) -> bool:
        """Whether coding pays at the current inputs (False until the tier is measured)."""
        with self._lock:
            b = self.tier_bps
            if not b or self.ratio <= 1.0:
                return False
            return 1.0 / self.encode_bps + 1.0 / self.decode_bps + 1.0 / (self.ratio * b) < 1.0 / b

    def encode(self, raw: memoryview, itemsize: int) -> bytes | None:
        """The coded bytes when coding pays (or None: store raw); every ``PROBE_EVERY`` raw
        chunks one is encoded (and decoded) anyway to refresh ``E``, ``D`` and ``r``."""
        code = self.pays()
        with self._lock:
            self.coding = code
            probe = not code and self._since_probe >= PROBE_EVERY
            self._since_probe = 0 if (code or probe) else self._since_probe + 1
        if not (code or probe):
            with self._lock:
                self.raw += 1
            return None
        start = time.perf_counter()
        coded = self.codec.encode(raw, itemsize)
        took = time.perf_counter() - start
        if coded is None:
            with self._lock:
                self.raw += 1
            return None
        decode_s = None
        if probe:
            start = time.perf_counter()
            decode_into(self.codec.id, memoryview(coded), memoryview(bytearray(raw.nbytes)), itemsize)
            decode_s = time.perf_counter() - start
        with self._lock:
            self.encode_bps = _avg(self.encode_bps, raw.nbytes / max(took, 1e-9))
            self.ratio = _avg(self.ratio, raw.nbytes / len(coded))
            if decode_s is not None:
                self.decode_bps = _avg(self.decode_bps, raw.nbytes / max(decode_s, 1e-9))
            if code:
                self.coded += 1
            else:
                self.raw += 1
        return coded if code else None

    def observe_put(self, stored_bytes: int, seconds: float) -> None:
        """One put of the tier moved ``stored_bytes`` in ``seconds`` (codec time excluded)."""
        if stored_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.write_bps = _avg(self.write_bps, stored_bytes / seconds)
            self.tier_bps = self.read_bps or self.write_bps

    def observe_get(self, stored_bytes: int, seconds: float) -> None:
        """One read of the tier moved ``stored_bytes`` in ``seconds`` (decode time excluded).
        Once reads are seen, the rule uses their bandwidth: a re-read is what an engine waits on."""
        if stored_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.read_bps = _avg(self.read_bps, stored_bytes / seconds)
            self.tier_bps = self.read_bps

    def state(self) -> dict:
        """The current choice and its inputs (bytes per second; counts of coded/raw puts)."""
        with self._lock:
            return {"coding": self.coding, "tier_bps": self.tier_bps, "read_bps": self.read_bps,
                    "write_bps": self.write_bps, "encode_bps": self.encode_bps,
                    "decode_bps": self.decode_bps, "ratio": self.ratio, "coded_puts": self.coded,
                    "raw_puts": self.raw}


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EWMA) * old + _EWMA * new


_MEASURED: dict[tuple[str, int], tuple[float, float, float]] = {}


def _measure(codec: Codec, itemsize: int) -> tuple[float, float, float]:
    """(encode B/s, decode B/s, ratio) of ``codec`` on one thread over a 1 MiB sample of
    bf16-like values (normal, upper 16 bits of float32); measured once per process."""
    key = (codec.name, itemsize)
    if key not in _MEASURED:
        import numpy as np

        x = np.random.default_rng(0).normal(0, 1, 1 << 19).astype(np.float32)
        raw = memoryview((x.view(np.uint32) >> 16).astype(np.uint16)).cast("B")
        codec.encode(raw, itemsize)  # warm up
        start = time.perf_counter()
        coded = codec.encode(raw, itemsize) or bytes(raw)
        enc = time.perf_counter() - start
        out = memoryview(bytearray(raw.nbytes))
        start = time.perf_counter()
        if len(coded) < raw.nbytes:
            decode_into(codec.id, memoryview(coded), out, itemsize)
        dec = time.perf_counter() - start
        _MEASURED[key] = (raw.nbytes / max(enc, 1e-9), raw.nbytes / max(dec, 1e-9), raw.nbytes / len(coded))
    return _MEASURED[key]

"""Lossless KV codecs for the entries of slower tiers (``codec: none | lossless`` per tier).

``lossless``: Blosc2's bit-shuffle filter at the element width of the KV dtype (2 bytes for
bf16/fp16: the sign/exponent bits of every element line up, and they repeat), then LZ4, on one
thread. Chosen by measurement on the KV of the random Qwen2 test model (``kvtier bench codec``,
4 MiB of bf16 K/V, one core): 1.40 x at ~1.1 GB/s encode and ~2.4 GB/s decode; zstd-1 on the
raw bytes 1.28 x at 0.64/0.68 GB/s; byte planes + zstd-1 1.47 x but 0.24/0.51 GB/s; Blosc2
byte-shuffle + LZ4 1.16 x. Decoding must keep up with a tier's load path, so the fast decoder
with nearly the best ratio wins. The library is optional (``pip install blosc2``): configuring
``lossless`` without it is a ConfigError, and reading a coded entry without it is a miss.

Safety: ``decode_into`` writes into the caller's buffer, whose size is the entry's declared raw
length (already bounded by the reader's ``max_length`` and equal to shape x itemsize); Blosc2's
own declared size must equal it before a byte is decoded, so a forged entry can neither
allocate nor write more. Any failure is CorruptEntry (a counted miss upstream).

Imports: ``kvtier.errors`` and, lazily, ``blosc2``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal, get_args

from kvtier.errors import ConfigError, CorruptEntry

CodecName = Literal["none", "lossless"]
CODEC_NAMES = get_args(CodecName)
LOSSLESS_ID = 1  # codec ids are part of the entry format: never renumber
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
                    raise ConfigError("codec 'lossless' needs the blosc2 package (pip install blosc2); "
                                      "valid codecs without it: none") from exc
                _blosc2 = blosc2
    return _blosc2


@dataclass(frozen=True)
class Codec:
    """A lossless codec: ``encode`` returns the coded bytes (None when not worth it)."""

    name: str
    id: int

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


def get_codec(name: str, where: str = "codec") -> Codec | None:
    """The codec a tier's ``codec`` setting names (None for ``none``); ConfigError (one line,
    the valid choices) for another name or a missing library."""
    if name == "none":
        return None
    if name == "lossless":
        try:
            _lib()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return LOSSLESS
    raise ConfigError(f"{where}: unknown codec {name!r}; valid: {', '.join(CODEC_NAMES)}")


def decode_into(codec_id: int, stored: memoryview, out: memoryview, itemsize: int) -> None:
    """Decode ``stored`` (codec ``codec_id``) into exactly ``out``; CorruptEntry for an unknown
    codec, a missing library, a declared size other than ``out.nbytes`` or a bad stream."""
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
    try:
        lib.decompress2(stored, dst=out, nthreads=1)
    except Exception as exc:  # blosc2 raises ValueError/RuntimeError for bad streams
        raise CorruptEntry(f"codec stream does not decode ({type(exc).__name__})") from None

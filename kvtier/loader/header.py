"""safetensors headers: parse and validate before any tensor byte is read.

Layout: 8-byte little-endian header length N, N bytes of JSON
(``{"name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}``),
then the data section; offsets are relative to its start. Every check here runs on the header
alone, so a lying header costs at most the header's bytes (capped at ``MAX_HEADER_BYTES``) and
ends in one ``LoaderError`` line naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

from kvtier.errors import LoaderError

MAX_HEADER_BYTES = 100 * 1000 * 1000  # safetensors' own cap

# safetensors dtype -> (bytes per element, torch dtype attribute name)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order, metadata, where the data starts."""

    label: str
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int
    file_size: int


def parse_header(read: Callable[[int, int], bytes], file_size: int, label: str) -> Header:
    """Read and validate a header through ``read(offset, length)`` of a file of ``file_size`` bytes.

    Raises LoaderError("<label>: <problem>") for every malformed input, never another exception
    (``read`` itself may raise); reads at most 8 + min(N, MAX_HEADER_BYTES, file_size) bytes and
    allocates nothing in proportion to any size the header announces.
    """
    if file_size < 8:
        raise LoaderError(f"{label}: not a safetensors file ({file_size} bytes, shorter than the 8-byte length)")
    prefix = read(0, 8)
    if len(prefix) != 8:
        raise LoaderError(f"{label}: short read of the header length ({len(prefix)} of 8 bytes)")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise LoaderError(f"{label}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise LoaderError(f"{label}: header length {n} runs past the end of the file ({file_size} bytes)")
    raw = read(8, n)
    if len(raw) != n:
        raise LoaderError(f"{label}: short read of the header ({len(raw)} of {n} bytes)")
    return validate_header(raw, file_size, label)


class _Object(dict):
    """A decoded JSON object that remembers the first key it held twice (json keeps the last)."""

    duplicate: str | None = None


def _object(pairs: list[tuple[str, object]]) -> _Object:
    """``object_pairs_hook`` for ``json.loads``: a dict that records a repeated key."""
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                obj.duplicate = key
                break
            seen.add(key)
    return obj


def _decode(raw: bytes, label: str) -> dict:
    """The header's top-level JSON object; LoaderError on bad UTF-8, bad JSON, a non-object or a
    tensor name given twice."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_object)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LoaderError(f"{label}: header is not valid JSON ({_one_line(exc)})") from exc
    if not isinstance(doc, dict):
        raise LoaderError(f"{label}: header is not a JSON object")
    if isinstance(doc, _Object) and doc.duplicate is not None:
        what = "__metadata__" if doc.duplicate == "__metadata__" else f"tensor {_name(doc.duplicate)}"
        raise LoaderError(f"{label}: {what} appears more than once in the header")
    return doc


def validate_header(raw: bytes, file_size: int, label: str) -> Header:
    """Validate the JSON header bytes ``raw`` of a file of ``file_size`` bytes.

    A valid header has unique tensor names, each with exactly ``dtype`` (a known one), ``shape``
    (non-negative int64 dims whose product fits int64) and ``data_offsets`` ``[begin, end]``
    spanning exactly elements x dtype size inside the data section, no two tensors' bytes
    overlapping, and ``__metadata__`` (optional) mapping strings to strings. Gaps between tensors
    are allowed (never read into a tensor). Anything else: one LoaderError line naming the file
    and, where there is one, the tensor.
    """
    doc = _decode(raw, label)
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    metadata = _metadata(doc.pop("__metadata__", None), label)
    infos = [_tensor_info(name, entry, data_start, data_size, label) for name, entry in doc.items()]
    infos.sort(key=lambda t: (t.start, t.end))
    for prev, cur in zip(infos, infos[1:]):
        if cur.start < prev.end:
            raise LoaderError(f"{label}: tensors {_name(prev.name)} and {_name(cur.name)} overlap "
                              f"(bytes [{prev.start}, {prev.end}) and [{cur.start}, {cur.end}) of the file)")
    return Header(label, {t.name: t for t in infos}, metadata, data_start, file_size)


def _metadata(value: object, label: str) -> dict[str, str]:
    """``__metadata__``: absent/null, or an object of string -> string without repeated keys."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LoaderError(f"{label}: __metadata__ must be an object of strings, got {_kind(value)}")
    if isinstance(value, _Object) and value.duplicate is not None:
        raise LoaderError(f"{label}: __metadata__ key {_name(value.duplicate)} appears more than once")
    for key, item in value.items():
        if not isinstance(item, str):
            raise LoaderError(f"{label}: __metadata__ key {_name(key)} must map to a string, got {_kind(item)}")
    return dict(value)


def _tensor_info(name: str, entry: object, data_start: int, data_size: int, label: str) -> TensorInfo:
    where = f"{label}: tensor {_name(name)}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise LoaderError(f"{where}: entry must have exactly dtype, shape and data_offsets")
    if isinstance(entry, _Object) and entry.duplicate is not None:
        raise LoaderError(f"{where}: field {_name(entry.duplicate)} appears more than once")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise LoaderError(f"{where}: unknown dtype {_short(dtype)}; known: {', '.join(DTYPES)}")
    elements = _elements(shape, where)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise LoaderError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                          f"got {_short(offsets)}")
    begin, end = offsets
    if end > data_size:
        raise LoaderError(f"{where}: data_offsets {_short(offsets)} run past the end of the data ({data_size} bytes)")
    expected = elements * DTYPES[dtype][0]
    if expected != end - begin:
        raise LoaderError(f"{where}: shape {_short(shape)} x {dtype} is {expected} bytes "
                          f"but data_offsets span {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


INT64_MAX = 2**63 - 1


def _elements(shape: object, where: str) -> int:
    """The element count of a header ``shape``; LoaderError unless it is a list of non-negative
    ints (not bools) each within int64, whose non-zero dims multiply to at most int64 (what torch
    accepts). Linear in the number of dims: the product stops growing once it is too large."""
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise LoaderError(f"{where}: shape must be a list of non-negative integers, got {_short(shape)}")
    product, zero = 1, False
    for d in shape:
        if d > INT64_MAX:
            raise LoaderError(f"{where}: shape {_short(shape)} has dim {_short(d)}, beyond int64")
        if d == 0:
            zero = True
            continue
        product *= d
        if product > INT64_MAX:
            raise LoaderError(f"{where}: shape {_short(shape)} has more elements than int64 can count")
    return 0 if zero else product


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _name(name: str) -> str:
    """A tensor name or key for a one-line message: quoted, escaped, at most ~80 characters."""
    return repr(name if len(name) <= 80 else name[:77] + "...")


def _short(value: object) -> str:
    """A decoded JSON value for a one-line message: bounded length, no recursion, no huge ints."""
    if isinstance(value, list):
        if len(value) > 16 or any(isinstance(v, (list, dict)) for v in value):
            return f"<array of {len(value)} items>"
        text = "[" + ", ".join(_short(v) for v in value) + "]"
    elif isinstance(value, dict):
        return f"<object of {len(value)} keys>"
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<{value.bit_length()}-bit integer>"
    elif isinstance(value, str):
        text = repr(value[:40] + ("..." if len(value) > 40 else ""))
    else:
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _kind(value: object) -> str:
    """The JSON type name of a decoded value, for messages."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            type(None): "null"}.get(type(value), "an object")


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def read_file_header(path: str | os.PathLike) -> Header:
    """Parse the header of a local file (a convenience over ``parse_header``)."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return parse_header(lambda off, n: os.pread(f.fileno(), n, off), size, label)
    except OSError as exc:
        raise LoaderError(f"{label}: cannot read ({exc.strerror})") from exc


INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024  # real indexes are kilobytes to a few MB


def index_files(index_text: str, label: str) -> list[str]:
    """The distinct file names of a ``model.safetensors.index.json`` document, in first-use order."""
    try:
        doc = json.loads(index_text)
    except (ValueError, RecursionError) as exc:
        raise LoaderError(f"{label}: index is not valid JSON ({_one_line(exc)})") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise LoaderError(f"{label}: index has no weight_map of tensor name -> file name")
    files = list(dict.fromkeys(weight_map.values()))
    for f in files:
        if "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors"):
            raise LoaderError(f"{label}: index names an unsafe file {f[:80]!r}")
    return files

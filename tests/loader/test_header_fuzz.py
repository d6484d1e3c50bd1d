"""Property-based fuzzing of the safetensors header parser (issue 9, "How it is shown").

Thousands of generated inputs per run: JSON documents built key by key (so tensor names, fields
and ``__metadata__`` keys can repeat, as a hostile writer may), entries mixing valid and invalid
dtypes, shapes and offsets (negative, bools, floats, strings, nested, up to 2**70), random bytes
behind a plausible length, truncated files and sources that return fewer bytes than their size.
For every input the parser either returns a header consistent with the file or raises
kvtier's LoaderError in one line naming the file: never another exception, never more than a
two seconds, never a read beyond the file, never an allocation in proportion to an announced size.
Headers that parse are also streamed by the reader, which must yield every tensor with the
announced shape and dtype (the ``[2**64, 0]`` class of bug: valid to the parser, fatal to torch).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tracemalloc
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from kvtier.errors import LoaderError
from kvtier.loader.header import DTYPES, MAX_HEADER_BYTES, Header, parse_header

INT64_MAX = 2**63 - 1  # what torch can count

LABEL = "fuzz.safetensors"


def _fuzz(examples: int, seconds: float = 2.0) -> settings:
    """Settings of one property: ``examples`` inputs, each a failure when it takes over ``seconds``."""
    return settings(max_examples=examples, deadline=timedelta(seconds=seconds),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- the oracle ---------------------------------------------------------------------------------

def _parse(blob: bytes, file_size: int | None = None) -> Header | LoaderError:
    """Parse ``blob`` as a file of ``file_size`` bytes (default its length; larger = the source
    returns short reads). Asserts the parser's contracts on reads, memory and errors."""
    size = len(blob) if file_size is None else file_size
    asked: list[int] = []

    def read(off: int, n: int) -> bytes:
        assert 0 <= off and 0 <= n and off + n <= size, f"read [{off}, {off + n}) outside a {size}-byte file"
        asked.append(n)
        return blob[off:off + n]

    tracing = tracemalloc.is_tracing()  # leave a tracer someone else started running
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        got: Header | LoaderError = parse_header(read, size, LABEL)
    except LoaderError as exc:
        got = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not tracing:
            tracemalloc.stop()
    # JSON objects cost a few hundred bytes per input byte at worst, never a size the header announces
    assert peak <= 400 * len(blob) + (1 << 20), f"peak {peak} bytes for a {len(blob)}-byte input"
    assert sum(asked) <= 8 + min(size, MAX_HEADER_BYTES)
    if isinstance(got, LoaderError):
        text = str(got)
        assert text.startswith(LABEL + ": ") and "\n" not in text and len(text) <= 600, text
    else:
        _assert_consistent(got, size)
    return got


def _assert_consistent(h: Header, size: int) -> None:
    """A returned header describes bytes inside the file, exactly, without overlaps."""
    assert h.file_size == size and 8 <= h.data_start <= size
    spans = []
    for name, t in h.tensors.items():
        assert t.name == name and t.dtype in DTYPES
        assert all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= INT64_MAX for d in t.shape)
        assert math.prod(d for d in t.shape if d) <= INT64_MAX
        assert h.data_start <= t.start <= t.end <= size
        assert t.nbytes == math.prod(t.shape) * DTYPES[t.dtype][0]
        spans.append((t.start, t.end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items())


# -- generators ---------------------------------------------------------------------------------

_scalar = (st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
           | st.integers(-2**70, 2**70) | st.text(max_size=6))
_json_any = st.recursive(_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                         max_leaves=10)
_dim = st.one_of(st.integers(0, 6), st.just(0), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64]),
                 st.integers(-3, -1), st.booleans(), st.floats(0, 4), st.text(max_size=2), st.integers(0, 2**70))
_shape = st.one_of(st.lists(_dim, max_size=5), _json_any)
_dtype = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["F4", "f32", "", "BF16 ", "bool"]), _json_any)


def _encode(pairs: list[tuple[str, object]]) -> str:
    """A JSON object from key/value pairs, keeping repeated keys (json.dumps of a dict cannot)."""
    return "{" + ", ".join(f"{json.dumps(k)}: {_value(v)}" for k, v in pairs) + "}"


def _value(v: object) -> str:
    return _encode(v.pairs) if isinstance(v, _Pairs) else json.dumps(v)


class _Pairs:
    """A JSON object given as ordered pairs (possibly repeating keys)."""

    def __init__(self, pairs: list[tuple[str, object]]):
        self.pairs = pairs


_empty_shape = st.lists(st.sampled_from([0, 1, 7, 2**31, 2**62, 2**63 - 1]), min_size=1, max_size=3).map(lambda s: s + [0])


@st.composite
def _entry(draw, offset: int, fuzz: bool) -> tuple[object, int]:
    """One tensor entry, consistent at ``offset`` (zero-element ones may have huge dims); when
    ``fuzz``, often with a field fuzzed, missing, repeated or extra. Returns it with the offset
    after it."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.one_of(st.lists(st.integers(0, 5), max_size=3), _empty_shape))
    if math.prod(d for d in shape if d) > INT64_MAX:
        shape = [0]
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    fields: list[tuple[str, object]] = [("dtype", dtype), ("shape", shape), ("data_offsets", [offset, offset + nbytes])]
    mode = draw(st.sampled_from(["ok"] * 6 + ["dtype", "shape", "offsets", "drop", "repeat", "extra", "any"])
                if fuzz else st.just("ok"))
    if mode == "dtype":
        fields[0] = ("dtype", draw(_dtype))
    elif mode == "shape":
        fields[1] = ("shape", draw(_shape))
    elif mode == "offsets":
        fields[2] = ("data_offsets", draw(st.one_of(
            st.lists(_dim, max_size=3), st.tuples(st.integers(0, offset + 64), st.integers(0, offset + 64)).map(list))))
    elif mode == "drop":
        fields.pop(draw(st.integers(0, 2)))
    elif mode == "repeat":
        fields.append(draw(st.sampled_from(fields)))
    elif mode == "extra":
        fields.append((draw(st.text(max_size=4)), draw(_json_any)))
    elif mode == "any":
        return draw(_json_any), offset
    draw(st.randoms()).shuffle(fields)
    return _Pairs(fields), offset + nbytes


@st.composite
def _document(draw, fuzz: bool = True) -> tuple[str, int, bool]:
    """(header JSON text, data length, whether a top-level key repeats). Without ``fuzz``: a valid
    header (unique names, consistent entries, string metadata) and enough data."""
    pairs: list[tuple[str, object]] = []
    offset = 0
    for i in range(draw(st.integers(0, 5))):
        name = draw(st.one_of(st.sampled_from(["w", "a.b", "w", ""]), st.text(max_size=5))) if fuzz else f"t{i}"
        entry, offset = draw(_entry(offset, fuzz))
        pairs.append((name, entry))
    meta = draw(st.sampled_from(["none", "ok", "any", "repeat"] if fuzz else ["none", "ok"]))
    if meta == "ok":
        pairs.append(("__metadata__", {"format": "pt"}))
    elif meta == "any":
        pairs.append(("__metadata__", draw(_json_any)))
    elif meta == "repeat":
        pairs.append(("__metadata__", _Pairs([("k", "a"), ("k", "b")])))
    draw(st.randoms()).shuffle(pairs)
    data = draw(st.one_of(st.just(offset), st.integers(0, offset + 16)) if fuzz else st.integers(offset, offset + 16))
    repeated = len({k for k, _ in pairs}) != len(pairs)
    return _encode(pairs), data, repeated


def _file(text: str, data: int, pad: int = 0) -> bytes:
    raw = text.encode() + b" " * pad
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


# -- properties ---------------------------------------------------------------------------------

@pytest.mark.slow
@_fuzz(1500)
@given(_document(), st.integers(0, 7))
def test_generated_headers_parse_consistently_or_fail_in_one_line(doc, pad):
    text, data, repeated = doc
    got = _parse(_file(text, data, pad))
    event("parsed" if isinstance(got, Header) else "refused")  # both sides are covered: see --hypothesis-show-statistics
    if repeated:
        assert isinstance(got, LoaderError), "a repeated tensor name or __metadata__ was accepted"


@_fuzz(600)
@given(_document(), st.data())
def test_truncated_and_short_reading_files_fail_in_one_line(doc, data):
    text, size, _ = doc
    blob = _file(text, size)
    cut = data.draw(st.integers(0, len(blob)))
    _parse(blob[:cut])  # a truncated file
    lie = data.draw(st.integers(cut, cut + 64))
    _parse(blob[:cut], file_size=lie)  # a source whose reads come back short of its size


@_fuzz(800)
@given(st.binary(max_size=300), st.integers(0, 64))
def test_random_bytes_behind_a_plausible_length_fail_in_one_line(body, extra):
    _parse(struct.pack("<Q", len(body)) + body + bytes(extra))
    _parse(body)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _assert_streams(blob: bytes, header: Header, directory, mode: str) -> None:
    """What the parser accepts, the reader delivers: each tensor with the announced shape and dtype."""
    import torch

    from kvtier.loader.reader import ReaderConfig, StreamReader

    path = os.path.join(directory, "t.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    with StreamReader([path], ReaderConfig(local_mode=mode)) as reader:
        got = dict(reader.stream())
    assert set(got) == set(header.tensors)
    for name, tensor in got.items():
        info = header.tensors[name]
        assert tuple(tensor.shape) == info.shape
        assert tensor.dtype == getattr(torch, DTYPES[info.dtype][1])


@_fuzz(300)
@given(st.lists(st.sampled_from([0, 1, 3, 2**31, 2**62, 2**63 - 1, 2**63, 2**64]), max_size=6),
       st.sampled_from(sorted(DTYPES)))
def test_extreme_shapes_are_refused_unless_torch_can_hold_them(fuzz_dir, shape, dtype):
    """Zero-element tensors with huge dims (``[2**64, 0]`` once crashed the reader): accepted only
    when every dim and the element count fit int64, and then streamed."""
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    assume(nbytes <= 64)
    blob = _file(json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}), nbytes)
    got = _parse(blob)
    fits = all(d <= INT64_MAX for d in shape) and math.prod(d for d in shape if d) <= INT64_MAX
    assert isinstance(got, Header) == fits, (shape, got)
    if fits:
        _assert_streams(blob, got, fuzz_dir, "read")


@_fuzz(150, seconds=5)
@given(_document(fuzz=False), st.sampled_from(["read", "mmap"]))
def test_every_header_that_parses_streams_with_its_shapes(fuzz_dir, doc, mode):
    """Generated headers that parse are read back by the reader without a torch exception."""
    text, data, _ = doc
    blob = _file(text, data)
    header = _parse(blob)
    assert isinstance(header, Header), header
    _assert_streams(blob, header, fuzz_dir, mode)

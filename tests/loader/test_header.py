"""Header parsing: valid files parse; random and mutated headers never crash, hang or over-allocate."""

from __future__ import annotations

import json
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.errors import LoaderError
from kvtier.loader.header import DTYPES, MAX_HEADER_BYTES, index_files, parse_header


def _parse(blob: bytes, label: str = "f.safetensors"):
    """Parse ``blob``; return (result or LoaderError, bytes requested through read)."""
    asked = []

    def read(off: int, n: int) -> bytes:
        asked.append(n)
        return blob[off:off + n]

    try:
        return parse_header(read, len(blob), label), sum(asked)
    except LoaderError as exc:
        return exc, sum(asked)


def _file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_valid_header_parses():
    h = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
         "b": {"dtype": "BF16", "shape": [], "data_offsets": [16, 18]}, "__metadata__": {"format": "pt"}}
    got, _ = _parse(_file(h, bytes(18)))
    assert list(got.tensors) == ["a", "b"] and got.metadata == {"format": "pt"}
    assert got.tensors["b"].start == got.data_start + 16


@pytest.mark.parametrize("header,data,needle", [
    ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, 4, "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4, "is 8 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 2, "past the end"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, 8, "overlap"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4, "non-negative"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, 4, "begin <= end"),
    ({"a": [1, 2]}, 0, "exactly dtype"),
    # issue 9, item 15: every case below passed validation or raised a non-LoaderError before
    ({"a": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}}, 0, "beyond int64"),
    ({"a": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}}, 0, "beyond int64"),
    ({"a": {"dtype": "F32", "shape": [2**62, 4, 0], "data_offsets": [0, 0]}}, 0, "more elements than int64"),
    ({"a": {"dtype": "U8", "shape": [2**62] * 300, "data_offsets": [0, 1]}}, 1, "more elements than int64"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, 4, "non-negative integers"),
    ({"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, 4, "non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}}, 4, "data_offsets must be"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 8, "data_offsets must be"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": []}, 4, "__metadata__ must be"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": 0}, 4, "__metadata__ must be"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": ""}, 4, "__metadata__ must be"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"k": 1}}, 4, "key 'k' must map"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8, "overlap"),
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 10**4000]}}, 1, "run past the end"),  # stays short
    ({"a": {"dtype": [[["U8"] * 50] * 50], "shape": [1], "data_offsets": [0, 1]}}, 1, "unknown dtype <array"),
])
def test_bad_headers_get_one_line_errors(header, data, needle):
    err, _ = _parse(_file(header, bytes(data)), "m.safetensors")
    assert isinstance(err, LoaderError)
    assert needle in str(err) and str(err).startswith("m.safetensors: ") and "\n" not in str(err)
    assert len(str(err)) < 400
    if ": tensor" in str(err):
        assert "'a'" in str(err) or "'b'" in str(err)


def _raw_file(text: str, data: int = 0) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


@pytest.mark.parametrize("text,needle", [
    ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
     ' "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "tensor 'w' appears more than once"),
    ('{"w": {"dtype": "F32", "dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "field 'dtype' appears"),
    ('{"__metadata__": {"k": "a", "k": "b"}}', "__metadata__ key 'k' appears more than once"),
    ('{"__metadata__": {}, "__metadata__": {}}', ": __metadata__ appears more than once"),
])
def test_duplicate_names_are_one_line_errors(text, needle):
    """json.loads keeps the last of two equal keys: the header must be refused instead (item 15)."""
    err, _ = _parse(_raw_file(text, 8), "dup.safetensors")
    assert isinstance(err, LoaderError), err
    assert str(err).startswith("dup.safetensors: ") and needle in str(err) and "\n" not in str(err)


def test_many_huge_dims_are_rejected_in_linear_time():
    """50,000 dims of 2**62: once a ValueError (int too large to print) after seconds of bigint products."""
    h = {"a": {"dtype": "U8", "shape": [2**62] * 50000, "data_offsets": [0, 1]}}
    start = time.perf_counter()
    err, _ = _parse(_file(h, bytes(1)))
    assert isinstance(err, LoaderError) and "more elements than int64" in str(err)
    assert time.perf_counter() - start < 1.0 and len(str(err)) < 300


def test_short_read_of_the_length_is_an_error():
    """A source that returns fewer bytes than its size promised (a file truncated under us)."""
    with pytest.raises(LoaderError, match="short read of the header length"):
        parse_header(lambda off, n: b"\x10\x00", 64, "t.safetensors")


def test_non_utf8_header_is_an_error():
    err, _ = _parse(struct.pack("<Q", 4) + b'{"\xff"' + bytes(4))
    assert isinstance(err, LoaderError) and "not valid JSON" in str(err)


def test_unknown_dtype_is_named():
    err, _ = _parse(_file({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1)))
    assert "tensor 'a': unknown dtype 'F4'" in str(err)


def test_lying_length_is_not_allocated():
    blob = struct.pack("<Q", 2**63) + b"{}"
    err, asked = _parse(blob)
    assert isinstance(err, LoaderError) and asked == 8
    err, asked = _parse(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    assert "exceeds" in str(err) and asked == 8


def test_huge_shape_is_rejected_without_allocation():
    h = {"a": {"dtype": "F64", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}
    err, asked = _parse(_file(h, bytes(8)))
    assert isinstance(err, LoaderError) and asked < 200


def test_deeply_nested_json_is_an_error():
    raw = b"[" * 100000 + b"]" * 100000
    err, _ = _parse(struct.pack("<Q", len(raw)) + raw)
    assert isinstance(err, LoaderError)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_random_bytes_never_crash(blob):
    got, asked = _parse(blob)
    assert asked <= len(blob) + 8


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                     max_leaves=12)


@st.composite
def _mutated(draw):
    """A valid header with one field replaced by arbitrary JSON, and a random data length."""
    n = draw(st.integers(1, 4))
    header, pos = {}, 0
    for i in range(n):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        size = DTYPES[dtype][0]
        for d in shape:
            size *= d
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    name = f"t{draw(st.integers(0, n - 1))}"
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", None]))
    if field == "__metadata__":
        header["__metadata__"] = draw(_json)
    elif field is not None:
        header[name][field] = draw(_json)
    data = draw(st.integers(0, pos + 8))
    return header, data


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_mutated_headers_never_crash(case):
    header, data = case
    blob = _file(header, bytes(data))
    got, asked = _parse(blob)
    assert asked <= len(blob)
    if not isinstance(got, LoaderError):
        for t in got.tensors.values():
            assert got.data_start <= t.start <= t.end <= len(blob)


@settings(max_examples=100)
@given(st.binary(max_size=64), st.integers(0, 2**64 - 1))
def test_random_length_prefix_never_crashes(tail, n):
    _parse(struct.pack("<Q", n) + tail)


def test_index_files():
    doc = json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-1.safetensors"}})
    assert index_files(doc, "i") == ["m-1.safetensors", "m-2.safetensors"]
    with pytest.raises(LoaderError, match="unsafe"):
        index_files(json.dumps({"weight_map": {"a": "../x.safetensors"}}), "i")

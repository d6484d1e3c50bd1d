"""Header parsing: valid files parse; random and mutated headers never crash, hang or over-allocate."""

from __future__ import annotations

import json
import struct

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
])
def test_bad_headers_get_one_line_errors(header, data, needle):
    err, _ = _parse(_file(header, bytes(data)), "m.safetensors")
    assert isinstance(err, LoaderError)
    assert needle in str(err) and str(err).startswith("m.safetensors: ") and "\n" not in str(err)


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

"""kvtier.fastcopy under a careless caller: the contract (every pair checked before a byte moves,
the same bytes on the extension's path and on numpy's) holds for odd buffers, odd sequences and
odd dtypes, the extension holds its exports for the whole copy, and ``kvtier bench copy``'s bad
arguments are one line."""

import gc
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from kvtier import fastcopy

ext = pytest.importorskip("kvtier._ntcopy") if fastcopy._ntcopy is None else fastcopy._ntcopy


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture(params=["extension", "numpy"])
def path(request, monkeypatch):
    """Each test runs on both paths: with the extension, and as an install without it."""
    if request.param == "numpy":
        monkeypatch.setattr(fastcopy, "_ntcopy", None)
    return request.param


@pytest.mark.parametrize("dst", ["bytes", "memoryview of bytes"])
def test_a_read_only_non_numpy_dst_raises_before_any_byte_is_copied(path, dst):
    """A ``bytes`` destination refuses a writable export with BufferError, which the wrapper
    took for "not contiguous": numpy then copied the valid first pair before failing."""
    good_dst, src = np.zeros(8192, dtype=np.uint8), _random(8192, 1)
    frozen = bytes(8192) if dst == "bytes" else memoryview(bytes(8192))
    with pytest.raises((ValueError, TypeError, BufferError)):
        fastcopy.copy_pairs([(good_dst, src), (frozen, src)])
    assert not good_dst.any()


def test_a_generator_of_pairs_with_a_non_contiguous_one_is_copied(path):
    """The extension used the generator up before its BufferError; the fallback found it empty
    and returned without copying anything."""
    src = _random(2 * 8192, 2)
    dst = np.zeros(2 * 8192, dtype=np.uint8)
    fastcopy.copy_pairs((p for p in [(dst[::2], src[::2]), (dst[1::2], src[1::2])]))
    assert np.array_equal(dst, src)
    out = np.zeros(4096, dtype=np.uint8)
    fastcopy.copy_pairs(iter([(out, src[:4096])]))
    assert np.array_equal(out, src[:4096])


def test_an_invalid_pair_after_a_non_contiguous_one_raises_before_any_byte_is_copied(path):
    """The fallback checks every pair first (it copied the non-contiguous pair, then failed)."""
    src = _random(2 * 8192, 3)
    dst = np.zeros(2 * 8192, dtype=np.uint8)
    for bad in [(np.zeros(8191, dtype=np.uint8), src[:8192]), (np.zeros(8192, dtype=np.uint8), 7),
                [np.zeros(8192, dtype=np.uint8), src[:8192]]]:
        with pytest.raises((ValueError, TypeError)):
            fastcopy.copy_pairs([(dst[::2], src[::2]), bad])
        assert not dst.any()


def test_numpy_never_broadcasts_a_shorter_src(path):
    """np.copyto broadcast a 1-byte src over a whole page where the extension said ValueError."""
    src = _random(64, 4)
    page, one = np.zeros(4096, dtype=np.uint8), np.ones(1, dtype=np.uint8)
    with pytest.raises(ValueError):
        fastcopy.copy_pairs([(src[::2].copy()[::2], src[::4]), (page, one)])
    with pytest.raises(ValueError):
        fastcopy.copy_pairs([(page, one)])
    assert not page.any()


def test_other_dtypes_are_copied_byte_for_byte_on_both_paths(path):
    """Equal-length arrays of other dtypes: the extension copies bytes, np.copyto cast the values
    (float32 from int32: 1 became 1.0). Both now give the bytes, contiguous or not."""
    src = np.arange(4096, dtype=np.int32)
    dst = np.zeros(4096, dtype=np.float32)
    fastcopy.copy_pairs([(dst, src)])
    assert np.array_equal(dst.view(np.int32), src)
    strided = np.zeros((64, 128), dtype=np.float32)[:, ::2]
    fastcopy.copy_pairs([(strided, src.reshape(64, 64))])
    assert np.array_equal(strided.view(np.int32), src.reshape(64, 64))
    with pytest.raises(ValueError):  # not contiguous and not one shape: no bytewise meaning
        fastcopy.copy_pairs([(strided, src.view(np.uint8)[: strided.nbytes])])


def test_shapes_of_equal_byte_length_copy_on_both_paths(path):
    """A 2-D page from a flat piece (what the extension does) also without the extension."""
    src = _random(8192, 5)
    dst = np.zeros((2, 4096), dtype=np.uint8)
    fastcopy.copy_pairs([(dst, src)])
    assert np.array_equal(dst.reshape(-1), src)


def test_plain_buffers_and_tuple_subclasses_work_on_both_paths(path):
    from collections import namedtuple

    Pair = namedtuple("Pair", "dst src")
    src = _random(5000, 6)
    ba = bytearray(5000)
    view = memoryview(bytearray(5000))
    fastcopy.copy_pairs([Pair(ba, src), (view, bytes(src))])
    assert bytes(ba) == src.tobytes() == bytes(view)
    fastcopy.copy_pairs([])
    fastcopy.copy_pairs([(bytearray(), b""), (np.zeros(0, dtype=np.uint8), np.zeros((0, 3), dtype=np.uint8))])


def test_the_extension_takes_release_gil_by_keyword():
    """Its docstring's signature is ``copy_pairs(pairs, release_gil=True)``; METH_VARARGS
    refused the keyword."""
    dst, src = np.zeros(4096, dtype=np.uint8), _random(4096, 7)
    ext.copy_pairs(pairs=[(dst, src)], release_gil=False)
    assert np.array_equal(dst, src)


def test_self_chained_and_many_pairs():
    a = _random(1 << 20, 8)
    keep = a.copy()
    ext.copy_pairs([(a, a)])  # same buffer: unchanged
    assert np.array_equal(a, keep)
    b, c = np.zeros_like(a), np.zeros_like(a)
    ext.copy_pairs([(b, a), (c, b)])  # the second reads what the first streamed
    assert np.array_equal(c, a)
    d = np.zeros(100_000, dtype=np.uint8)
    s = _random(100_000, 9)
    ext.copy_pairs([(d[i:i + 1], s[i:i + 1]) for i in range(100_000)])
    assert np.array_equal(d, s)


def test_a_buffer_cannot_be_resized_while_the_gil_is_released():
    """The extension holds each buffer's export through the copy: a bytearray resized by another
    thread meanwhile raises BufferError there, and the copy ends with the bytes."""
    n = 32 << 20
    ba, src = bytearray(n), _random(n, 10)
    outcomes = []
    go = threading.Event()

    def resize():
        go.wait()
        for _ in range(50):
            try:
                ba.extend(b"x")
                del ba[-1]
                outcomes.append("resized")
            except BufferError:
                outcomes.append("refused")

    t = threading.Thread(target=resize)
    t.start()
    go.set()
    ext.copy_pairs([(ba, src)] * 4)
    t.join()
    assert len(ba) == n and bytes(ba[:4096]) == src[:4096].tobytes() and bytes(ba[-4096:]) == src[-4096:].tobytes()


def test_no_references_or_memory_leak_on_any_path():
    d, s = np.zeros(64, dtype=np.uint8), np.ones(64, dtype=np.uint8)
    ro = np.zeros(64, dtype=np.uint8)
    ro.flags.writeable = False
    calls = [[(d, s)] * 4, [(d, s), (d[:9], s)], [(d, s), (ro, s)], [(d, s), (d[::2], s[::2])],
             [(d, s), (d, 1)], [(d, s), (d,)], [(d, s), (memoryview(bytes(64)), s)]]

    def burst(k):
        for _ in range(k):
            for pairs in calls:
                for f in (ext.copy_pairs, fastcopy.copy_pairs):
                    try:
                        f(pairs)
                    except (ValueError, TypeError, BufferError):
                        pass

    burst(200)
    gc.collect()
    refs = [sys.getrefcount(x) for x in (d, s, ro)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        burst(3000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10, grown
    assert [sys.getrefcount(x) for x in (d, s, ro)] == refs


@pytest.mark.parametrize("argv", [["--page", "0"], ["--span", str(1 << 60), "--pages", "1", "--rounds", "1"]])
def test_kvtier_bench_copy_bad_arguments_are_one_line(argv, capsys):
    """``--page 0`` was a ZeroDivisionError, a span past memory a numpy MemoryError traceback."""
    from kvtier.cli import main

    assert main(["bench", "copy", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and ("--page" in err or "--span" in err)


def test_the_connectors_page_copies_import_and_use_it():
    """pages.py imported ``kvtier.affinity``, which the affinity revert removed: the connector's
    page module (every vLLM load and save) failed to import."""
    pytest.importorskip("torch")
    from kvtier.integrations.vllm import pages
    src = _random(3 * 8192, 11)
    dst = np.zeros_like(src)
    pages.copy_pairs([(dst[i:i + 8192], src[i:i + 8192]) for i in range(0, src.size, 8192)])
    assert np.array_equal(dst, src)

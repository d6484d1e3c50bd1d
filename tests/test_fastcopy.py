"""kvtier.fastcopy: the streaming copy of KV pages gives the bytes ``np.copyto`` gives, for every
size and alignment, checks every pair before it copies one, and falls back to numpy where the
extension cannot take a pair (or is not built)."""

import platform
import shutil
import sys
import threading

import numpy as np
import pytest

from kvtier import fastcopy

ext = pytest.importorskip("kvtier._ntcopy") if fastcopy._ntcopy is None else fastcopy._ntcopy


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_extension_is_built_where_a_compiler_was_found():
    """``make install`` builds it on this kind of machine (x86-64 Linux with a C compiler): a
    missing build would silently cost the connector its streaming copies."""
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and shutil.which("cc")):
        pytest.skip("not an x86-64 Linux machine with a C compiler")
    assert fastcopy._ntcopy is not None and fastcopy.STREAMING


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, 4096 + 63, 65536, (128 << 10) + 7])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (7, 13), (15, 1), (16, 16)])
def test_every_size_and_alignment_copies_exactly_and_nothing_around_it(n, dst_off, src_off):
    src_buf = _random(n + 64, n)
    dst_buf = np.zeros(n + 64, dtype=np.uint8)
    src, dst = src_buf[src_off : src_off + n], dst_buf[dst_off : dst_off + n]
    fastcopy.copy_pairs([(dst, src)])
    assert np.array_equal(dst, src)
    assert not dst_buf[:dst_off].any() and not dst_buf[dst_off + n :].any()  # no byte written outside dst


@pytest.mark.parametrize("n", [0, 17, 4095, 4096, 4097, 70000, (128 << 10) + 7])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (7, 13)])
def test_ordinary_stores_copy_the_same_bytes_and_nothing_around_them(n, dst_off, src_off):
    src_buf = _random(n + 64, n + 1)
    dst_buf = np.zeros(n + 64, dtype=np.uint8)
    src, dst = src_buf[src_off : src_off + n], dst_buf[dst_off : dst_off + n]
    fastcopy.copy_pairs([(dst, src)], release_gil=False, stream=False)
    assert np.array_equal(dst, src)
    assert not dst_buf[:dst_off].any() and not dst_buf[dst_off + n :].any()
    with pytest.raises(ValueError):  # the same checks before any byte moves
        fastcopy.copy_pairs([(dst_buf[:8], src_buf[:8]), (np.zeros(3, np.uint8), src_buf[:4])], stream=False)


def test_a_load_stays_in_the_cache_only_when_it_fits_in_three_quarters_of_it(tmp_path):
    assert fastcopy.stays_cached(24 << 20, 32 << 20) and not fastcopy.stays_cached((24 << 20) + 1, 32 << 20)
    assert not fastcopy.stays_cached(1, None) and not fastcopy.stays_cached(0, 32 << 20)
    for name, level, size in (("index0", "1", "32K"), ("index2", "2", "1024K"), ("index3", "3", "32768K"),
                              ("index4", "x", "9G"), ("index5", "4", "lots")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")  # not a cache index: ignored
    assert fastcopy.last_level_cache_bytes(str(tmp_path)) == 32 << 20  # the bad entries are skipped
    assert fastcopy.last_level_cache_bytes(str(tmp_path / "missing")) is None
    (tmp_path / "index3" / "size").write_text("2M")
    assert fastcopy.last_level_cache_bytes(str(tmp_path)) == 2 << 20


def test_many_pairs_in_one_call_and_the_numpy_path_agree(monkeypatch):
    sizes = [128 << 10, 5, 4096, 70000, 0, 1 << 20]
    srcs = [_random(n, i) for i, n in enumerate(sizes)]
    out = [np.zeros(n, dtype=np.uint8) for n in sizes]
    fastcopy.copy_pairs(list(zip(out, srcs)))
    monkeypatch.setattr(fastcopy, "_ntcopy", None)
    ref = [np.zeros(n, dtype=np.uint8) for n in sizes]
    fastcopy.copy_pairs(list(zip(ref, srcs)))
    for a, b, s in zip(out, ref, srcs):
        assert np.array_equal(a, s) and np.array_equal(b, s)


@pytest.mark.parametrize("bad", ["short", "read-only", "not a pair", "not a buffer"])
def test_an_invalid_pair_anywhere_raises_before_any_byte_is_copied(bad):
    good_src, good_dst = _random(8192, 1), np.zeros(8192, dtype=np.uint8)
    src = _random(8192, 2)
    if bad == "short":
        item = (np.zeros(8191, dtype=np.uint8), src)
    elif bad == "read-only":
        frozen = np.zeros(8192, dtype=np.uint8)
        frozen.flags.writeable = False
        item = (frozen, src)
    elif bad == "not a pair":
        item = (np.zeros(8192, dtype=np.uint8),)
    else:
        item = (np.zeros(8192, dtype=np.uint8), 12345)
    with pytest.raises((ValueError, TypeError, BufferError)):
        ext.copy_pairs([(good_dst, good_src), item])
    assert not good_dst.any()  # the valid first pair was not copied either
    with pytest.raises(TypeError):
        ext.copy_pairs(42)


def test_a_non_contiguous_view_is_copied_by_numpy():
    src = _random(2 * 8192, 3)
    dst = np.zeros(2 * 8192, dtype=np.uint8)
    fastcopy.copy_pairs([(dst[::2], src[::2]), (dst[1::2], src[1::2])])
    assert np.array_equal(dst, src)


def test_an_engines_torch_pages_are_a_destination():
    torch = pytest.importorskip("torch")
    cache = torch.zeros((4, 64 << 10), dtype=torch.bfloat16)
    pages = cache.view(torch.uint8).numpy()  # how the connector sees an engine's CPU KV cache
    src = _random(pages.shape[1], 4)
    fastcopy.copy_pairs([(pages[2], src)])
    assert np.array_equal(cache.view(torch.uint8)[2].numpy(), src) and not cache[[0, 1, 3]].any()


def test_the_copy_releases_the_gil():
    """Another Python thread runs while a large batch is copied (the connector's copy threads
    and the engine's thread overlap)."""
    src = [_random(8 << 20, 5) for _ in range(8)]
    dst = [np.zeros(8 << 20, dtype=np.uint8) for _ in range(8)]
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=count)
    sys_interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # with the GIL held for the copy, the counter could not run before it ends
    try:
        t.start()
        while not ticks:
            pass
        before = len(ticks)
        ext.copy_pairs(list(zip(dst, src)) * 4)
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(sys_interval)
    assert during > 0
    assert all(np.array_equal(a, b) for a, b in zip(dst, src))


def test_kvtier_bench_copy_reports_both_methods_side_by_side(capsys):
    """``kvtier bench copy --json``: per-method GB/s over the same scattered pages, the per-round
    ratio, and whether the streaming extension is in use; a span too small is one line."""
    import json

    from kvtier.cli import main

    assert main(["bench", "copy", "--json", "--page", "64KiB", "--pages", "8", "--span", "8MiB", "--rounds", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["gbps"]) == {"np.copyto", "kvtier.fastcopy"} and all(v > 0 for v in report["gbps"].values())
    assert report["streaming"] is fastcopy.STREAMING and report["rounds"] == 3
    assert report["ratio"]["min"] <= report["ratio"]["median"] <= report["ratio"]["max"]
    assert main(["bench", "copy", "--pages", "200", "--span", "1MiB"]) == 2
    assert "--span" in capsys.readouterr().err

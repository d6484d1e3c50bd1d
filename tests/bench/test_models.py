"""Telling a CPU that computes bf16 natively from one that does not (/proc/cpuinfo flags)."""

from __future__ import annotations

from kvtier.bench.models import native_bf16


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text("".join(f"processor\t: {i}\nflags\t\t: fpu sse2 avx2 {flags}\n\n" for i in range(2)))
    return str(path)


def test_avx512_bf16_or_amx_is_native(tmp_path):
    assert native_bf16(_cpuinfo(tmp_path, "avx512f avx512_bf16"))
    assert native_bf16(_cpuinfo(tmp_path, "amx_bf16 amx_tile"))


def test_avx2_or_avx512_without_its_bf16_extension_is_not(tmp_path):
    assert not native_bf16(_cpuinfo(tmp_path, "fma"))
    assert not native_bf16(_cpuinfo(tmp_path, "avx512f avx512bw"))


def test_unreadable_cpuinfo_is_not_native(tmp_path):
    assert not native_bf16(str(tmp_path / "missing"))

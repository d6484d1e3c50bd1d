"""Defects found by attacking ``codec: fp8`` (kvtier.fp8, kvtier.codecs, kvtier.entry) and the
``auto`` rule (LinkFit, AutoChoice): each test fails on the code it was written against and says
in its docstring what is wrong."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from kvtier import codecs, entry
from kvtier.store import TieredStore
from kvtier.tiers.fs import FsConfig, FsTier

KEY = hashlib.sha256(b"attack-codecs").digest()


def _normal(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, n).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_finite_values_near_the_top_of_the_dtype_range_never_decode_to_infinity(dtype):
    """Defect: an element within 1/32 of the source dtype's largest finite value rounds up to the
    next power of two in E4M3 (e.g. float16 64000 / 2^8 = 250 -> 256), and 256 x 2^k is past
    the dtype's range: the reader gets +-inf for a finite input (float16: every value in
    [63488, 65504]; bfloat16/float32: above ~3.3e38). The entry's checksum covers the
    dequantized bytes, so nothing flags it; attention over an inf key or value is NaN.
    Expected: the entry is stored raw (``quantize`` returns None) or the value saturates at the
    largest finite value, never a non-finite output."""
    x = _normal(4096)
    big = {"float16": 64000.0, "bfloat16": 3.38e38, "float32": 3.39e38}[dtype]
    x[::64] = big
    x[1::64] = -big
    if dtype == "bfloat16":
        raw = (x.view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = x.astype(dtype)
    with np.errstate(over="ignore"):
        header, body = entry.seal(KEY, memoryview(raw).cast("B"), dtype, codec=codecs.FP8)
        _, got = entry.decode(header + bytes(body))
    values = (np.frombuffer(got, np.uint16).astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" \
        else np.frombuffer(got, dtype).astype(np.float32)
    assert np.isfinite(values).all(), f"{int((~np.isfinite(values)).sum())} finite inputs decoded to inf"


def test_a_store_without_a_lossy_tier_never_serves_an_fp8_entry(tmp_path):
    """Defect: nothing on the read path refuses an fp8 (lossy) entry when the reader is exact.
    ``codecs`` says "an engine configured without it never reads a lossy entry", but that holds
    only through the connector's key namespace: a tier decodes codec id 2 whatever its own
    ``codec`` setting, so two stores sharing a directory through the public store API (same
    keys), or any writer that puts fp8 entries under exact keys, make an exact store hand out
    lossy KV as a hit. Expected: a store whose ``lossy_codec()`` is "" treats an fp8 entry as a
    miss (CorruptEntry), as it would any entry it cannot vouch for."""
    kv = (_normal(64 * 1024).view(np.uint32) >> 16).astype(np.uint16)

    def config(codec: str) -> dict:
        return {"tiers": [{"type": "ram", "capacity": "4MiB"},
                          {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB", "codec": codec}],
                "element_dtype": "bfloat16"}

    with TieredStore.from_config(config("fp8")) as lossy:
        assert lossy.put(KEY, kv) and lossy.flush()
    with TieredStore.from_config(config("none")) as exact:
        assert exact.config.lossy_codec() == ""
        got = exact.get(KEY)
        assert got is None or bytes(got) == kv.tobytes(), "an exact store served lossy fp8 KV as a hit"


def test_the_auto_rule_learns_that_chunks_do_not_compress():
    """Defect: when the codec declines a chunk (``Codec.encode`` returns None: the coded bytes
    are not smaller), ``AutoChoice.encode`` counts it raw but leaves ``ratio`` at its start-up
    sample's value (~1.24 on bf16-like noise). On a slow tier with incompressible KV the rule
    keeps saying "code" forever: every put pays a full encode for nothing, and the metrics show
    ``coding`` 1 and a ratio above 1 with no coded put. Expected: a declined chunk counts as
    ratio 1 in the moving average, so the rule stops coding after a few such chunks."""
    auto = codecs.AutoChoice(codecs.LOSSLESS)
    auto.tier_bps = 1e6  # a slow tier: coding pays at the measured ratio
    assert auto.pays()
    noise = memoryview(os.urandom(1 << 16))
    for _ in range(60):
        assert auto.encode(noise, 2) is None
    state = auto.state()
    assert state["coded_puts"] == 0
    assert not auto.pays(), f"still coding incompressible chunks, ratio {state['ratio']:.3f}"


def test_the_coded_counter_counts_only_entries_that_were_stored(tmp_path):
    """Defect: ``Tier._seal`` adds ``coded`` as soon as the entry is sealed coded, before the
    put: a put that is then dropped (over capacity) or fails (an I/O error, a refused network
    write) still counts as coded, so ``coded`` can exceed ``puts`` (TierStats documents it as
    "entries this tier's codec stored coded"). Expected: counted with ``puts``, on success."""
    kv = (_normal(32 * 1024).view(np.uint32) >> 16).astype(np.uint16)
    with FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=1000, codec="fp8"), name="fs") as tier:
        assert not tier.put(KEY, kv, "bfloat16")
        stats = tier.stats.as_dict()
    assert stats["puts"] == 0 and stats["dropped"] == 1
    assert stats["coded"] == 0, stats


def test_a_jittery_bandwidth_bound_tier_is_coded():
    """Defect: ``LinkFit.estimate`` reads a slope within two standard errors of zero as "no
    bandwidth limit" (infinite bandwidth: never code), without asking whether a fixed cost per
    request was seen. On a purely bandwidth-bound 40 MB/s tier (no latency at all) with 30%
    timing jitter, the raw/probe size mix (7 chunks of 1 MiB to one of 750 kB) is too narrow to
    make the slope significant, and in about a third of seeds the tier, for which coding pays
    by a wide margin, is judged size-independent and stored raw. Expected: a slope that is not
    significant counts as "no bandwidth limit" only when the intercept (the latency) is
    significantly above zero; otherwise the estimate is bytes over seconds, as before the
    sizes are told apart."""
    coded = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        auto = codecs.AutoChoice(codecs.LOSSLESS)
        auto.encode_bps, auto.decode_bps, auto.ratio = 1.5e9, 3e9, 1.4  # fixed codec figures
        for n in ([1 << 20] * 7 + [750_000]) * 10:
            auto.observe_get(n, n / 40e6 * max(0.05, 1 + rng.normal(0, 0.3)))
        coded += auto.pays()
    assert coded >= 18, f"coded on {coded} of 20 seeds"


def test_a_coding_tier_that_becomes_latency_bound_stops_coding():
    """Defect: while a tier codes, only one put in ``PROBE_EVERY_CODING`` (32) is raw, so its
    transfers are 31 coded chunks to one raw one. At a lossless ratio of 1.2 that mix has a size
    spread under ``LinkFit``'s 5% threshold, and the fit falls back to bytes over seconds: the
    fixed cost per request counts as bandwidth again (the very mistake the fit exists to avoid).
    A tier that once coded (a slow link) and is now latency-bound (20 ms a request, 5 GB/s)
    reads as ~45 MB/s and is coded forever. Expected: the same answer as for the raw mix
    (``test_a_latency_bound_tier_is_not_coded_for_its_latency``): no coding."""
    rng = np.random.default_rng(7)
    auto = codecs.AutoChoice(codecs.LOSSLESS)
    auto.encode_bps, auto.decode_bps, auto.ratio = 1.5e9, 3e9, 1.2
    raw = 1 << 20
    for n in ([int(raw / 1.2)] * 31 + [raw]) * 6:  # what a coding tier moves
        auto.observe_get(n, (0.020 + n / 5e9) * (1 + rng.normal(0, 0.05)))
    state = auto.state()
    assert not auto.pays(), f"coding a latency-bound tier read as {state['tier_bps'] / 1e6:.0f} MB/s"

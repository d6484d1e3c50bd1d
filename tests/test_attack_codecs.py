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


# ---------------------------------------------------------------------------------------------
# The read probe and the measured rule of ``auto`` (found by attacking them)


def _key(s: str) -> bytes:
    return hashlib.sha256(s.encode()).digest()


def test_the_read_probe_never_evicts_an_entry_of_a_nearly_full_tier(tmp_path):
    """A tier with room for one more chunk: the probe (two more entries) would have evicted the
    oldest real ones; it is skipped instead, and the tier decides from its transfers."""
    from tests.test_codec import _model_like_chunks

    n = 1 << 18
    chunks = _model_like_chunks(11, n)
    capacity = 11 * n + 8192
    with FsTier(FsConfig(path=str(tmp_path), capacity=capacity, codec="none", usage_refresh_s=0), name="fs") as plain:
        for i in range(10):
            assert plain.put(_key(f"c{i}"), chunks[i], "bfloat16")
    with FsTier(FsConfig(path=str(tmp_path), capacity=capacity, codec="auto", usage_refresh_s=0), name="fs") as tier:
        assert tier.put(_key("c10"), chunks[10], "bfloat16")
        assert set(tier.keys()) == {_key(f"c{i}") for i in range(11)}
        assert tier._auto._probed and tier.codec_state()["read_bps"] is None  # skipped, not run


def test_a_small_first_chunk_leaves_the_probe_to_a_larger_one(tmp_path):
    """A 1,000-byte first put cannot tell sizes 16 x apart (and read a 4 KiB probe entry into
    its own buffer: a counted error): the probe waits for a chunk of PROBE_MIN_BYTES."""
    from tests.test_codec import _model_like_chunks

    with FsTier(FsConfig(path=str(tmp_path), capacity=1 << 26, codec="auto", usage_refresh_s=0), name="fs") as tier:
        assert tier.put(_key("small"), np.arange(500, dtype=np.uint16), "bfloat16")
        assert not tier._auto._probed and tier.stats.as_dict().get("errors", 0) == 0
        assert tier.put(_key("large"), _model_like_chunks(1, codecs.PROBE_MIN_BYTES)[0], "bfloat16")
        state = tier.codec_state()
        # the probe ran and seeded the read fit with its four reads (two sizes); what the fit says
        # of a page-cache tier may be "no bandwidth limit" (read_bps None): 64 KiB and 4 KiB read
        # within each other's timing noise
        assert tier._auto._probed and tier._auto._reads._n >= 4
        assert state["read_bps"] is not None or state["size_independent"]
        assert tier.stats.as_dict().get("errors", 0) == 0
        assert state["raw_puts"] + state["coded_puts"] == 2  # the probe's own puts are not chunks
        assert set(tier.keys()) == {_key("small"), _key("large")}


def test_writers_at_the_first_put_run_one_probe_and_store_raw_meanwhile(tmp_path):
    import threading
    import time

    from tests.test_codec import _model_like_chunks

    probes = []
    with FsTier(FsConfig(path=str(tmp_path), capacity=1 << 28, codec="auto", usage_refresh_s=0), name="fs") as tier:
        tier.codec
        real = tier._auto.link_probe

        def slow_probe(n: int):
            probes.append(n)
            deadline = time.monotonic() + 30
            while tier._auto.raw < 7 and time.monotonic() < deadline:  # the other writers, stored raw meanwhile
                time.sleep(0.005)
            return real(n)

        tier._auto.link_probe = slow_probe
        chunks = _model_like_chunks(8, 1 << 18)
        start = threading.Barrier(8)

        def write(i: int) -> None:
            start.wait()
            assert tier.put(_key(f"w{i}"), chunks[i], "bfloat16")

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(probes) == 1
        out = np.empty(chunks[0].size, np.uint16)
        for i, c in enumerate(chunks):
            assert tier.get_into(_key(f"w{i}"), out) == c.nbytes and np.array_equal(out, c)
        state = tier.codec_state()
        assert state["raw_puts"] + state["coded_puts"] == 8
        assert sorted(tier.keys()) == sorted(_key(f"w{i}") for i in range(8))


def test_a_probe_interrupted_by_a_base_exception_does_not_leave_the_tier_raw():
    """Ctrl-C (or SystemExit) inside the probe: the probe is over, and later chunks are decided."""
    from tests.test_codec import _model_like_chunks

    auto = codecs.AutoChoice(codecs.LOSSLESS)

    def probe(n: int):
        raise KeyboardInterrupt

    auto.link_probe = probe
    chunk = memoryview(_model_like_chunks(1, codecs.PROBE_MIN_BYTES)[0]).cast("B")
    with pytest.raises(KeyboardInterrupt):
        auto.encode(chunk, 2)
    assert not auto._probing
    auto.tier_bps = 1e6  # a slow link: coding pays by the rule
    assert sum(auto.encode(chunk, 2) is not None for _ in range(20)) > 10


def test_one_slow_first_coded_read_does_not_keep_the_tier_raw():
    """Coded re-reads cost 0.7 x raw ones, but the first was 50 x slow (a cold cache, a
    descheduled reader): each side is a median, so the tier codes at once, not after thousands
    of raw puts (a moving average seeded by that read kept it raw for 8,135)."""
    from tests.test_codec import _model_like_chunks, _reads

    auto = codecs.AutoChoice(codecs.LOSSLESS)
    n = 1 << 16
    chunk = memoryview(_model_like_chunks(1, n)[0]).cast("B")
    _reads(auto, "raw", codecs.MEASURED_MIN, n, 1 / 80e6)
    _reads(auto, "coded", 1, n, 50 / 80e6)
    _reads(auto, "coded", codecs.MEASURED_MIN - 1, n, 0.7 / 80e6)
    assert auto.pays()
    puts = 0
    while not auto.coding and puts < 500:
        coded = auto.encode(chunk, 2) is not None
        puts += 1
        _reads(auto, "coded" if coded else "raw", 1, n, (0.7 if coded else 1.0) / 80e6)
    assert auto.coding and puts <= 2, puts


def test_the_read_probe_never_evicts_an_entry_of_a_nearly_full_redis_tier(redis_server, key_prefix):
    from kvtier.tiers.redis import RedisConfig, RedisTier
    from tests.test_codec import _model_like_chunks

    n = 1 << 18
    chunks = _model_like_chunks(11, n)
    url = f"redis://127.0.0.1:{redis_server.port}/0"

    def tier(codec: str) -> RedisTier:
        return RedisTier(RedisConfig(url=url, prefix=key_prefix, capacity=11 * n + 100, codec=codec,
                                     timeout_s=10.0), name="redis")

    with tier("none") as plain:
        for i in range(10):
            assert plain.put(_key(f"c{i}"), chunks[i], "bfloat16")
    with tier("auto") as auto:
        assert auto.put(_key("c10"), chunks[10], "bfloat16")
        assert set(auto.keys()) == {_key(f"c{i}") for i in range(11)}
        assert auto.stats.as_dict().get("evictions", 0) == 0
        for i in range(11):
            auto.delete(_key(f"c{i}"))

"""Per-tier ``codec: fp8`` (lossy, opt-in): E4M3 codes equal to torch's own ``float8_e4m3fn``
cast, a bfloat16 decode exactly the float32 product rounded, stored bytes at most 0.55 x raw for 16-bit KV, the error within E4M3's bound, the entry's
checksum over the dequantized bytes, the codec in the key namespace (an engine without it never
reads a lossy entry), exact storage where fp8 cannot apply, and every forged fp8 payload a
counted miss. The connector's keys: tests/integration/test_namespace.py."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest

from kvtier import codecs, entry, fp8
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import Namespace
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.fs import FsConfig, FsTier

torch = pytest.importorskip("torch")

KEY = hashlib.sha256(b"fp8").digest()


def _bf16(n: int = 64 * 1024, seed: int = 3, scale: float = 0.5) -> np.ndarray:
    """bf16 KV (uint16 bit patterns) of normal values with a few larger outliers per row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, scale, n).astype(np.float32)
    x[:: 97] *= 40.0  # outliers, as real K has
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _as_float(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _fs(tmp_path, codec: str = "fp8") -> FsTier:
    return FsTier(FsConfig(path=str(tmp_path / "fs"), capacity=1 << 26, codec=codec), name="fs")


def _file(tmp_path) -> str:
    return os.path.join(str(tmp_path / "fs"), f"{KEY[0]:02x}", KEY.hex())


def test_codes_equal_torch_float8_e4m3fn_bit_for_bit():
    rng = np.random.default_rng(0)
    edge = [0.0, -0.0, 448.0, -448.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 0.0625 * 1.0625,
            240.0, 232.0, 0.001953125 * 1.5, 17.0, 19.0, 21.0]  # subnormals, ties, the largest value
    y = np.concatenate([rng.normal(0, 60, 200_000), rng.uniform(-448, 448, 100_000),
                        rng.normal(0, 0.004, 100_000), edge]).astype(np.float32)
    ours = fp8._round_to_e4m3(y)
    theirs = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, theirs)
    finite = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(fp8.TABLE[:0x7F], finite)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_round_trip_through_a_real_fs_tier_is_within_e4m3s_bound(tmp_path, dtype):
    x = _as_float(_bf16(64 * 1024 + 77))  # not a multiple of the group: the last group is short
    kv = {"bfloat16": (x.view(np.uint32) >> 16).astype(np.uint16), "float16": x.astype(np.float16),
          "float32": x}[dtype]
    with _fs(tmp_path) as tier:
        assert tier.put(KEY, kv, dtype)
        assert tier.size_of(KEY) == kv.nbytes
        out = np.zeros_like(kv)
        assert tier.get_into(KEY, out) == kv.nbytes
    header = entry.decode_header(open(_file(tmp_path), "rb").read())
    assert header.codec == codecs.FP8_ID and header.dtype == dtype
    itemsize = kv.itemsize
    assert header.stored <= (0.55 if itemsize == 2 else 0.30) * kv.nbytes
    got = _as_float(out) if dtype == "bfloat16" else out.astype(np.float32)
    ref = _as_float(kv) if dtype == "bfloat16" else kv.astype(np.float32)
    blocks = np.pad(ref, (0, -ref.size % fp8.GROUP)).reshape(-1, fp8.GROUP)
    amax = np.repeat(np.abs(blocks).max(axis=1), fp8.GROUP)[: ref.size]
    # half an E4M3 step (2^-4 relative); below the group's smallest normal (2^k x 2^-6, with
    # 2^k < amax / 224), half the subnormal step 2^k x 2^-9; and the output dtype's own rounding
    bound = np.maximum(np.abs(ref) * 2.0 ** -4, amax / 224 * 2.0 ** -10) * (1 + 2.0 ** -6) + np.abs(ref) * 2.0 ** -8
    assert (np.abs(got - ref) <= bound).all()
    assert np.abs(got - ref).mean() < 0.03 * np.abs(ref).mean()  # E4M3 rounds by ~2% of a value on average


def test_the_checksum_covers_what_a_reader_gets_and_one_flipped_code_is_a_miss(tmp_path):
    kv = _bf16()
    with _fs(tmp_path) as tier:
        assert tier.put(KEY, kv, "bfloat16")
        first = tier.get(KEY)
        assert first is not None and bytes(first) != kv.tobytes()  # lossy
        assert tier.get(KEY) == first  # deterministic
        blob = bytearray(open(_file(tmp_path), "rb").read())
        blob[-5] ^= 0x01  # one E4M3 code
        with open(_file(tmp_path), "wb") as f:
            f.write(blob)
        assert tier.get(KEY) is None and tier.stats.as_dict()["corrupt"] == 1


def test_what_fp8_cannot_code_is_stored_exactly(tmp_path):
    cases = {
        "opaque bytes": (np.random.default_rng(1).integers(0, 256, 64 * 1024, dtype=np.uint8), "uint8"),
        "a non-finite value": (np.where(np.arange(32 * 1024) == 5, np.uint16(0x7F80), _bf16(32 * 1024)), "bfloat16"),
        "under 4 KiB": (_bf16(1024), "bfloat16"),
        "already fp8": (np.random.default_rng(2).integers(0, 0x7E, 64 * 1024, dtype=np.uint8), "float8_e4m3fn"),
    }
    for i, (name, (kv, dtype)) in enumerate(cases.items()):
        with FsTier(FsConfig(path=str(tmp_path / f"fs{i}"), capacity=1 << 26, codec="fp8"), name="fs") as tier:
            assert tier.put(KEY, kv, dtype), name
            assert bytes(tier.get(KEY)) == kv.tobytes(), name
        blob = open(os.path.join(str(tmp_path / f"fs{i}"), f"{KEY[0]:02x}", KEY.hex()), "rb").read()
        assert entry.decode_header(blob).codec == 0, name


def _payload() -> tuple[bytes, int]:
    kv = _bf16(8192)
    payload, _ = fp8.quantize(memoryview(kv).cast("B"), "bfloat16")
    return payload, kv.nbytes


def test_the_exponent_shift_decode_equals_the_rounded_float32_product():
    """bfloat16 is decoded by adding each group's exponent to a table's bits: the same bits as
    E4M3 value x 2^k in float32 rounded to bfloat16, over groups spread across 60 binades."""
    rng = np.random.default_rng(4)
    x = (rng.normal(0, 1, 1 << 16) * np.repeat(2.0 ** rng.integers(-30, 30, (1 << 16) // 32), 32)).astype(np.float32)
    kv = (x.view(np.uint32) >> 16).astype(np.uint16)
    payload, dequantized = fp8.quantize(memoryview(kv).cast("B"), "bfloat16")
    groups = kv.size // fp8.GROUP
    k = np.frombuffer(payload, np.uint8, groups, 8).astype(np.int32) - 127
    codes = np.frombuffer(payload, np.uint8, kv.size, 8 + groups).reshape(groups, fp8.GROUP)
    product = (fp8.TABLE[codes] * np.ldexp(np.float32(1.0), k).astype(np.float32)[:, None]).reshape(-1)
    assert np.array_equal(np.frombuffer(dequantized, np.uint16), (product.view(np.uint32) >> 16).astype(np.uint16))
    assert (product.view(np.uint32) & 0xFFFF == 0).all()  # exact: nothing was rounded away


@pytest.mark.parametrize("kind", ["version", "count", "dtype", "truncated", "scale byte", "group"])
def test_a_forged_fp8_payload_never_decodes(kind):
    payload, raw = _payload()
    head = struct.Struct("<BBHI")
    version, code, group, count = head.unpack_from(payload)
    body = bytearray(payload)
    if kind == "version":
        head.pack_into(body, 0, 9, code, group, count)
    elif kind == "count":
        head.pack_into(body, 0, version, code, group, count * 4)  # a "bomb": more elements than the entry
    elif kind == "dtype":
        head.pack_into(body, 0, version, 11, group, count)  # float32 source: twice the bytes
    elif kind == "truncated":
        body = body[:-1]
    elif kind == "scale byte":
        body[head.size] = 255  # not an exponent (E8M0's NaN)
    elif kind == "group":
        head.pack_into(body, 0, version, code, 0, count)
    out = bytearray(raw + 64)
    with pytest.raises(CorruptEntry):
        codecs.decode_into(codecs.FP8_ID, memoryview(bytes(body)), memoryview(out)[:raw], 2, "bfloat16")
    assert not any(out[raw:])  # never written past the entry's raw length


def test_a_forged_fp8_entry_in_a_tier_is_a_counted_miss(tmp_path):
    kv = _bf16()
    with _fs(tmp_path) as tier:
        assert tier.put(KEY, kv, "bfloat16")
        blob = bytearray(open(_file(tmp_path), "rb").read())
        header = entry.decode_header(bytes(blob))
        struct.pack_into("<I", blob, header.header_bytes + 4, 7)  # the payload's element count
        with open(_file(tmp_path), "wb") as f:
            f.write(blob)
        assert tier.get_into(KEY, bytearray(kv.nbytes)) is None
        assert tier.stats.as_dict()["corrupt"] == 1 and tier.stats.as_dict()["hits"] == 0


def test_a_store_reads_lossy_entries_from_its_fp8_tier_and_exact_ones_from_ram(tmp_path):
    kv = _bf16()
    config = {"tiers": [{"type": "ram", "capacity": "4MiB"},
                        {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "64MiB", "codec": "fp8"}],
              "element_dtype": "bfloat16"}
    with TieredStore.from_config(config) as store:
        assert store.config.lossy_codec() == "fp8"
        assert store.put(KEY, kv) and store.flush()
        assert bytes(store.get(KEY)) == kv.tobytes()  # from RAM: exact
        lossy = store.tiers[-1].get(KEY)
        assert lossy is not None and bytes(lossy) != kv.tobytes()
    with TieredStore.from_config(config) as store:  # a restart: RAM is empty, fs holds fp8
        assert bytes(store.get(KEY)) == bytes(lossy)


def test_the_codec_is_part_of_the_key_namespace():
    plain = Namespace(model="m", kv_dtype="bfloat16")
    assert plain.digest() != Namespace(model="m", kv_dtype="bfloat16", kv_codec="fp8").digest()
    fields = {k: v for k, v in plain.__dict__.items() if k not in ("kv_groups", "kv_codec")}
    expected = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).digest()
    assert plain.digest() == expected  # no codec: the digest engines had before the field
    assert StoreConfig().lossy_codec() == ""
    lossless = StoreConfig(tiers=[{"type": "ram", "capacity": "1MiB"},
                                  {"type": "fs", "path": "/nonexistent-kvtier", "capacity": "1MiB", "codec": "lossless"}])
    assert lossless.lossy_codec() == ""  # lossless entries are the same KV: shared with every engine


def test_kvtier_serve_refuses_an_fp8_tier_in_one_line(tmp_path):
    from kvtier.server.server import ServeConfig

    with pytest.raises(ConfigError, match="lossy") as exc:
        ServeConfig.from_mapping({"listen": f"unix://{tmp_path}/s.sock", "store": {"tiers": [
            {"type": "ram", "capacity": "1MiB"},
            {"type": "fs", "path": str(tmp_path / "fs"), "capacity": "1MiB", "codec": "fp8"}]}})
    assert "\n" not in str(exc.value) and "none, lossless, auto" in str(exc.value)


def test_the_connector_refuses_a_wrong_element_dtype_with_fp8_and_says_when_fp8_does_nothing():
    """fp8 reads the elements as numbers: an ``element_dtype`` other than the engine's KV dtype
    would quantize misread bits (and the checksum would bless them), so the connector refuses it
    in one line; where the engine's KV is not bf16/fp16/float32 (e.g. fp8 KV) fp8 stores it raw,
    which the connector says in one warning line."""
    from kvtier.integrations.vllm.config import ConnectorConfig

    tiers = [{"type": "ram", "capacity": "1MiB"},
             {"type": "fs", "path": "/nonexistent-kvtier", "capacity": "1MiB", "codec": "fp8"}]
    given = ConnectorConfig.from_extra_config({"tiers": tiers, "element_dtype": "float16"})
    with pytest.raises(ConfigError, match="element_dtype") as exc:
        given.with_kv_dtype("auto", "torch.bfloat16")
    assert "\n" not in str(exc.value) and "'bfloat16'" in str(exc.value)
    assert given.with_kv_dtype("auto", "torch.float16").store.element_dtype == "float16"  # the same: kept
    plain = ConnectorConfig.from_extra_config({"tiers": tiers})
    assert plain.with_kv_dtype("auto", "torch.bfloat16").lossy_codec_warning() is None
    warning = plain.with_kv_dtype("fp8_e4m3", "torch.bfloat16").lossy_codec_warning()
    assert warning and "raw" in warning and "float8_e4m3fn" in warning and "\n" not in warning
    lossless = ConnectorConfig.from_extra_config({"tiers": [tiers[0], {**tiers[1], "codec": "none"}],
                                                  "element_dtype": "float16"})
    assert lossless.with_kv_dtype("auto", "torch.bfloat16").store.element_dtype == "float16"  # no lossy codec


def test_the_bf16_path_gives_the_float32_paths_bytes_bit_for_bit(monkeypatch):
    """``quantize`` of bfloat16 KV works on the 16-bit patterns (no float32 copy); on every kind of
    group (tiny, huge, mixed with zeros and values far under the group's scale, random finite
    patterns, bf16's largest) it must give exactly what the float32 path gives, and leave
    subnormal and non-finite inputs to it."""
    rng = np.random.default_rng(1)

    def bf16(x) -> np.ndarray:
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)

    cases = [bf16(rng.normal(0, scale, 1 << 14)) for scale in (1e-30, 1e-6, 0.004, 1.0, 60.0, 448.0, 1e4, 1e30)]
    mixed = rng.normal(0, 1, 1 << 14).astype(np.float32)
    mixed[::32], mixed[1::32], mixed[2::32], mixed[3::32] = 1e6, 1e-20, 0.0, -0.0  # tiny elements under huge scales
    patterns = rng.integers(0, 1 << 16, 1 << 14).astype(np.uint16)
    mag = patterns & 0x7FFF
    patterns[(mag >= 0x7F80) | ((mag > 0) & (mag < 0x80))] = 0  # finite, no subnormals
    subnormal, infinite = patterns.copy(), patterns.copy()
    subnormal[5], infinite[7] = 0x0001, 0x7F80
    cases += [bf16(mixed), patterns, subnormal, infinite, np.full(1024, 0x7F7F, np.uint16)]
    fast = [fp8.quantize(memoryview(c).cast("B"), "bfloat16") for c in cases]
    monkeypatch.setattr(fp8, "_quantize_bf16", lambda raw, group: NotImplemented)
    exact = [fp8.quantize(memoryview(c).cast("B"), "bfloat16") for c in cases]
    assert fast == exact
    assert exact[-2] is None and exact[0] is not None  # a non-finite chunk is stored raw

"""Tenants who share a tier (issue 24): a trust domain's ``auth_key`` keys the chunk keys and
tags every entry. A writer without the key who plants a checksum-valid entry under a victim's
key (in a shared directory, in a real redis-server) is a counted miss for the victim, never a
load; a tampered byte is a miss; the secret is never in a repr, a log or an error message."""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np
import pytest

from kvtier import entry
from kvtier.config import build
from kvtier.errors import ConfigError, CorruptEntry
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import StoreConfig, TieredStore
from kvtier.tiers.fs import FsConfig, FsTier

SECRET = b"tenant-a-secret-0123456789abcdef"
KEY = hashlib.sha256(b"victim chunk").digest()
KV = np.random.default_rng(7).integers(0, 2**16, 8192, dtype=np.uint16)  # 16 KiB of "bf16" KV
FORGED = np.full(8192, 0x3F80, dtype=np.uint16)  # the attacker's KV: all 1.0


def _secret_file(tmp_path, secret: bytes = SECRET) -> str:
    path = tmp_path / "auth.key"
    path.write_bytes(secret + b"\n")
    os.chmod(path, 0o600)
    return str(path)


def _store(tmp_path, shared: str, auth_file: str | None) -> TieredStore:
    config = {"tiers": [{"type": "ram", "capacity": "1MiB"}, {"type": "fs", "path": shared, "capacity": "64MiB"}],
              "write_through": True}
    if auth_file:
        config["auth_key_file"] = auth_file
    return TieredStore.from_config(config)


def _fs(path: str, auth: entry.EntryAuth | None) -> FsTier:
    tier = FsTier(FsConfig(path=path, capacity=1 << 26), name="fs")
    tier.set_auth(auth)
    return tier


# --- the chunk keys --------------------------------------------------------------------------

def test_keys_differ_with_the_secret_and_between_secrets():
    ns, tokens = Namespace(model="m"), list(range(512))
    plain = chunk_keys(tokens, ns, 256)
    keyed = chunk_keys(tokens, ns, 256, auth_key=SECRET)
    other = chunk_keys(tokens, ns, 256, auth_key=b"tenant-b-secret-0123456789abcdef")
    assert len(plain) == len(keyed) == 2
    assert not set(plain) & set(keyed) and not set(keyed) & set(other)
    assert keyed == chunk_keys(tokens, ns, 256, auth_key=SECRET)  # deterministic: the domain shares
    assert plain == chunk_keys(tokens, ns, 256)  # no secret: the keys are what they always were


# --- entries planted by a writer without the key ---------------------------------------------

def _plant_unkeyed(tier_path: str, key: bytes) -> None:
    """What a hostile tenant without the secret can write: a checksum-valid (v2, untagged) entry."""
    with _fs(tier_path, None) as attacker:
        assert attacker.put(key, FORGED, "bfloat16")


def test_a_planted_entry_in_a_shared_dir_is_a_counted_miss_never_a_load(tmp_path):
    shared = str(tmp_path / "shared")
    auth = entry.EntryAuth(SECRET)
    _plant_unkeyed(shared, KEY)
    with _fs(shared, auth) as victim:
        out = np.zeros_like(KV)
        assert victim.get_into(KEY, out) is None
        assert not out.any() or not np.array_equal(out, FORGED)  # never reported as a hit
        stats = victim.stats.as_dict()
        assert stats["corrupt"] == 1 and stats["misses"] == 1 and stats["hits"] == 0
        assert victim.put(KEY, KV, "bfloat16") and victim.get_into(KEY, out) == KV.nbytes
        assert np.array_equal(out, KV)


def test_an_entry_tagged_under_another_secret_is_a_miss(tmp_path):
    shared = str(tmp_path / "shared")
    with _fs(shared, entry.EntryAuth(b"tenant-b-secret-0123456789abcdef")) as other:
        assert other.put(KEY, FORGED, "bfloat16")
    with _fs(shared, entry.EntryAuth(SECRET)) as victim:
        assert victim.get(KEY) is None
        assert victim.stats.as_dict()["corrupt"] == 1


def test_a_tagged_entry_read_without_a_key_is_a_miss(tmp_path):
    shared = str(tmp_path / "shared")
    with _fs(shared, entry.EntryAuth(SECRET)) as keyed:
        assert keyed.put(KEY, KV, "bfloat16")
    with _fs(shared, None) as plain:
        assert plain.get(KEY) is None and plain.size_of(KEY) is None
        assert plain.stats.as_dict()["corrupt"] >= 1


def test_a_v1_entry_is_read_without_a_key_and_missed_with_one(tmp_path):
    shared = str(tmp_path / "shared")
    raw = KV.tobytes()
    v1 = entry._FIXED_V1.pack(entry.MAGIC, 1, entry.DTYPES["uint8"][0], 1, 0, KEY, len(raw), entry.checksum(raw))
    import struct
    import zlib

    dims = struct.pack("<Q", len(raw))
    blob = v1 + struct.pack("<II", zlib.crc32(v1 + dims), 0) + dims + raw
    assert bytes(entry.decode(blob, KEY)[1]) == raw
    with pytest.raises(CorruptEntry, match="unauthenticated"):
        entry.decode(blob, KEY, auth=entry.EntryAuth(SECRET))


@pytest.mark.parametrize("where", ["header", "payload", "tag"])
def test_one_tampered_byte_is_a_counted_miss(tmp_path, where):
    shared = str(tmp_path / "shared")
    auth = entry.EntryAuth(SECRET)
    with _fs(shared, auth) as tier:
        assert tier.put(KEY, KV, "bfloat16")
        path = os.path.join(shared, f"{KEY[0]:02x}", KEY.hex())
        blob = bytearray(open(path, "rb").read())
        header = entry.decode_header(blob, auth=auth)
        # header: the checksum field (the CRC is made valid again: only the tag can catch it)
        offset = {"header": 4 + 2 + 1 + 1 + 4 + 32 + 8, "payload": len(blob) - 1,
                  "tag": header.header_bytes - 1}[where]
        blob[offset] ^= 0x01
        if where == "header":
            import struct
            import zlib

            size = entry._FIXED.size
            dims = bytes(blob[entry.FIXED_BYTES : entry.FIXED_BYTES + 8 * len(header.shape)])
            struct.pack_into("<I", blob, size, zlib.crc32(bytes(blob[:size]) + dims))
        with open(path, "wb") as f:
            f.write(blob)
        assert tier.get(KEY) is None
        assert tier.stats.as_dict()["corrupt"] == 1


def test_a_planted_entry_in_a_real_redis_is_a_counted_miss(redis_url, key_prefix):
    from kvtier.tiers.redis import RedisConfig, RedisTier

    config = RedisConfig(url=redis_url, prefix=key_prefix, capacity=1 << 26)
    with RedisTier(config, name="attacker") as attacker:
        assert attacker.put(KEY, FORGED, "bfloat16")  # checksum-valid, untagged
    with RedisTier(config, name="victim") as victim:
        victim.set_auth(entry.EntryAuth(SECRET))
        assert victim.size_of(KEY) is None  # the forged header is refused before any read
    with RedisTier(config, name="attacker") as attacker:
        assert attacker.put(KEY, FORGED, "bfloat16")
    with RedisTier(config, name="victim") as victim:
        victim.set_auth(entry.EntryAuth(SECRET))
        out = np.zeros_like(KV)
        assert victim.get_into(KEY, out) is None and not out.any()
        assert victim.stats.as_dict()["corrupt"] == 1 and victim.stats.as_dict()["hits"] == 0
        assert victim.put(KEY, KV, "bfloat16") and victim.get_into(KEY, out) == KV.nbytes
        assert np.array_equal(out, KV)


# --- through the store's configuration -------------------------------------------------------

def test_the_store_tags_with_the_configured_key_and_misses_foreign_entries(tmp_path):
    shared = str(tmp_path / "shared")
    secret_file = _secret_file(tmp_path)
    keys = chunk_keys(list(range(256)), Namespace(model="m"), 256, auth_key=SECRET)
    with _store(tmp_path, shared, secret_file) as store:
        assert store.put(keys[0], KV)
        store.flush() if hasattr(store, "flush") else None
    with _fs(shared, None) as plain:  # the domain's entries carry a tag: untagged readers miss
        assert plain.get(keys[0]) is None
    _plant_unkeyed(shared, keys[0])
    with _store(tmp_path, shared, secret_file) as store:
        assert store.get(keys[0]) is None  # the RAM tier is empty; the fs entry is foreign
        fs_stats = store.tiers[-1].stats.as_dict()
        assert fs_stats["corrupt"] >= 1 and fs_stats["hits"] == 0


def test_the_secret_is_never_in_a_repr_a_log_or_an_error(tmp_path, caplog, monkeypatch):
    secret_file = _secret_file(tmp_path)
    config = build(StoreConfig, {"auth_key_file": secret_file}, "store")
    auth = config.entry_auth()
    assert SECRET.decode() not in repr(config) + repr(auth) + str(auth)
    monkeypatch.setenv("KVTIER_TEST_AUTH", SECRET.decode())
    env_config = build(StoreConfig, {"auth_key_env": "KVTIER_TEST_AUTH"}, "store")
    assert env_config.auth_secret() == SECRET and SECRET.decode() not in repr(env_config)
    messages = []
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny-secret")
    os.chmod(short, 0o600)
    world = tmp_path / "world.key"
    world.write_bytes(SECRET)
    os.chmod(world, 0o644)
    monkeypatch.setenv("KVTIER_SHORT", "tiny-secret")
    for bad in ({"auth_key_file": str(short)}, {"auth_key_file": str(world)}, {"auth_key_env": "KVTIER_SHORT"},
                {"auth_key_env": "KVTIER_UNSET_VAR"}, {"auth_key_file": str(tmp_path / "none")},
                {"auth_key_file": secret_file, "auth_key_env": "KVTIER_TEST_AUTH"},
                {"auth_key_file": 12345}):
        with pytest.raises(ConfigError) as exc:
            build(StoreConfig, bad, "store").entry_auth()
        messages.append(str(exc.value))
        assert "\n" not in str(exc.value)
    with caplog.at_level(logging.DEBUG):
        shared = str(tmp_path / "shared")
        _plant_unkeyed(shared, KEY)
        with _fs(shared, auth) as tier:
            tier.get(KEY)
    text = "\n".join(messages) + caplog.text
    assert SECRET.decode() not in text and "tiny-secret" not in text
    assert "other users can read" in messages[1] and "shorter than" in messages[0]
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(auth)


def test_without_blake3_entries_are_tagged_with_hmac_sha256_and_both_are_read(tmp_path, monkeypatch):
    shared = str(tmp_path / "shared")
    other_key = hashlib.sha256(b"hmac entry").digest()
    with _fs(shared, entry.EntryAuth(SECRET)) as tier:
        assert tier.put(KEY, KV, "bfloat16")  # blake3 where installed
    monkeypatch.setattr(entry, "_BLAKE3", False)  # as on a node without the blake3 package
    hmac_auth = entry.EntryAuth(SECRET)
    assert hmac_auth.algo == entry.TAG_HMAC_SHA256
    with _fs(shared, hmac_auth) as tier:
        assert tier.put(other_key, KV, "bfloat16")
        assert np.array_equal(np.frombuffer(tier.get(other_key), np.uint16), KV)
    monkeypatch.undo()
    with _fs(shared, entry.EntryAuth(SECRET)) as tier:
        assert np.array_equal(np.frombuffer(tier.get(other_key), np.uint16), KV)
        assert np.array_equal(np.frombuffer(tier.get(KEY), np.uint16), KV)


def test_a_disk_tier_keeps_tagged_entries_across_a_restart_and_checks_them_on_read(tmp_path):
    from kvtier.tiers.disk import DiskConfig, DiskTier

    config = DiskConfig(path=str(tmp_path / "disk"), capacity=1 << 24, drop_cache=False)
    with DiskTier(config, name="disk") as tier:
        tier.set_auth(entry.EntryAuth(SECRET))
        assert tier.put(KEY, KV, "bfloat16")
    with DiskTier(config, name="disk") as tier:  # the index is rebuilt before the key is set
        tier.set_auth(entry.EntryAuth(SECRET))
        assert np.array_equal(np.frombuffer(tier.get(KEY), np.uint16), KV)
    with DiskTier(config, name="disk") as tier:  # without the key: a counted miss
        assert tier.get(KEY) is None and tier.stats.as_dict()["corrupt"] == 1


def test_a_valid_entry_moved_under_another_key_is_a_miss(tmp_path):
    """Replay: a tenant copies one of the victim's own tagged entries to the name of another of
    the victim's keys. The tag covers the header, which names the key: a miss."""
    shared = str(tmp_path / "shared")
    other_key = hashlib.sha256(b"victim chunk 2").digest()
    with _fs(shared, entry.EntryAuth(SECRET)) as victim:
        assert victim.put(KEY, FORGED, "bfloat16")
        src = os.path.join(shared, f"{KEY[0]:02x}", KEY.hex())
        dst_dir = os.path.join(shared, f"{other_key[0]:02x}")
        os.makedirs(dst_dir, mode=0o700, exist_ok=True)
        with open(src, "rb") as f, open(os.path.join(dst_dir, other_key.hex()), "wb") as g:
            g.write(f.read())
        os.chmod(os.path.join(dst_dir, other_key.hex()), 0o600)
        assert victim.get(other_key) is None
        assert victim.stats.as_dict()["corrupt"] == 1


def test_a_planted_object_in_a_real_s3_store_is_a_counted_miss(s3_server, s3_bucket):
    from kvtier.tiers.s3 import S3Config, S3Tier

    config = S3Config(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url, access_key=s3_server.access_key,
                      secret_key=s3_server.secret_key, capacity=1 << 26, codec="lossless")
    with S3Tier(config, name="attacker") as attacker:
        assert attacker.put(KEY, FORGED, "bfloat16")
    with S3Tier(config, name="victim") as victim:
        victim.set_auth(entry.EntryAuth(SECRET))
        out = np.zeros_like(KV)
        assert victim.get_into(KEY, out) is None and not out.any()
        assert victim.stats.as_dict()["corrupt"] == 1
        assert victim.put(KEY, KV, "bfloat16") and victim.get_into(KEY, out) == KV.nbytes
        assert np.array_equal(out, KV)


def test_kvtier_bench_auth_json_reports_hash_and_tier_rates():
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "auth", "--size", "256KiB", "--count", "4",
                           "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    names = [h["what"] for h in report["hashes"]]
    assert any(n.startswith("entry tag") for n in names) and "xxh3-64 (entry checksum)" in names
    assert all(h["gbps"] > 0 for h in report["hashes"])
    assert [t["hits"] for t in report["tiers"]] == [4, 4]  # every read with the key was a hit

"""``kvtier bench auth``: what entry authentication (``auth_key``) costs, on one core.

Hash throughput in GB/s over ``--size`` buffers, one thread, beside the checksum every entry
already pays (xxh3-64) and a memcpy: the entry tag as ``kvtier.entry.EntryAuth`` computes it
(keyed BLAKE3 where the ``blake3`` package is installed, else HMAC-SHA256), keyed BLAKE2b-256,
HMAC-SHA256, and keyed BLAKE3. Then a real
``fs`` tier in a temp directory: put and get GB/s of the same entries with and without an auth
key, so the tag's share of a tier's time is measured, not inferred.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import tempfile

import numpy as np
import xxhash

from kvtier.bench.timing import best_seconds
from kvtier.config import parse_size
from kvtier.output import emit_json, print_table

SECRET = b"bench-auth-secret-not-a-real-key!"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="4MiB", help="bytes per hashed buffer / entry (4MiB)")
    parser.add_argument("--count", type=int, default=16, help="entries per tier pass (16)")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes; the best is kept (5)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _hashes() -> dict:
    from kvtier.entry import EntryAuth

    auth = EntryAuth(SECRET)
    out = {
        "memcpy": None,
        "xxh3-64 (entry checksum)": lambda b: xxhash.xxh3_64_intdigest(b),
        f"entry tag (EntryAuth, algorithm {auth.algo})": lambda b: auth.tag(b),
        "keyed blake2b-256": lambda b: hashlib.blake2b(b, key=SECRET[:32], digest_size=32).digest(),
        "hmac-sha256": lambda b: hmac.new(SECRET, b, hashlib.sha256).digest(),
    }
    try:
        import blake3

        key = hashlib.sha256(SECRET).digest()
        out["keyed blake3 (1 thread)"] = lambda b: blake3.blake3(b, key=key).digest()
    except ImportError:
        pass
    return out


def hash_rates(size: int, repeat: int) -> list[dict]:
    """GB/s of each hash over one ``size``-byte buffer, one thread."""
    buf = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty_like(buf)
    rows = []
    for name, fn in _hashes().items():
        run = (lambda: np.copyto(dst, buf)) if fn is None else (lambda: fn(buf))
        rows.append({"what": name, "gbps": round(size / best_seconds(run, repeat) / 1e9, 3)})
    return rows


def tier_rates(size: int, count: int, repeat: int) -> list[dict]:
    """put/get GB/s of a real fs tier with and without an auth key (the same entries)."""
    from kvtier.entry import EntryAuth
    from kvtier.tiers.fs import FsConfig, FsTier

    data = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]
    keys = [hashlib.sha256(b"bench-auth-%d" % i).digest() for i in range(count)]
    out = np.empty(size, dtype=np.uint8)
    rows = []
    for label, auth in (("fs tier", None), ("fs tier + auth_key", EntryAuth(SECRET))):
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-auth-") as tmp:
            tier = FsTier(FsConfig(path=tmp, capacity=4 * size * count), name="fs")
            tier.set_auth(auth)
            try:
                t_put = best_seconds(lambda: [tier.put(k, d) for k, d in zip(keys, data)], repeat)
                t_get = best_seconds(lambda: [tier.get_into(k, out) for k in keys], repeat)
                hits = tier.stats.as_dict()["hits"]
            finally:
                tier.close()
        total = size * count
        rows.append({"what": label, "put_gbps": round(total / t_put / 1e9, 3),
                     "get_gbps": round(total / t_get / 1e9, 3), "hits": hits})
    return rows


def run(args: argparse.Namespace) -> int:
    size = int(parse_size(args.size, "--size"))
    hashes = hash_rates(size, args.repeat)
    tiers = tier_rates(size, args.count, args.repeat)
    report = {"bytes": size, "threads": 1, "hashes": hashes, "tiers": tiers}
    if args.json:
        emit_json(report)
        return 0
    print_table(["what", "GB/s (one core)"], [[r["what"], r["gbps"]] for r in hashes],
                title=f"hash throughput over {size} bytes")
    print_table(["tier", "put GB/s", "get GB/s"], [[r["what"], r["put_gbps"], r["get_gbps"]] for r in tiers],
                title=f"{args.count} entries of {size} bytes (page cache warm)")
    return 0

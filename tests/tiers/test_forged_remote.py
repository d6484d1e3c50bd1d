"""Forged entries and non-digest keys in the shared network tiers (real redis-server, SeaweedFS).

Anyone who can write the shared Redis or bucket can store a header with a valid CRC and a
length of 2**50. A reader must treat it as a corrupt entry (counted, removed, a miss): no
allocation sized from it, nothing raised into the engine.
"""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidKey
from kvtier.policies.lru import LRUPolicy
from kvtier.store import TieredStore
from kvtier.tiers.ram import RamConfig, RamTier
from tests.tiers.forge import forged_header

K = bytes(range(32))
FORGED = forged_header(K, 2**50) + b"x" * 64


def _store_over(tier) -> TieredStore:
    top = RamTier(RamConfig(capacity=1 << 20, page_size=4096, pin_memory=False))
    return TieredStore([(top, LRUPolicy()), (tier, None)])


@pytest.mark.redis
def test_forged_length_in_redis_is_a_counted_corrupt_miss(redis_url, key_prefix):
    redis = pytest.importorskip("redis")
    from kvtier.tiers.redis import RedisTier

    tier = RedisTier(RedisTier.Config(url=redis_url, prefix=key_prefix), name="redis")
    raw = redis.Redis.from_url(redis_url)
    try:
        name = key_prefix.encode() + K
        raw.set(name, FORGED)
        assert tier.size_of(K) is None and tier.stats.corrupt == 1 and not raw.exists(name)
        with pytest.raises(InvalidKey):
            tier.put(b"abc", b"data")
        with pytest.raises(InvalidKey):
            tier.contains(b"")
        raw.set(name, FORGED)
        with _store_over(tier) as store:  # closes the tier at the end
            assert store.get(K) is None and store.get_into(K, bytearray(4096)) is None
        assert not raw.exists(name)
    finally:
        raw.close()
        tier.close()


@pytest.mark.s3
def test_forged_length_in_s3_is_a_counted_corrupt_miss(s3_server, s3_bucket):
    from kvtier.tiers.s3 import S3Tier

    config = S3Tier.Config(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url,
                           access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    tier = S3Tier(config, name="s3")
    client = s3_server.client()
    name = config.prefix + K.hex()

    def present() -> bool:
        return client.list_objects_v2(Bucket=s3_bucket, Prefix=name).get("KeyCount", 0) > 0

    try:
        client.put_object(Bucket=s3_bucket, Key=name, Body=FORGED)
        assert tier.size_of(K) is None and tier.stats.corrupt == 1 and not present()
        with pytest.raises(InvalidKey):
            tier.put(b"abc", b"data")
        with pytest.raises(InvalidKey):
            tier.size_of(b"")
        client.put_object(Bucket=s3_bucket, Key=name, Body=FORGED)
        with _store_over(tier) as store:  # closes the tier at the end
            assert store.get(K) is None
        assert not present()
    finally:
        tier.close()


@pytest.mark.s3
def test_an_s3_object_larger_than_any_entry_is_not_downloaded(s3_server, s3_bucket):
    """A planted, well-formed entry past the tier's capacity is a corrupt miss, removed without
    reading it (before the fix it was downloaded whole and served)."""
    from kvtier import entry
    from kvtier.tiers.s3 import S3Tier

    config = S3Tier.Config(bucket=s3_bucket, endpoint_url=s3_server.endpoint_url, capacity=64 * 1024,
                           access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    tier = S3Tier(config, name="s3")
    client = s3_server.client()
    body = 256 * 1024
    try:
        client.put_object(Bucket=s3_bucket, Key=config.prefix + K.hex(), Body=entry.encode(K, b"x" * body))
        assert tier.get(K) is None and tier.get_into(K, bytearray(body)) is None
        assert tier.stats.corrupt == 1 and tier.stats.bytes_read == 0
        assert client.list_objects_v2(Bucket=s3_bucket, Prefix=config.prefix).get("KeyCount", 0) == 0
    finally:
        tier.close()

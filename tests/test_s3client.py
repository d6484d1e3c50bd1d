"""kvtier.s3client: one S3 config type and one client builder for the s3 tier and the loader."""

from __future__ import annotations

import pytest

from kvtier import s3client
from kvtier.errors import ConfigError
from kvtier.loader.sources.s3 import S3Config as SourceConfig
from kvtier.tiers.registry import parse_tier_spec
from kvtier.tiers.s3 import S3Config as TierConfig

# every key the s3 tier accepted before the shared config type, with a non-default value
TIER_KEYS = {
    "bucket": "b", "endpoint_url": "http://127.0.0.1:9", "prefix": "p/", "region": "eu-west-1",
    "access_key": "AK", "secret_key": "hunter2", "addressing": "path", "capacity": "1GiB",
    "low_watermark": 0.8, "connect_timeout_s": 1.0, "read_timeout_s": 2.0, "max_attempts": 2,
    "max_workers": 4, "lookup_timeout_s": 0.3, "timeout_s": 3.0, "lookup_workers": 8,
    "lookup_cache_entries": 100, "lookup_cache_ttl_s": 1.0, "list_interval_s": 2.0,
    "list_timeout_s": 30.0, "backoff_ms": 100, "max_backoff_ms": 200,
}


def test_tier_and_source_configs_are_the_one_config_type():
    assert issubclass(TierConfig, s3client.S3Config) and issubclass(SourceConfig, s3client.S3Config)


def test_every_tier_key_still_parses_and_the_secret_stays_out_of_repr():
    spec = parse_tier_spec({"type": "s3", **TIER_KEYS})
    config = spec.config
    assert isinstance(config, TierConfig)
    assert config.lookup_timeout_s == 0.3 and config.region == "eu-west-1" and config.capacity == 1024**3
    assert "hunter2" not in repr(config)
    with pytest.raises(ConfigError, match="valid keys"):
        parse_tier_spec({"type": "s3", "bucket": "b", "max_pool_connections": 3})


def test_defaults_kept():
    assert TierConfig(bucket="b").region == "us-east-1" and TierConfig(bucket="b").addressing == "auto"
    assert SourceConfig().addressing == "path" and SourceConfig().region is None


@pytest.mark.parametrize("endpoint, local", [("http://127.0.0.1:8333", True), ("http://localhost:1", True),
                                             ("https://s3.amazonaws.com", False), (None, False)])
def test_is_local(endpoint, local):
    assert s3client.is_local(endpoint) is local


def test_client_addressing_and_credentials():
    pytest.importorskip("boto3")
    config = s3client.S3Config(endpoint_url="http://127.0.0.1:9", access_key="AK", secret_key="SK")
    client = s3client.make_client(config, connect_timeout_s=1, read_timeout_s=2, max_attempts=1,
                                  max_pool_connections=4)
    assert client.meta.config.s3["addressing_style"] == "path"
    assert client.meta.endpoint_url == "http://127.0.0.1:9"
    assert client.meta.region_name == "us-east-1"
    assert client._request_signer._credentials.access_key == "AK"

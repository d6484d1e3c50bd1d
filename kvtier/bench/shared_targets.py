"""``kvtier bench tiers`` targets for the shared tiers (redis, s3, fs) and the redis-py baseline.

Servers are started once per benchmark run through ``kvtier.harness.services`` and shared by every
target and size of that run, so a tier and its baseline hit the same server in the same run.
``--redis-url`` / ``AWS_ENDPOINT_URL`` are not needed: a local ``redis-server`` and ``weed mini``
are started on free loopback ports. A missing binary raises ``ServiceUnavailable`` (a
``KVTierError``), which the runner reports as a skipped target.

The services live on ``args._kvtier_services`` (an ``ExitStack``) that ``close_services(args)``
closes at the end of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid

MiB = 1024 * 1024


def _services(args: argparse.Namespace) -> contextlib.ExitStack:
    stack = getattr(args, "_kvtier_services", None)
    if stack is None:
        stack = contextlib.ExitStack()
        args._kvtier_services = stack
        args._kvtier_started = {}
    return stack


def _service(args: argparse.Namespace, kind: str):
    """The run's redis or S3 service, started on first use."""
    from kvtier.harness import services

    stack = _services(args)
    started = args._kvtier_started
    if kind not in started:
        factory = services.redis_server if kind == "redis" else services.seaweedfs
        started[kind] = stack.enter_context(factory())
    return started[kind]


def close_services(args: argparse.Namespace) -> None:
    """Stop every server this run started (safe to call when none was)."""
    stack = getattr(args, "_kvtier_services", None)
    if stack is not None:
        stack.close()


class RedisPyLoop:
    """Baseline: a plain redis-py + hiredis GET/SET loop (no header, no checksum), same server.

    ``get_into`` copies the value into the caller's buffer, as every tier must.
    """

    def __init__(self, url: str, entry_bytes: int):
        import redis

        self._r = redis.Redis.from_url(url)
        self._prefix = f"loop-{uuid.uuid4().hex[:8]}:".encode()

    def put(self, key: bytes, data) -> bool:
        return bool(self._r.set(self._prefix + key, memoryview(data).cast("B")))

    def get_into(self, key: bytes, out) -> int | None:
        value = self._r.get(self._prefix + key)
        if value is None:
            return None
        memoryview(out).cast("B")[: len(value)] = value
        return len(value)

    def delete(self, key: bytes) -> bool:
        return bool(self._r.delete(self._prefix + key))

    def close(self) -> None:
        self._r.close()


def redis_loop(args, workdir: str, entry_bytes: int, count: int):
    return RedisPyLoop(_service(args, "redis").url, entry_bytes)


def redis_tier(args, workdir: str, entry_bytes: int, count: int):
    from kvtier.tiers.redis import RedisTier

    config = RedisTier.Config(url=_service(args, "redis").url, prefix=f"bench-{uuid.uuid4().hex[:8]}:",
                              capacity=count * entry_bytes + 64 * MiB)
    return RedisTier(config, name="redis")


def s3_tier(args, workdir: str, entry_bytes: int, count: int):
    from kvtier.tiers.s3 import S3Tier

    s3 = _service(args, "s3")
    config = S3Tier.Config(bucket=s3.bucket, endpoint_url=s3.endpoint_url, access_key=s3.access_key,
                           secret_key=s3.secret_key, prefix=f"bench-{uuid.uuid4().hex[:8]}/",
                           capacity=count * entry_bytes + 64 * MiB)
    return S3Tier(config, name="s3")


def fs_tier(args, workdir: str, entry_bytes: int, count: int):
    from kvtier.tiers.fs import FsTier

    path = os.path.join(workdir, f"fs-{uuid.uuid4().hex[:8]}")
    return FsTier(FsTier.Config(path=path, capacity=count * entry_bytes * 2 + 64 * MiB), name="fs")

"""The one way kvtier reaches an S3-compatible store: ``S3Config`` says where and as whom,
``make_client`` builds the boto3 client. The ``s3`` tier and the loader's ``s3`` source both
extend ``S3Config`` with their own options and build their clients here.

Endpoint: ``endpoint_url``, else ``AWS_ENDPOINT_URL``, else AWS. Region: ``region``, else
``AWS_REGION``, else ``us-east-1``. Credentials: ``access_key``/``secret_key``, else boto3's chain
(environment, profile, instance role); the secret stays out of ``repr`` and logs. Addressing:
``auto`` is path-style for an endpoint on an IP address or ``localhost`` (no virtual-host DNS
there) and botocore's own choice elsewhere.

Every client comes from its own boto3 session (boto3's default session is process-global state).
boto3 is imported when a client is built (the ``kvtier[s3]`` extra).

Imports: the standard library only (boto3 lazily): the ground floor.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Where an S3-compatible store is and who is asking; the tier and the loader add to it."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    addressing: Literal["auto", "path", "virtual"] = "auto"


def endpoint_of(config: S3Config) -> str | None:
    """The endpoint a client of ``config`` talks to (None: AWS's own)."""
    return config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None


def is_local(endpoint: str | None) -> bool:
    """True for endpoints on an IP address or localhost (no virtual-host DNS there)."""
    if not endpoint:
        return False
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def make_client(config: S3Config, *, connect_timeout_s: float, read_timeout_s: float,
                max_attempts: int, max_pool_connections: int, skip_checksums: bool = False) -> Any:
    """A thread-safe botocore S3 client for ``config``.

    Each attempt is bounded by ``connect_timeout_s``/``read_timeout_s``; botocore makes at most
    ``max_attempts`` attempts (``standard`` retry mode; 1: the caller retries itself).
    ``skip_checksums``: no extra CRC pass over bodies (for payloads that carry their own checksum).
    """
    import boto3
    from botocore.config import Config

    endpoint = endpoint_of(config)
    style = config.addressing
    if style == "auto":
        style = "path" if is_local(endpoint) else "auto"
    checksums: dict[str, str] = {}
    if skip_checksums:
        checksums = {"request_checksum_calculation": "when_required",
                     "response_checksum_validation": "when_required"}
    botocfg = Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        s3={"addressing_style": style},
        **checksums,
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=config.region or os.environ.get("AWS_REGION") or "us-east-1",
        config=botocfg, aws_access_key_id=config.access_key, aws_secret_access_key=config.secret_key,
    )


__all__ = ["S3Config", "endpoint_of", "is_local", "make_client"]

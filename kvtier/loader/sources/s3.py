"""S3-compatible object storage: ranged GETs through boto3, read straight into the caller's buffers.

Where and as whom (endpoint, region, credentials, addressing) as in ``kvtier.s3client``, which
builds the client (the ``s3`` tier builds its clients there too). Transient failures (5xx,
throttling, timeouts, a connection dropped mid-body) are retried with exponential backoff.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Literal, Sequence

from kvtier import s3client
from kvtier.errors import LoaderError
from kvtier.loader.sources.base import Source, short_read


@dataclass(frozen=True, kw_only=True)
class S3Config(s3client.S3Config):
    """``kvtier.s3client.S3Config`` plus the source's own options. ``max_pool_connections``
    should be >= the reader's concurrency. Each attempt is bounded by ``connect_timeout_s`` /
    ``read_timeout_s``; a transient failure is retried ``retries`` times after ``backoff_s``,
    doubling (jittered)."""

    addressing: Literal["auto", "path", "virtual"] = "path"
    max_pool_connections: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    retries: int = 5
    backoff_s: float = 0.1


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``; LoaderError on anything else."""
    if not uri.startswith("s3://"):
        raise LoaderError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise LoaderError(f"{uri}: no bucket in the URI")
    return bucket, key


def make_client(config: S3Config):
    """A thread-safe boto3 client (botocore's own retries off: ours cover the body too)."""
    return s3client.make_client(config, connect_timeout_s=config.connect_timeout_s,
                                read_timeout_s=config.read_timeout_s, max_attempts=1,
                                max_pool_connections=config.max_pool_connections)


def _transient(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return status >= 500 or status == 429 or code in ("SlowDown", "RequestTimeout", "Throttling")
    return isinstance(exc, (BotoConnectionError, HTTPClientError, OSError, _ShortBody))


class _ShortBody(Exception):
    pass


class S3Source(Source):
    """One object ``s3://bucket/key``; ``read_into`` is one ranged GET per call, retried."""

    default_concurrency = 16

    def __init__(self, uri: str, config: S3Config | None = None, client=None):
        super().__init__(uri)
        self.config = config or S3Config()
        self.bucket, self.key = split_uri(uri)
        self._client = client or make_client(self.config)
        self._size: int | None = None
        self._lock = threading.Lock()

    def size(self) -> int:
        if self._size is None:
            head = self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=self.key))
            self._size = int(head["ContentLength"])
        return self._size

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        if wanted == 0:
            return
        self._call(lambda: self._get_range(offset, views, wanted))

    def _get_range(self, offset: int, views: list[memoryview], wanted: int) -> None:
        resp = self._client.get_object(Bucket=self.bucket, Key=self.key,
                                       Range=f"bytes={offset}-{offset + wanted - 1}")
        body = resp["Body"]
        raw = getattr(body, "_raw_stream", None)
        if not resp.get("ContentEncoding"):
            # http.client's response under urllib3's: readinto lands socket bytes in our buffer
            # with no intermediate copy. Identity encoding only; otherwise the public read().
            raw = getattr(raw, "_fp", raw)
        got = 0
        try:
            for v in views:
                filled = 0
                while filled < len(v):
                    if raw is not None and hasattr(raw, "readinto"):
                        n = raw.readinto(v[filled:])
                    else:
                        chunk = body.read(len(v) - filled)
                        n = len(chunk)
                        v[filled:filled + n] = chunk
                    if not n:
                        raise _ShortBody(f"{got} of {wanted} bytes")
                    filled += n
                    got += n
        finally:
            body.close()

    def _call(self, fn):
        """Run ``fn`` with retries and jittered exponential backoff on transient failures."""
        from botocore.exceptions import ClientError

        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:  # classified below: transient -> retry, else one-line error
                attempt += 1
                if not _transient(exc) or attempt > self.config.retries:
                    if isinstance(exc, ClientError):
                        code = exc.response.get("Error", {}).get("Code", "?")
                        raise LoaderError(f"{self.uri}: S3 error {code}") from None
                    if isinstance(exc, _ShortBody):
                        raise LoaderError(f"{self.uri}: short read ({exc})") from None
                    raise LoaderError(f"{self.uri}: {type(exc).__name__}: {str(exc)[:200]}") from None
                delay = self.config.backoff_s * (2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random()))  # backoff between retries

    @classmethod
    def list_dir(cls, uri: str, config: S3Config | None = None, client=None) -> list[tuple[str, int]]:
        bucket, prefix = split_uri(uri)
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        client = client or make_client(config or S3Config())
        out: list[tuple[str, int]] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if name:
                        out.append((name, int(obj["Size"])))
        except Exception as exc:  # any failure to list is a one-line user-facing error
            raise LoaderError(f"{uri}: cannot list ({type(exc).__name__}: {str(exc)[:200]})") from None
        return sorted(out)

    def close(self) -> None:
        """The client is shared per source and pooled; nothing to release explicitly."""


__all__ = ["S3Config", "S3Source", "split_uri", "make_client", "short_read"]

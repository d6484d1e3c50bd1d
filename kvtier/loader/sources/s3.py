"""S3-compatible object storage: ranged GETs through boto3, read straight into the caller's buffers.

Where and as whom (endpoint, region, credentials, addressing) as in ``kvtier.s3client``, which
builds the client (the ``s3`` tier builds its clients there too). Transient failures (5xx,
throttling, timeouts, a connection dropped mid-body) are retried with exponential backoff.

Every read is of one version of the object: the first ``size()`` (a HEAD) pins its ETag (and
version id, when the bucket is versioned), every ranged GET sends ``If-Match`` and must come
back with that ETag, else ``VersionChanged``. Every ranged GET must be answered ``206`` with a
``Content-Range`` that is exactly the range asked for (a server or proxy that ignores ``Range``
and answers 200 with the whole object is refused, never taken as the range). An object larger
than ``max_object_size`` is refused at the HEAD, before any allocation.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Literal, Sequence

from kvtier import s3client
from kvtier.config import Size, format_bytes, parse_size
from kvtier.errors import ConfigError, LoaderError
from kvtier.loader.sources.base import Source, VersionChanged, short_read

#: Default largest object a source reads or a pull copies (``max_object_size``).
DEFAULT_MAX_OBJECT_SIZE = 1024 ** 4
#: Most objects one listing may return (a model directory holds tens to a few thousand).
MAX_LISTED = 100_000
#: Longest ETag / version id kept (they are journaled; S3's are ~34 characters).
MAX_VERSION_CHARS = 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass(frozen=True, kw_only=True)
class S3Config(s3client.S3Config):
    """``kvtier.s3client.S3Config`` plus the source's own options. ``max_pool_connections``
    should be >= the reader's concurrency. Each attempt is bounded by ``connect_timeout_s`` /
    ``read_timeout_s``; a transient failure is retried ``retries`` times after ``backoff_s``,
    doubling (jittered). ``max_object_size``: larger objects are refused at the HEAD.
    ``get_timeout_s``: the most one ranged GET's body may take however slowly its bytes come
    (``read_timeout_s`` bounds each socket read only); then its connection is closed and the
    GET retried like a timeout. A listing page must arrive within it too, else the listing is
    refused."""

    addressing: Literal["auto", "path", "virtual"] = "path"
    max_pool_connections: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    retries: int = 5
    backoff_s: float = 0.1
    max_object_size: Size = Size(DEFAULT_MAX_OBJECT_SIZE)
    get_timeout_s: float = 300.0

    def __post_init__(self):
        if not isinstance(self.max_object_size, int):
            object.__setattr__(self, "max_object_size", parse_size(self.max_object_size, "max_object_size"))
        if self.max_object_size < 1:
            raise ConfigError(f"max_object_size must be at least 1 byte, got {self.max_object_size}")
        if not (isinstance(self.get_timeout_s, (int, float)) and self.get_timeout_s > 0):
            raise ConfigError(f"get_timeout_s must be a number of seconds > 0, got {str(self.get_timeout_s)[:40]}")


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


def _status(resp) -> int:
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _bounded(value, what: str, uri: str) -> str | None:
    """``value`` as a version string (None when absent); LoaderError when absurdly long."""
    if value is None or value == "":
        return None
    value = str(value)
    if len(value) > MAX_VERSION_CHARS:
        raise LoaderError(f"{uri}: the server's {what} is {len(value):,} characters long "
                          f"(more than {MAX_VERSION_CHARS}); refusing it")
    return value


def _next_page(pages, seconds: float, uri: str):
    """The next page of a listing (None at its end), waited for at most ``seconds``: botocore
    reads a page whole with a timeout per socket read only, so a page that drips would hold the
    pull forever. LoaderError past the deadline (the reading thread is a daemon, left behind)."""
    box: list = []

    def fetch() -> None:
        try:
            box.append((True, next(pages, None)))
        except BaseException as exc:  # handed to the waiting thread
            box.append((False, exc))

    reader = threading.Thread(target=fetch, name="kvtier-s3-list", daemon=True)
    reader.start()
    reader.join(seconds)
    if not box:
        raise LoaderError(f"{uri}: a listing page did not arrive within {seconds:g} s (get_timeout_s); "
                          "refusing the listing")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _hang_up(body, late: threading.Event) -> None:
    """A GET's deadline passed: shut its socket down so the read blocked on it returns now."""
    late.set()
    sock = getattr(getattr(getattr(body, "_raw_stream", None), "connection", None), "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
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
        self._etag: str | None = None
        self._version_id: str | None = None
        self._lock = threading.Lock()

    def size(self) -> int:
        """The object's size from one HEAD, which also pins its ETag/version id (see ``version``).

        LoaderError when the size is not a byte count or exceeds ``config.max_object_size``."""
        with self._lock:
            if self._size is None:
                head = self._call(lambda: self._client.head_object(Bucket=self.bucket, Key=self.key))
                try:
                    size = int(head["ContentLength"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise LoaderError(f"{self.uri}: HEAD gave no usable Content-Length") from exc
                limit = self.config.max_object_size
                if size < 0 or size > limit:
                    raise LoaderError(f"{self.uri}: object of {size:,} bytes exceeds the maximum object size "
                                      f"{limit:,} bytes ({format_bytes(limit)}; max_object_size, "
                                      "--max-object-size)")
                self._etag = _bounded(head.get("ETag"), "ETag", self.uri)
                version_id = _bounded(head.get("VersionId"), "version id", self.uri)
                self._version_id = None if version_id == "null" else version_id
                self._size = size
            return self._size

    def version(self) -> str | None:
        """The ETag pinned by the first HEAD (the version id when there is no ETag; None when the
        HEAD gave neither, and then the first GET's ETag pins the reads that follow)."""
        self.size()
        return self._etag or self._version_id

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        wanted = sum(len(v) for v in views)
        if wanted == 0:
            return
        total = self.size()  # pins the version before the first byte is read
        if offset < 0 or offset + wanted > total:
            raise short_read(self.uri, offset, wanted, max(0, total - offset))
        self._call(lambda: self._get_range(offset, views, wanted, total))

    def _pin(self) -> dict:
        """The GET arguments that hold a read to the pinned version."""
        pin = {}
        if self._etag:
            pin["IfMatch"] = self._etag
        if self._version_id:
            pin["VersionId"] = self._version_id
        return pin

    def _check_answer(self, resp, first: int, last: int, total: int) -> None:
        """Refuse an answer that is not exactly bytes ``first``-``last`` of the pinned version."""
        asked = f"bytes {first}-{last}/{total}"
        status = _status(resp)
        if status != 206:
            raise LoaderError(f"{self.uri}: a ranged GET of bytes {first}-{last} was answered {status}, not 206 "
                              "Partial Content (the server or a proxy ignores Range); refusing the answer")
        got = str(resp.get("ContentRange") or "")
        m = _CONTENT_RANGE.fullmatch(got.strip())
        if m is None or (int(m[1]), int(m[2]), int(m[3])) != (first, last, total):
            raise LoaderError(f"{self.uri}: Content-Range {got[:80]!r} does not match the range asked for "
                              f"({asked!r}); refusing the answer")
        length = resp.get("ContentLength")
        if length is not None and int(length) != last - first + 1:
            raise LoaderError(f"{self.uri}: {length} body bytes announced for the {last - first + 1}-byte range "
                              f"{first}-{last}; refusing the answer")
        etag = _bounded(resp.get("ETag"), "ETag", self.uri)
        if etag and not self._etag:
            with self._lock:  # no ETag at the HEAD: the first answer's pins the rest
                self._etag = self._etag or etag
        if self._etag and etag and etag != self._etag:
            raise VersionChanged(f"{self.uri}: the object changed while it was read (ETag {self._etag[:80]} "
                                 f"pinned, {str(etag)[:80]} served)")

    def _get_range(self, offset: int, views: list[memoryview], wanted: int, total: int) -> None:
        last = offset + wanted - 1
        resp = self._client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-{last}",
                                       **self._pin())
        body = resp["Body"]
        try:
            self._check_answer(resp, offset, last, total)
        except BaseException:
            body.close()
            raise
        raw = getattr(body, "_raw_stream", None)
        if not resp.get("ContentEncoding"):
            # http.client's response under urllib3's: readinto lands socket bytes in our buffer
            # with no intermediate copy. Identity encoding only; otherwise the public read().
            raw = getattr(raw, "_fp", raw)
        got = 0
        late = threading.Event()
        watchdog = threading.Timer(self.config.get_timeout_s, _hang_up, (body, late))
        watchdog.daemon = True
        watchdog.start()
        try:
            for v in views:
                filled = 0
                while filled < len(v):
                    try:
                        if raw is not None and hasattr(raw, "readinto"):
                            n = raw.readinto(v[filled:])
                        else:
                            chunk = body.read(len(v) - filled)
                            n = len(chunk)
                            v[filled:filled + n] = chunk
                    except Exception:
                        if late.is_set():
                            n = 0
                        else:
                            raise
                    if not n or late.is_set():
                        why = (f" in {self.config.get_timeout_s:g} s, the most one ranged GET may take "
                               "(get_timeout_s)") if late.is_set() else ""
                        raise _ShortBody(f"{got} of {wanted} bytes{why}")
                    filled += n
                    got += n
        finally:
            watchdog.cancel()
            body.close()

    def _call(self, fn):
        """Run ``fn`` with retries and jittered exponential backoff on transient failures."""
        from botocore.exceptions import ClientError

        attempt = 0
        while True:
            try:
                return fn()
            except LoaderError:  # our own verdict on an answer (wrong range, changed object): final
                raise
            except Exception as exc:  # classified below: transient -> retry, else one-line error
                if isinstance(exc, ClientError) and (_status(exc.response) == 412 or exc.response.get(
                        "Error", {}).get("Code") == "PreconditionFailed"):
                    raise VersionChanged(f"{self.uri}: the object changed while it was read (If-Match "
                                         f"{(self._etag or '?')[:80]} failed: 412)") from exc
                attempt += 1
                if not _transient(exc) or attempt > self.config.retries:
                    if isinstance(exc, ClientError):
                        code = exc.response.get("Error", {}).get("Code", "?")
                        raise LoaderError(f"{self.uri}: S3 error {code}") from exc
                    if isinstance(exc, _ShortBody):
                        raise LoaderError(f"{self.uri}: short read ({exc})") from exc
                    raise LoaderError(f"{self.uri}: {type(exc).__name__}: {str(exc)[:200]}") from exc
                delay = self.config.backoff_s * (2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random()))  # backoff between retries

    @classmethod
    def list_dir(cls, uri: str, config: S3Config | None = None, client=None) -> list[tuple[str, int]]:
        bucket, prefix = split_uri(uri)
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        config = config or S3Config()
        client = client or make_client(config)
        out: list[tuple[str, int]] = []
        pages = 0
        try:
            it = iter(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"))
            while (page := _next_page(it, config.get_timeout_s, uri)) is not None:
                pages += 1
                if pages > MAX_LISTED // 100:
                    raise LoaderError(f"{uri}: the listing runs past {MAX_LISTED // 100:,} pages; refusing it")
                for obj in page.get("Contents", []):
                    key = str(obj["Key"])
                    if not key.startswith(prefix):
                        raise LoaderError(f"{uri}: the listing names {key[:200]!r}, which is not under the prefix "
                                          f"{prefix!r}; refusing the listing")
                    name = key[len(prefix):]
                    if name:
                        out.append((name, int(obj["Size"])))
                    if len(out) > MAX_LISTED:
                        raise LoaderError(f"{uri}: the listing holds more than {MAX_LISTED:,} objects; "
                                          "refusing it (a model directory holds far fewer)")
        except LoaderError:
            raise
        except Exception as exc:  # any failure to list is a one-line user-facing error
            raise LoaderError(f"{uri}: cannot list ({type(exc).__name__}: {str(exc)[:200]})") from exc
        return sorted(out)

    def close(self) -> None:
        """The client is shared per source and pooled; nothing to release explicitly."""


__all__ = ["DEFAULT_MAX_OBJECT_SIZE", "S3Config", "S3Source", "VersionChanged", "split_uri", "make_client",
           "short_read"]

"""A hostile S3 endpoint of the tests' own: a threaded HTTP server that speaks just enough S3 for
kvtier's boto3 client (path-style ListObjectsV2, HEAD, ranged GET with If-Match) and misbehaves
on request: keys that climb out of a directory, sizes no disk holds, 200 answers to ranged GETs,
Content-Range headers that lie, objects replaced in the middle of a pull.

Used as a fake only to inject faults; the code under test is kvtier's real client and CLI.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape


@dataclass
class Obj:
    """One stored object: its bytes, the size HEAD and the listing report, its ETag."""

    data: bytes
    size: int
    etag: str


def etag_of(data: bytes) -> str:
    """The quoted ETag S3 gives a single-part object (the MD5 of its bytes)."""
    return '"' + hashlib.md5(data).hexdigest() + '"'


class HostileS3:
    """One bucket on 127.0.0.1:<free port>. Faults are attributes the test sets:

    - ``listing``: ``[(key, size)]`` returned by ListObjectsV2 instead of the stored objects;
    - ``fallback``: the object served for any key that is not stored (a path-normalising proxy);
    - ``ignore_range_after``: GETs after this many are answered 200 with the whole object;
    - ``content_range``: ``fn(start, end, total) -> header`` to lie in Content-Range;
    - ``honor_if_match``: False serves whatever is stored now, whatever If-Match says;
    - ``on_get``: ``fn(server, key, n)`` called before the n-th GET (1-based) is answered;
    - ``fail_gets_after``: GETs after this many are answered 403 (a pull killed half-way);
    - ``send_etag``: False sends no ETag header at all (nothing to pin a version by);
    - ``drip_s``: object GET bodies are sent one byte every ``drip_s`` seconds (a slowloris
      endpoint: each byte comes well within any read timeout, the whole never does);
    - ``drip_listing_s``: the same for listing bodies.
    """

    def __init__(self, bucket: str = "b"):
        self.bucket = bucket
        self.objects: dict[str, Obj] = {}
        self.listing: list[tuple[str, int]] | None = None
        self.fallback: Obj | None = None
        self.ignore_range_after: int | None = None
        self.content_range: Callable[[int, int, int], str] | None = None
        self.honor_if_match = True
        self.on_get: Callable[["HostileS3", str, int], None] | None = None
        self.fail_gets_after: int | None = None
        self.send_etag = True
        self.drip_s: float | None = None
        self.drip_listing_s: float | None = None
        self.gets: list[tuple[str, str | None, str | None, int]] = []  # key, Range, If-Match, status
        self.lock = threading.Lock()
        self._httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)  # quick shutdown
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def put(self, key: str, data: bytes, size: int | None = None) -> Obj:
        """Store ``data`` under ``key`` (``size``: what HEAD and the listing claim; default its length)."""
        with self.lock:
            obj = self.objects[key] = Obj(data, len(data) if size is None else size, etag_of(data))
        return obj

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-body (it refused the answer) is expected here: no traceback."""

    def handle_error(self, request, client_address) -> None:
        pass


def _handler(s3: HostileS3):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _split(self) -> tuple[str, str, dict]:
            parts = urlsplit(self.path)
            bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
            return bucket, key, parse_qs(parts.query, keep_blank_values=True)

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
                  drip: float | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and body and drip is not None:
                for i in range(len(body)):
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    time.sleep(drip)
            elif self.command != "HEAD" and body:
                self.wfile.write(body)

        def _error(self, status: int, code: str) -> None:
            body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{code}</Message></Error>"
            self._send(status, body.encode(), {"Content-Type": "application/xml"})

        def _object(self, key: str) -> Obj | None:
            with s3.lock:
                return s3.objects.get(key, s3.fallback)

        def do_GET(self) -> None:
            bucket, key, query = self._split()
            if bucket != s3.bucket:
                return self._error(404, "NoSuchBucket")
            if not key:
                return self._list(query)
            with s3.lock:
                n = sum(1 for g in s3.gets if g[0] == key) + 1
            if s3.on_get is not None:
                s3.on_get(s3, key, n)
            rng, if_match = self.headers.get("Range"), self.headers.get("If-Match")
            status = self._get(key, rng, if_match, len(s3.gets) + 1)
            with s3.lock:
                s3.gets.append((key, rng, if_match, status))

        def _get(self, key: str, rng: str | None, if_match: str | None, count: int) -> int:
            obj = self._object(key)
            if obj is None:
                self._error(404, "NoSuchKey")
                return 404
            if s3.fail_gets_after is not None and count > s3.fail_gets_after:
                self._error(403, "AccessDenied")
                return 403
            if s3.honor_if_match and if_match is not None and if_match.strip() not in (obj.etag, "*"):
                self._error(412, "PreconditionFailed")
                return 412
            headers = {"ETag": obj.etag} if s3.send_etag else {}
            headers |= {"Last-Modified": formatdate(usegmt=True), "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            whole = s3.ignore_range_after is not None and count > s3.ignore_range_after
            if rng is None or whole:
                self._send(200, obj.data, headers, s3.drip_s)
                return 200
            start_s, _, end_s = rng.removeprefix("bytes=").partition("-")
            start, end = int(start_s), min(int(end_s), obj.size - 1)
            if start >= obj.size:
                self._error(416, "InvalidRange")
                return 416
            headers["Content-Range"] = (s3.content_range or _true_range)(start, end, obj.size)
            self._send(206, obj.data[start:end + 1], headers, s3.drip_s)
            return 206

        def do_HEAD(self) -> None:
            bucket, key, _ = self._split()
            obj = self._object(key) if bucket == s3.bucket else None
            if obj is None:
                return self._send(404)
            self.send_response(200)
            self.send_header("Content-Length", str(obj.size))
            if s3.send_etag:
                self.send_header("ETag", obj.etag)
            self.send_header("Last-Modified", formatdate(usegmt=True))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def _list(self, query: dict) -> None:
            prefix = query.get("prefix", [""])[0]
            url = query.get("encoding-type", [""])[0] == "url"
            with s3.lock:
                entries = s3.listing if s3.listing is not None else [
                    (k, o.size) for k, o in sorted(s3.objects.items()) if k.startswith(prefix)]
            enc = (lambda k: quote(k, safe="/")) if url else escape
            contents = "".join(
                f"<Contents><Key>{enc(k)}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                f"<ETag>&quot;0&quot;</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
                for k, size in entries)
            body = ("<?xml version='1.0' encoding='UTF-8'?>"
                    "<ListBucketResult xmlns='http://s3.amazonaws.com/doc/2006-03-01/'>"
                    f"<Name>{s3.bucket}</Name><Prefix>{enc(prefix)}</Prefix><KeyCount>{len(entries)}</KeyCount>"
                    "<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated>"
                    + ("<EncodingType>url</EncodingType>" if url else "") + contents + "</ListBucketResult>")
            self._send(200, body.encode(), {"Content-Type": "application/xml"}, s3.drip_listing_s)

    return Handler


def _true_range(start: int, end: int, total: int) -> str:
    return f"bytes {start}-{end}/{total}"

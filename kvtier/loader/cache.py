"""Node-local cache of remote models: one download per node, resumable, verified.

``pull(uri, cache_dir)`` copies every object directly under ``uri`` (e.g. ``s3://b/models/m/``)
into ``cache_dir/<scheme>/<bucket>/<prefix>/``. Several processes on one node may call it at
once: an exclusive ``flock`` on a lock file beside the directory lets one download while the
others wait, then find the completion marker and return at once. Each file is written as
``NAME.partial`` with a journal of finished blocks (``NAME.partial.done``), so a killed pull
resumes where it stopped; a file is renamed into place only when its size matches the
listing, and the marker (``.kvtier-complete``, JSON of names and sizes) is written last,
atomically. A directory with a marker is trusted only while every file still has its size.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kvtier.errors import LoaderError
from kvtier.loader.sources import open_source, scheme_of, source_class

MARKER = ".kvtier-complete"
MiB = 1024 * 1024


@dataclass(frozen=True)
class PullResult:
    """Where the model is, and whether this call downloaded anything (False: it was cached)."""

    path: str
    downloaded: bool
    bytes_downloaded: int
    files: int


def cache_path(cache_dir: str, uri: str) -> str:
    """The local directory of ``uri`` inside ``cache_dir`` (no ``..`` can escape it)."""
    scheme = scheme_of(uri)
    rest = uri.split("://", 1)[1] if "://" in uri else uri
    parts = [p for p in rest.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise LoaderError(f"{uri}: cannot map to a cache directory")
    return os.path.join(os.path.abspath(cache_dir), scheme, *parts)


def is_complete(path: str) -> bool:
    """True when ``path`` has a marker and every file it lists has the recorded size."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            files = json.load(f)["files"]
        return all(os.path.getsize(os.path.join(path, n)) == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def pull(uri: str, cache_dir: str, concurrency: int = 16, block_size: int = 16 * MiB,
         source_kwargs: dict | None = None, on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None) -> PullResult:
    """Download ``uri``'s objects into the node cache once; return where they are.

    Blocks while another process holds the download lock for the same ``uri``.
    """
    dest = cache_path(cache_dir, uri)
    if is_complete(dest):
        return PullResult(dest, False, 0, _count(dest))
    os.makedirs(dest, exist_ok=True)
    lock_fd = os.open(dest.rstrip("/") + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held by one downloader per node; others wait here
        if is_complete(dest):
            return PullResult(dest, False, 0, _count(dest))
        listing = source_class(uri).list_dir(uri, **_kw(uri, source_kwargs or {}))
        if not listing:
            raise LoaderError(f"{uri}: no objects to pull")
        if on_total is not None:
            on_total(sum(size for _, size in listing))
        got = 0
        base = uri.rstrip("/")
        for name, size in listing:
            got += _fetch(f"{base}/{name}", os.path.join(dest, name), size, concurrency, block_size,
                          source_kwargs or {}, on_bytes)
        marker = {"uri": uri, "files": dict(listing)}
        tmp = os.path.join(dest, f"{MARKER}.tmp.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(dest, MARKER))
        return PullResult(dest, True, got, len(listing))
    finally:
        os.close(lock_fd)  # releases the flock


def _count(path: str) -> int:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return len(json.load(f)["files"])
    except (OSError, ValueError, KeyError):
        return 0


def _fetch(uri: str, path: str, size: int, concurrency: int, block_size: int,
           source_kwargs: dict, on_bytes) -> int:
    """Download one object to ``path`` (resuming a partial one); return the bytes fetched now."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return 0
    partial, journal = path + ".partial", path + ".partial.done"
    done = _read_journal(journal) if os.path.exists(partial) else set()
    blocks = [b for b in range((size + block_size - 1) // block_size) if b not in done]
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644)
    jlock = threading.Lock()
    local = threading.local()
    fetched = 0
    try:
        os.ftruncate(fd, size)
        with open(journal, "a" if done else "w", encoding="ascii") as jf, open_source(uri, **_kw(uri, source_kwargs)) as src:
            if src.size() != size:
                raise LoaderError(f"{uri}: size changed during pull ({src.size()} != {size})")

            def one(b: int) -> int:
                off = b * block_size
                n = min(block_size, size - off)
                buf = getattr(local, "buf", None)
                if buf is None or len(buf) < n:
                    buf = local.buf = bytearray(block_size)
                view = memoryview(buf)[:n]
                src.read_into(off, [view])
                w = 0
                while w < n:
                    w += os.pwrite(fd, view[w:], off + w)
                os.fdatasync(fd)  # the block is durable before the journal says so
                with jlock:
                    jf.write(f"{b}\n")
                    jf.flush()
                return n

            with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="kvtier-pull") as pool:
                for n in pool.map(one, blocks):
                    fetched += n
                    if on_bytes is not None:
                        on_bytes(n)
        os.fsync(fd)
    finally:
        os.close(fd)
    if os.path.getsize(partial) != size:
        raise LoaderError(f"{uri}: downloaded size {os.path.getsize(partial)} != listed {size}")
    os.replace(partial, path)
    os.unlink(journal)
    return fetched


def _read_journal(journal: str) -> set[int]:
    try:
        with open(journal, encoding="ascii", errors="replace") as f:
            lines = f.read().split("\n")[:-1]  # a line cut short by a kill has no newline: ignored
        return {int(line) for line in lines if line.isdigit()}
    except OSError:
        return set()


def _kw(uri: str, source_kwargs: dict) -> dict:
    return source_kwargs if scheme_of(uri) != "file" else {}


def resolve(uri: str, cache_dir: str | None, **pull_kwargs) -> str:
    """``uri`` itself when local or no cache is configured; else the local copy, pulled if needed."""
    if cache_dir is None or scheme_of(uri) == "file":
        return uri
    return pull(uri, cache_dir, **pull_kwargs).path

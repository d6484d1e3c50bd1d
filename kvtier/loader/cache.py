"""Node-local cache of remote models: one download per node, resumable, verified.

``pull(uri, cache_dir)`` copies every object directly under ``uri`` (e.g. ``s3://b/models/m/``)
into ``cache_dir/<scheme>/<bucket>/<prefix>/``. Several processes on one node may call it at
once: an exclusive ``flock`` on a lock file beside the directory lets one download while the
others wait, then find the completion marker and return at once. Each file is written as
``NAME.partial`` with a journal of finished blocks (``NAME.partial.done``), so a killed pull
resumes where it stopped; a file is renamed into place only when its size matches the
listing, and the marker (``.kvtier-complete``, JSON of names, sizes and versions) is written
last, atomically. A directory with a marker is trusted only while every file still has its size.

What a listing may not do (each refused in one line before any object is read):
- name a path outside the cache: names are relative, of non-empty segments without ``.``,
  ``..``, backslashes or control characters (NUL included), and not kvtier's own bookkeeping
  names; every directory on the way must be a real directory that resolves under the cache;
- claim a size that is not a byte count, exceeds ``max_object_size`` (default 1 TiB), or that
  together with the rest does not fit the cache's free space.

One version per file: the source's version (an S3 ETag) is pinned at its HEAD and every ranged
GET is held to it (If-Match). The journal's first line records (size, block size, version); a
journal of another size, block size or version is discarded and the file starts over. An object
replaced during the pull restarts its file from scratch, at most ``version_retries`` times,
then the pull fails in one line. Files finished by an unfinished pull are recorded with their
versions in ``.kvtier-pulling`` and fetched again on the next pull if their object changed.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from kvtier.config import format_bytes
from kvtier.errors import ConfigError, LoaderError
from kvtier.fileio import open_regular_at, read_upto, unlink_quietly
from kvtier.loader.sources import open_source, scheme_of, source_class
from kvtier.loader.sources.base import VersionChanged

MARKER = ".kvtier-complete"
PROGRESS = ".kvtier-pulling"
MiB = 1024 * 1024
DEFAULT_MAX_OBJECT_SIZE = 1024 ** 4  # 1 TiB (the s3 source's default too)
JOURNAL_TAG = "kvtier-journal "
_PARTIAL, _JOURNAL = ".partial", ".partial.done"
_MAX_SEGMENT = 255 - len(_JOURNAL)  # NAME_MAX, less the journal's suffix
#: Largest marker or progress file read (a listing of 100,000 objects writes ~20 MiB); larger is ignored.
MAX_BOOKKEEPING_BYTES = 64 * MiB
_MAX_HEADER = 64 * 1024  # a journal's first line


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
    if not parts or any(p in (".", "..") or "\0" in p for p in parts):
        raise LoaderError(f"{uri}: cannot map to a cache directory")
    return os.path.join(os.path.abspath(cache_dir), scheme, *parts)


def is_complete(path: str) -> bool:
    """True when ``path`` has a marker and every file it lists has the recorded size."""
    try:
        files = json.loads(_read_small(os.path.join(path, MARKER), MAX_BOOKKEEPING_BYTES) or "")["files"]
        return all(os.path.getsize(os.path.join(path, n)) == s for n, s in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _read_small(path: str, limit: int) -> str | None:
    """The text of the regular file ``path`` when it holds at most ``limit`` bytes; None when it is
    absent, larger, unreadable or not a regular file. Never blocks and never follows a link: a
    FIFO or a symlink another user planted in the cache is refused, not opened."""
    try:
        fd, st = open_regular_at(None, path)
    except OSError:
        return None
    try:
        if st.st_size > limit:
            return None
        buf = bytearray(st.st_size)
        n = read_upto(fd, [memoryview(buf)])
        return buf[:n].decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def pull(uri: str, cache_dir: str, concurrency: int = 16, block_size: int = 16 * MiB,
         source_kwargs: dict | None = None, on_bytes: Callable[[int], None] | None = None,
         on_total: Callable[[int], None] | None = None, max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
         version_retries: int = 3) -> PullResult:
    """Download ``uri``'s objects into the node cache once; return where they are.

    Blocks while another process holds the download lock for the same ``uri``. The listing is
    checked whole (names, sizes, free space) before any object is read; LoaderError in one line
    otherwise. An object replaced mid-pull restarts its file, at most ``version_retries`` times.
    """
    if block_size < 1 or max_object_size < 1 or version_retries < 0:
        raise ConfigError(f"pull: block_size and max_object_size must be >= 1 and version_retries >= 0, got "
                          f"{block_size}, {max_object_size}, {version_retries}")
    dest = cache_path(cache_dir, uri)
    if is_complete(dest):
        return PullResult(dest, False, 0, _count(dest))
    try:
        os.makedirs(dest, exist_ok=True)
        lock_fd = os.open(dest.rstrip("/") + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # a cache dir that is a file, not writable, a name too long...
        raise LoaderError(f"{uri}: cannot create the cache directory {dest[:300]} ({exc.strerror}); "
                          "choose another --cache-dir") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held by one downloader per node; others wait here
        if is_complete(dest):
            return PullResult(dest, False, 0, _count(dest))
        listing = source_class(uri).list_dir(uri, **_kw(uri, source_kwargs or {}))
        if not listing:
            raise LoaderError(f"{uri}: no objects to pull")
        base = uri.rstrip("/")
        plan = check_listing(base, dest, listing, max_object_size)
        check_space(uri, dest, plan)
        if on_total is not None:
            on_total(sum(size for _, _, size in plan))
        finished = _read_progress(dest)
        versions: dict[str, str | None] = {}
        counter = [0]
        for name, path, size in plan:
            versions[name] = _fetch(f"{base}/{name}", dest, name, path, size, concurrency, block_size,
                                    source_kwargs or {}, on_bytes, finished.get(name), version_retries, counter)
            finished[name] = versions[name]
            _write_json(dest, PROGRESS, finished)
        _write_json(dest, MARKER, {"uri": uri, "files": {n: s for n, _, s in plan}, "versions": versions})
        try:
            os.unlink(os.path.join(dest, PROGRESS))
        except FileNotFoundError:
            pass
        return PullResult(dest, True, counter[0], len(plan))
    finally:
        os.close(lock_fd)  # releases the flock


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a path under the cache directory (None: it can).

    Accepted: relative names of ``/``-separated non-empty segments, none ``.`` or ``..``, none
    longer than 242 bytes, with no backslash and no control character, and not one of kvtier's
    bookkeeping names (``.kvtier-*`` at the top, ``*.partial``, ``*.partial.done``).
    """
    if not isinstance(name, str) or not name:
        return "an empty name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a control character (NUL included)"
    if "\\" in name:
        return "a backslash (a Windows path)"
    if name.startswith("/"):
        return "an absolute path"
    segments = name.split("/")
    if "" in segments:
        return "an empty segment ('//' or a trailing '/')"
    if any(seg in (".", "..") for seg in segments):
        return "a '.' or '..' segment"
    try:
        if any(len(seg.encode("utf-8")) > _MAX_SEGMENT for seg in segments):
            return f"a segment longer than {_MAX_SEGMENT} bytes"
    except UnicodeEncodeError:
        return "characters that are not UTF-8"
    if segments[0].startswith(".kvtier-") or segments[-1].endswith((_PARTIAL, _JOURNAL)):
        return "a name kvtier uses for its own bookkeeping"
    return None


def check_listing(base: str, dest: str, listing, max_object_size: int) -> list[tuple[str, str, int]]:
    """``[(name, local path, size)]`` for a listing, or LoaderError (one line) for the first
    name that cannot be a path under ``dest`` or size that is not a byte count up to
    ``max_object_size``. Pure: nothing is created or read."""
    plan, seen = [], set()
    names = {n for n, _ in listing}
    for name, size in listing:
        problem = name_problem(name)
        if problem is None and name in seen:
            problem = "a duplicate of a name listed before"
        if problem is None and any("/".join(name.split("/")[:i]) in names for i in range(1, name.count("/") + 1)):
            problem = "a directory part that is also listed as an object"
        if problem is not None:
            raise LoaderError(f"{base}/: refusing object name {str(name)[:200]!r}: it has {problem}; names must be "
                              "relative paths of non-empty segments without '.', '..', backslashes or control "
                              "characters")
        if type(size) is not int or size < 0:
            raise LoaderError(f"{base}/{name}: listed size {str(size)[:40]!r} is not a byte count; refusing the listing")
        if size > max_object_size:
            raise LoaderError(f"{base}/{name}: listed size {size:,} bytes exceeds the maximum object size "
                              f"{max_object_size:,} bytes ({format_bytes(max_object_size)}); raise it with "
                              "--max-object-size (max_object_size) if the object is real")
        seen.add(name)
        plan.append((name, os.path.join(dest, *name.split("/")), size))
    return plan


def check_space(uri: str, dest: str, plan: list[tuple[str, str, int]]) -> None:
    """LoaderError (one line) when the bytes still to download exceed ``dest``'s free space.

    Files already in place at their size count nothing; a partial file counts its allocated bytes
    as already held."""
    need = 0
    for _, path, size in plan:
        if _regular_size(path) == size:
            continue
        held = 0
        try:
            held = min(size, os.lstat(path + _PARTIAL).st_blocks * 512)
        except OSError:
            pass
        need += size - held
    st = os.statvfs(dest)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise LoaderError(f"{uri}: the listing needs {format_bytes(need)} ({need:,} bytes) more in {dest}, which has "
                          f"{format_bytes(free)} free; free space or choose another --cache-dir")


def _regular_size(path: str) -> int | None:
    """The size of ``path`` when it is a regular file (not a link), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _count(path: str) -> int:
    try:
        return len(json.loads(_read_small(os.path.join(path, MARKER), MAX_BOOKKEEPING_BYTES) or "")["files"])
    except (ValueError, KeyError, TypeError):
        return 0


def _nofollow(path: str, flags: int) -> int:
    """``open``'s opener: never through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _write_json(dest: str, name: str, value: dict) -> None:
    """Write ``dest/name`` atomically and durably; LoaderError (one line) when it cannot be."""
    tmp = os.path.join(dest, f"{name}.tmp.{os.getpid()}")
    try:
        unlink_quietly(tmp)  # a leftover (or a FIFO planted there) is never opened
        with open(tmp, "x", encoding="utf-8", opener=_nofollow) as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(dest, name))
    except OSError as exc:
        raise LoaderError(f"cannot write {os.path.join(dest, name)} ({exc.strerror})") from exc


def _read_progress(dest: str) -> dict[str, str | None]:
    """``{name: version}`` of files an unfinished pull completed (empty when absent or unreadable)."""
    try:
        value = json.loads(_read_small(os.path.join(dest, PROGRESS), MAX_BOOKKEEPING_BYTES) or "")
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and (v is None or isinstance(v, str))}


def _parent_dirs(uri: str, dest: str, name: str, path: str) -> None:
    """Create the directories of ``name`` under ``dest``, each a real directory (no link) that
    resolves under ``dest``; LoaderError otherwise."""
    cur = dest
    for seg in name.split("/")[:-1]:
        cur = os.path.join(cur, seg)
        try:
            os.mkdir(cur, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise LoaderError(f"{uri}: cannot create {cur} ({exc.strerror})") from exc
        if not stat.S_ISDIR(os.lstat(cur).st_mode):
            raise LoaderError(f"{uri}: refusing object name {name!r}: {cur} is not a real directory, so the path "
                              "resolves outside the cache directory")
    root = os.path.realpath(dest)
    parent = os.path.realpath(os.path.dirname(path))
    if parent != root and not parent.startswith(root + os.sep):
        raise LoaderError(f"{uri}: refusing object name {name!r}: it resolves outside the cache directory {dest}")


def _fetch(uri: str, dest: str, name: str, path: str, size: int, concurrency: int, block_size: int,
           source_kwargs: dict, on_bytes, finished_version: str | None, retries: int,
           counter: list[int]) -> str | None:
    """Bring ``path`` to one whole version of ``uri`` (resuming a partial copy of that version);
    return the version. Adds the bytes fetched to ``counter[0]``. A file already in place, or a
    partial one, is kept only when the object's version is known and is the one it was fetched
    at; a source that names no version (a local file, a server without ETags) is fetched whole."""
    _parent_dirs(uri, dest, name, path)
    last: VersionChanged | None = None
    for _ in range(retries + 1):
        with open_source(uri, **_kw(uri, source_kwargs)) as src:
            actual = src.size()
            if actual != size:
                raise LoaderError(f"{uri}: size {actual:,} bytes differs from the listed {size:,} (the object changed "
                                  "since the listing); run the pull again")
            version = src.version()
            if _regular_size(path) == size and version is not None and version == finished_version:
                return version
            try:
                _download(src, path, size, block_size, concurrency, version, on_bytes, counter)
                return version
            except VersionChanged as exc:
                last = exc
                _discard(path)
    raise LoaderError(f"{uri}: the object changed {retries + 1} times while it was pulled ({last}); giving up, "
                      "run the pull again once it is stable")


def _discard(path: str) -> None:
    """Remove a partial copy and its journal (the next attempt starts from scratch)."""
    for p in (path + _PARTIAL, path + _JOURNAL):
        unlink_quietly(p)


def _journal_header(size: int, block_size: int, version: str | None) -> str:
    """The journal's first line: what its block numbers are valid for."""
    return JOURNAL_TAG + json.dumps({"size": size, "block": block_size, "version": version}, sort_keys=True)


def _download(src, path: str, size: int, block_size: int, concurrency: int, version: str | None,
              on_bytes, counter: list[int]) -> None:
    """Fetch the blocks of ``src`` the journal does not hold into ``path.partial``, then rename it
    to ``path``. At most ``2 * concurrency`` blocks are outstanding; the first failure stops the
    rest and is raised (VersionChanged when the object was replaced)."""
    partial, journal = path + _PARTIAL, path + _JOURNAL
    header = _journal_header(size, block_size, version)
    nblocks = (size + block_size - 1) // block_size
    done: set[int] = set()
    if version is not None and _regular_size(partial) is not None:
        done = _read_journal(journal, header, nblocks)
    if not done:
        _discard(path)  # another version's copy, or a FIFO or link someone planted: never opened
    try:  # O_NONBLOCK: a FIFO raced in after the discard fails the open instead of blocking it
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise LoaderError(f"{src.uri}: cannot write {partial} ({exc.strerror})") from exc
    jlock = threading.Lock()
    local = threading.local()
    stop = threading.Event()
    try:
        if not done:
            os.ftruncate(fd, 0)  # bytes of another version or block size are never kept
        os.ftruncate(fd, size)
        with open(journal, "a" if done else "x", encoding="utf-8", opener=_nofollow) as jf:
            if not done:
                jf.write(header + "\n")
                jf.flush()

            def one(b: int) -> int:
                if stop.is_set():
                    return 0
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

            _run_blocks(one, (b for b in range(nblocks) if b not in done), concurrency, stop, on_bytes, counter)
        os.fsync(fd)
    except OSError as exc:
        raise LoaderError(f"{src.uri}: cannot write {partial} ({exc.strerror})") from exc
    finally:
        os.close(fd)
    if _regular_size(partial) != size:
        raise LoaderError(f"{src.uri}: downloaded size {_regular_size(partial)} != listed {size}")
    try:
        os.replace(partial, path)
        os.unlink(journal)
    except OSError as exc:
        raise LoaderError(f"{src.uri}: cannot move {partial} into place ({exc.strerror})") from exc


def _run_blocks(one, blocks, concurrency: int, stop: threading.Event, on_bytes, counter: list[int]) -> None:
    """Run ``one(b)`` for every block on ``concurrency`` threads, at most ``2 * concurrency``
    submitted at a time (memory independent of the object's size); raise the first failure."""
    threads = max(1, concurrency)
    error: BaseException | None = None
    with ThreadPoolExecutor(threads, thread_name_prefix="kvtier-pull") as pool:
        pending: set = set()
        it = iter(blocks)
        while True:
            while error is None and len(pending) < 2 * threads:
                b = next(it, None)
                if b is None:
                    break
                pending.add(pool.submit(one, b))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                exc = fut.exception()
                if exc is not None:
                    if error is None:
                        error = exc
                    stop.set()
                    continue
                n = fut.result()
                counter[0] += n
                if on_bytes is not None and n:
                    on_bytes(n)
    if error is not None:
        raise error


def _read_journal(journal: str, header: str, nblocks: int) -> set[int]:
    """Block numbers below ``nblocks`` a journal records when its first line is ``header`` (a line
    cut short by a kill is ignored); empty when the header differs, or the journal is not a
    regular file or is larger than a journal of ``nblocks`` blocks can be (tampered: not trusted)."""
    text = _read_small(journal, _MAX_HEADER + nblocks * (len(str(nblocks)) + 1))
    if text is None:
        return set()
    lines = text.split("\n")[:-1]  # a line cut short by a kill has no newline: ignored
    if not lines or lines[0] != header:
        return set()
    return {int(line) for line in lines[1:] if line.isdigit() and int(line) < nblocks}


def _kw(uri: str, source_kwargs: dict) -> dict:
    return source_kwargs if scheme_of(uri) != "file" else {}


def resolve(uri: str, cache_dir: str | None, **pull_kwargs) -> str:
    """``uri`` itself when local or no cache is configured; else the local copy, pulled if needed."""
    if cache_dir is None or scheme_of(uri) == "file":
        return uri
    return pull(uri, cache_dir, **pull_kwargs).path

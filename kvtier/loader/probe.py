"""Read-throughput probe of an existing file: every block size x concurrency, read-only.

The document's fio experiment, built in: each configuration reads up to ``max_bytes`` of the
file with ``concurrency`` threads issuing positional reads of ``block_size`` into per-thread
reused buffers. ``direct=True`` opens with ``O_DIRECT`` (page-aligned buffers) so the page cache
does not serve repeated runs; otherwise the caller drops caches between runs if it wants cold
figures.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.errors import LoaderError


@dataclass(frozen=True)
class ProbeResult:
    block_size: int
    concurrency: int
    gb_per_s: float
    bytes: int
    seconds: float


def probe(path: str, block_size: int, concurrency: int, max_bytes: int | None = None,
          direct: bool = False) -> ProbeResult:
    """Read ``path`` (or its first ``max_bytes``) once with the given shape; return the throughput."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise LoaderError(f"{path}: cannot open for probing ({exc.strerror})") from exc
    try:
        size = os.fstat(fd).st_size
        total = min(size, max_bytes) if max_bytes else size
        if direct:
            total -= total % 4096
        offsets = list(range(0, total, block_size))
        local = threading.local()

        def one(off: int) -> int:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = mmap.mmap(-1, block_size)  # page-aligned: valid for O_DIRECT
            n = min(block_size, total - off)
            return os.preadv(fd, [memoryview(buf)[:n]], off)

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            got = sum(pool.map(one, offsets))
        secs = time.perf_counter() - start
    except OSError as exc:
        raise LoaderError(f"{path}: read failed while probing ({exc.strerror})") from exc
    finally:
        os.close(fd)
    return ProbeResult(block_size, concurrency, got / secs / 1e9 if secs else 0.0, got, secs)


def drop_file_cache(path: str, system: bool = True) -> str:
    """Evict ``path`` from the page cache; returns the method used.

    With ``system``, tries the system-wide ``/proc/sys/vm/drop_caches`` first (root, not in
    most containers); then ``posix_fadvise(DONTNEED)`` on the file (unprivileged, clean pages).
    """
    os.sync()
    if system:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise"

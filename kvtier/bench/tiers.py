"""``kvtier bench tiers``: put/get throughput of each tier beside its baseline, in one run.

Every contestant is a *target*: a name, a factory and the name of the baseline it is compared
with. Baselines are targets too ("memcpy": a numpy copy of the same sizes; "file": plain
sequential write/read of one file per entry in the same directory, with the same page-cache
treatment as the disk tier), so the JSON output lists them beside the tiers.

To add a tier, register one line in ``TARGETS``::

    TARGETS["redis"] = Target(_redis, baseline="memcpy")

A factory ``factory(args, workdir, entry_bytes, count)`` receives the parsed ``args``, a scratch
directory, the entry size and the number of entries one pass stores, and returns a ``Tier``-like object (``put``, ``get_into``,
``delete``, ``close``) or raises ``TierUnavailable`` / ``ImportError``, in which case the target is
skipped with a one-line note on stderr (a server that is not running, an extra not installed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvtier.bench import shared_targets, targets
from kvtier.config import parse_size
from kvtier.errors import ConfigError, KVTierError
from kvtier.fileio import drop_page_cache
from kvtier.output import emit_json, print_table

MiB = 1024 * 1024
DEFAULT_SIZES = "1MiB,4MiB,16MiB"
DEFAULT_TOTAL = "256MiB"


@dataclass(frozen=True)
class Target:
    """One contestant: ``factory(args, workdir, entry_bytes, count) -> tier-like`` and its baseline."""

    factory: Callable[[argparse.Namespace, str, int, int], Any]
    baseline: str | None


# --- baselines, written as minimal tier-like objects so one loop measures everything -------------


class _MemcpyTarget:
    """Copies into / out of preallocated numpy buffers: the ceiling of a RAM tier."""

    def __init__(self, slots: int, entry_bytes: int):
        self._slots = [np.empty(entry_bytes, dtype=np.uint8) for _ in range(slots)]
        self._index: dict[bytes, int] = {}

    def put(self, key: bytes, data) -> bool:
        slot = self._index.setdefault(key, len(self._index) % len(self._slots))
        np.copyto(self._slots[slot], np.frombuffer(data, dtype=np.uint8))
        return True

    def get_into(self, key: bytes, out) -> int:
        src = self._slots[self._index[key]]
        np.copyto(np.frombuffer(out, dtype=np.uint8)[: src.nbytes], src)
        return src.nbytes

    def delete(self, key: bytes) -> bool:
        return self._index.pop(key, None) is not None

    def close(self) -> None:
        self._slots = []


class _FileTarget:
    """Plain ``write``/``readinto`` of one file per entry; the page cache treated as the disk
    tier's ``drop_cache`` does: writeback started after each write, every written file written
    back and dropped by ``drop_cached`` (untimed, before the reads)."""

    def __init__(self, directory: str):
        self._dir = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: bytes) -> str:
        return os.path.join(self._dir, key.hex())

    def put(self, key: bytes, data) -> bool:
        fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with open(fd, "wb", buffering=0, closefd=False) as f:
                f.write(data)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # starts the writeback
        finally:
            os.close(fd)
        return True

    def drop_cached(self) -> None:
        """Write back and drop every file of the directory."""
        drop_page_cache(self._dir)

    def get_into(self, key: bytes, out) -> int:
        with open(self._path(key), "rb", buffering=0) as f:
            return f.readinto(out)

    def delete(self, key: bytes) -> bool:
        try:
            os.unlink(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


# --- factories -------------------------------------------------------------------------------------


def _memcpy(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    return _MemcpyTarget(count, entry_bytes)


def _file(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    return _FileTarget(os.path.join(workdir, "file"))


def _ram(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    from kvtier.tiers.ram import RamTier

    capacity = count * entry_bytes + 64 * MiB
    return RamTier(RamTier.Config(capacity=capacity, pin_memory="auto"), name="ram")


def _disk(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    from kvtier.tiers.disk import DiskTier

    path = os.path.join(workdir, "disk")
    config = DiskTier.Config(path=path, capacity=count * entry_bytes * 2 + 64 * MiB,
                             o_direct=args.o_direct)
    return DiskTier(config, name="disk")


def _server(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    from kvtier.bench.server import server_target  # a kvtier serve subprocess + ServerStore

    return server_target(args, workdir, entry_bytes, count)


def _server_staging(args: argparse.Namespace, workdir: str, entry_bytes: int, count: int):
    from kvtier.bench.server import server_target  # the same, writes through the staging area

    return server_target(args, workdir, entry_bytes, count, direct_writes=False)


# name -> Target. Baselines first, so a tier's ratio can be printed beside it.
TARGETS: dict[str, Target] = {
    "memcpy": Target(_memcpy, baseline=None),
    "file": Target(_file, baseline=None),
    "ram": Target(_ram, baseline="memcpy"),
    "disk": Target(_disk, baseline="file"),
    "redis-py-loop": Target(shared_targets.redis_loop, baseline=None),
    "redis": Target(shared_targets.redis_tier, baseline="redis-py-loop"),
    "s3": Target(shared_targets.s3_tier, baseline=None),
    "fs": Target(shared_targets.fs_tier, baseline="file"),
    "server": Target(_server, baseline="memcpy"),
    "server-staging": Target(_server_staging, baseline="memcpy"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench tiers``."""
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma-separated entry sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--total", default=DEFAULT_TOTAL,
                        help=f"bytes moved per measurement (default {DEFAULT_TOTAL})")
    parser.add_argument("--work-dir", "--dir", dest="work_dir", default=None,
                        help="directory for the disk tier and file baseline (default: a temp dir)")
    parser.add_argument("--tiers", default=",".join(TARGETS),
                        help=f"comma-separated targets (default {','.join(TARGETS)})")
    parser.add_argument("--repeat", type=int, default=3,
                        help="passes per measurement; the best is reported (default 3)")
    parser.add_argument("--o-direct", action=argparse.BooleanOptionalAction, default=True,
                        help="disk tier files with O_DIRECT (the tier's default; --no-o-direct: through the page cache)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Measure every selected target at every size; print a table or JSON. Returns an exit code."""
    try:
        sizes = [parse_size(s.strip(), "--sizes") for s in args.sizes.split(",") if s.strip()]
        total = parse_size(args.total, "--total")
        names = [n.strip() for n in args.tiers.split(",") if n.strip()]
        unknown = [n for n in names if n not in TARGETS]
        if unknown:
            raise ConfigError(f"--tiers: unknown target {unknown[0]!r}; valid: {', '.join(TARGETS)}")
        if not sizes or min(sizes) <= 0:
            raise ConfigError("--sizes: give at least one positive size")
    except ConfigError as exc:
        print(f"kvtier bench tiers: {exc}", file=sys.stderr)
        return 2
    base_dir = args.work_dir
    if base_dir is not None:
        os.makedirs(base_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base_dir)
    try:
        results = _measure_all(args, names, sizes, total, workdir)
    finally:
        shared_targets.close_services(args)
        shutil.rmtree(workdir, ignore_errors=True)
    checks = _targets(results)
    if args.json:
        emit_json({"results": results, "targets": checks})
    else:
        _print_report(results, names)
        if checks:
            print()
            targets.print_targets(checks)
    return 0


def _targets(results: list[dict]) -> list[dict]:
    """The issues' targets (``kvtier.bench.targets``) checked against this run's GB/s."""
    measured = {f"gbps:{r['tier']}/{r['op']}/{r['entry_bytes'] / MiB:g}MiB": r["gb_per_s"] for r in results}
    return targets.evaluate("tiers", measured)


def _measure_all(args, names, sizes, total, workdir) -> list[dict]:
    progress = None
    if not args.json:
        try:
            from tqdm import tqdm

            progress = tqdm(total=len(names) * len(sizes), desc="bench tiers", file=sys.stderr,
                            unit="run")
        except ImportError:
            progress = None
    results: list[dict] = []
    skipped: set[str] = set()
    for entry_bytes in sizes:
        count = max(2, total // entry_bytes)
        for name in names:
            if progress is not None:
                progress.set_postfix_str(f"{name} {entry_bytes // 1024} KiB")
            if name not in skipped:
                got = _measure_one(args, name, entry_bytes, count, workdir)
                if got is None:
                    skipped.add(name)
                else:
                    results.extend(got)
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    return results


def _measure_one(args, name, entry_bytes, count, workdir) -> list[dict] | None:
    factory = TARGETS[name].factory
    try:
        target = factory(args, workdir, entry_bytes, count)
    except (ImportError, KVTierError, OSError) as exc:
        print(f"kvtier bench tiers: skipping {name}: {exc}", file=sys.stderr)
        return None
    rng = np.random.default_rng(entry_bytes)
    payload = rng.integers(0, 256, size=entry_bytes, dtype=np.uint8)
    out = np.empty(entry_bytes, dtype=np.uint8)
    keys = [int(i).to_bytes(4, "little") * 8 for i in range(count)]
    best_put = best_get = 0.0
    try:
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            for key in keys:
                if not target.put(key, payload):
                    raise RuntimeError(f"{name} refused a put of {entry_bytes} bytes")
            t1 = time.perf_counter()
            if hasattr(target, "drop_cached"):  # untimed: the reads start cold on every file target
                target.drop_cached()
            t2 = time.perf_counter()
            for key in keys:
                if target.get_into(key, out) != entry_bytes:
                    raise RuntimeError(f"{name} missed an entry it just stored")
            t3 = time.perf_counter()
            moved = count * entry_bytes / 1e9
            best_put = max(best_put, moved / max(t1 - t0, 1e-9))
            best_get = max(best_get, moved / max(t3 - t2, 1e-9))
            for key in keys:
                target.delete(key)
        if not np.array_equal(out, payload):
            raise RuntimeError(f"{name} returned wrong bytes")
    finally:
        target.close()
    return [
        {"tier": name, "op": "put", "entry_bytes": entry_bytes, "gb_per_s": round(best_put, 3)},
        {"tier": name, "op": "get", "entry_bytes": entry_bytes, "gb_per_s": round(best_get, 3)},
    ]


def _print_report(results: list[dict], names: list[str]) -> None:
    by = {(r["tier"], r["op"], r["entry_bytes"]): r["gb_per_s"] for r in results}
    rows = []
    for r in results:
        baseline = TARGETS[r["tier"]].baseline
        base = by.get((baseline, r["op"], r["entry_bytes"])) if baseline else None
        ratio = f"{r['gb_per_s'] / base:.0%} of {baseline}" if base else "-"
        rows.append([r["tier"], r["op"], f"{r['entry_bytes'] / MiB:g} MiB", r["gb_per_s"], ratio])
    print_table(["tier", "op", "entry", "GB/s", "vs baseline"], rows)

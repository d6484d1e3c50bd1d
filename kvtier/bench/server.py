"""``kvtier bench tiers`` target "server": a ``kvtier serve`` subprocess measured through ServerStore.

The server runs as its own process (as in production: engines and server do not share a GIL),
on a unix socket in the benchmark's scratch directory, with a RAM arena large enough for one
pass. ``get_into`` copies an entry out of the shared arena into the caller's buffer, and ``put``
copies the payload straight into arena pages the server reserved (a direct write), so both
figures compare directly with the "memcpy" baseline. The target "server-staging" is the same
server with the client's writes forced through the staging area (two copies: the path before
direct writes), to compare the two in one run. The process is started, polled for
readiness and stopped through ``kvtier.harness.procs`` (it dies with the benchmark).
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvtier.errors import KVTierError
from kvtier.fastcopy import copy_pairs
from kvtier.harness.procs import Child, spawn, wait_ready
from kvtier.server.client import ServerStore
from kvtier.server.protocol import ServerRejected

MiB = 1024 * 1024


class ServerTarget:
    """A started server process plus a connected client; ``put``/``get_into``/``delete``/``close``.

    Raises ``ServiceUnavailable`` when the server exits or is not ready within ``timeout`` s,
    ``ServerRejected`` when it refuses the client.
    """

    def __init__(self, workdir: str, capacity: int, page_size: int = 256 * 1024, timeout: float = 30.0,
                 direct_writes: bool = True, codec: str = "none", element_dtype: str | None = None):
        os.makedirs(workdir, exist_ok=True)
        sock = os.path.join(workdir, "kvtier.sock")
        if os.path.lexists(sock):  # a live server there would answer the readiness probe for this one
            raise KVTierError(f"{sock} exists: another kvtier serve may be listening there; stop it or remove "
                              "the socket, or use another work directory")
        path = os.path.join(workdir, "serve.json")
        with open(path, "w") as f:
            json.dump(_serve_config(sock, capacity, page_size, codec, element_dtype), f)
        self._child: Child = spawn([sys.executable, "-m", "kvtier.cli", "serve", "--config", path,
                                    "--log-level", "WARNING"], name="kvtier serve",
                                   log=os.path.join(workdir, "serve.log"))
        self.client: ServerStore | None = None
        try:
            self.client = _connect(self._child, sock, timeout, direct_writes)
        except BaseException:
            self._child.stop()
            raise

    def put(self, key: bytes, data) -> bool:
        return self.client.put(key, data)

    def get_into(self, key: bytes, out) -> int | None:
        return self.client.get_into(key, out)

    def delete(self, key: bytes) -> bool:
        return self.client.delete(key)

    def close(self) -> None:
        """Close the client, then stop the server (SIGTERM, SIGKILL after a grace period)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self._child.stop(grace=10.0)


def _serve_config(sock: str, capacity: int, page_size: int, codec: str = "none",
                  element_dtype: str | None = None) -> dict:
    """``kvtier serve``'s configuration: one LRU RAM arena of ``capacity`` bytes on ``sock``
    (coded with ``codec``; ``element_dtype``: the store's KV element type, when given)."""
    store: dict = {"tiers": [{"type": "ram", "capacity": capacity, "page_size": page_size, "policy": "lru",
                              "codec": codec}]}
    if element_dtype is not None:
        store["element_dtype"] = element_dtype
    return {"listen": f"unix://{sock}", "staging": max(256 * MiB, capacity // 4), "store": store}


def _connect(child: Child, sock: str, timeout: float, direct_writes: bool = True) -> ServerStore:
    """A client connected to the server ``child`` runs on the unix socket ``sock``, polled with
    real handshakes once the socket exists until one succeeds; a refusal (``ServerRejected``) is
    raised at once, not retried."""
    address = f"unix://{sock}"
    found: list[ServerStore | ServerRejected] = []

    def ready() -> bool:
        if not os.path.exists(sock):  # not listening yet: no handshake (the client would log each miss)
            return False
        try:
            client = ServerStore(address, direct_writes=direct_writes)
        except ServerRejected as exc:
            found.append(exc)
            return True
        if not client.connected:
            client.close()
            return False
        found.append(client)
        return True

    wait_ready(child, ready, timeout, f"kvtier serve on {address}", bind_failure=None)
    if isinstance(found[-1], ServerRejected):
        raise found[-1]
    return found[-1]


def server_target(args, workdir: str, entry_bytes: int, count: int, direct_writes: bool = True) -> ServerTarget:
    """Factory for ``kvtier.bench.tiers.TARGETS["server"]`` (and, with ``direct_writes=False``,
    ``"server-staging"``)."""
    name = f"server-{entry_bytes}" if direct_writes else f"server-staging-{entry_bytes}"
    page = _page_for(entry_bytes)
    capacity = count * (-(-entry_bytes // page) * page) + 64 * MiB
    return ServerTarget(os.path.join(workdir, name), capacity, page_size=page, direct_writes=direct_writes)


def _page_for(entry_bytes: int, largest: int = 256 * 1024, os_page: int = 4096) -> int:
    """The arena page for entries of ``entry_bytes``: at most ``largest``, no larger than an entry
    (rounded up to whole OS pages, as direct writes need), so one pass fits the arena."""
    return min(largest, max(os_page, -(-entry_bytes // os_page) * os_page))


# --- direct vs staged writes, each pass beside a memcpy pass of the same sizes --------------------


def compare_writes(sizes: list[int], total: int, rounds: int, workdir: str, batch: int = 16) -> dict:
    """Put and get GB/s through one ``kvtier serve`` per entry size, by a direct-write client
    (one ``put`` per entry: "direct"; ``put_many`` of ``batch`` entries, as a step's saves:
    "direct-batch") and a staging client, each pass interleaved with a memcpy pass of the same
    entries (the order alternates per round), so a ratio compares passes measured moments
    apart. Returns the per-round figures and, per (size, op, path), the median GB/s and the
    median, min and max of the ratio to the memcpy pass of the same round. RuntimeError when a
    read is wrong."""
    results = []
    for entry_bytes in sizes:
        count = max(2, total // entry_bytes)
        page = _page_for(entry_bytes)
        capacity = count * (-(-entry_bytes // page) * page) + 64 * MiB
        target = ServerTarget(os.path.join(workdir, f"compare-{entry_bytes}"), capacity, page_size=page)
        staged = None
        try:
            staged = _connect(target._child, os.path.join(workdir, f"compare-{entry_bytes}", "kvtier.sock"), 30.0,
                              direct_writes=False)
            rounds_out = [_one_round(target.client, staged, entry_bytes, count, r, batch)
                          for r in range(max(1, rounds))]
        finally:
            if staged is not None:
                staged.close()
            target.close()
        results.extend(_summarise(entry_bytes, rounds_out))
    return {"total_bytes": total, "rounds": rounds, "batch": batch, "results": results}


def _one_round(direct: ServerStore, staged: ServerStore, entry_bytes: int, count: int, r: int,
               batch: int = 16) -> dict:
    """One round: memcpy, direct, batched direct and staged passes (put then get) in an order
    that alternates with ``r``; GB/s per (path, op)."""
    import numpy as np

    payload = np.random.default_rng(entry_bytes + r).integers(0, 256, size=entry_bytes, dtype=np.uint8)
    out = np.empty(entry_bytes, dtype=np.uint8)
    slots = [np.ones(entry_bytes, dtype=np.uint8) for _ in range(count)]  # touched: no first-use faults
    keys = [int(i).to_bytes(4, "little") * 8 for i in range(count)]
    gb = count * entry_bytes / 1e9
    figures: dict[tuple[str, str], float] = {}

    def memcpy_pass() -> None:
        t0 = time.perf_counter()
        for slot in slots:
            np.copyto(slot, payload)
        t1 = time.perf_counter()
        for slot in slots:
            np.copyto(out, slot)
        t2 = time.perf_counter()
        figures["memcpy", "put"], figures["memcpy", "get"] = gb / (t1 - t0), gb / (t2 - t1)
        t0 = time.perf_counter()
        for slot in slots:  # the same copies with the streaming stores the server's fills use
            copy_pairs([(slot, payload)])
        t1 = time.perf_counter()
        for slot in slots:
            copy_pairs([(out, slot)])
        t2 = time.perf_counter()
        figures["memcpy-stream", "put"], figures["memcpy-stream", "get"] = gb / (t1 - t0), gb / (t2 - t1)

    def server_pass(name: str, client: ServerStore, batched: bool = False) -> None:
        t0 = time.perf_counter()
        if batched:
            for start in range(0, count, batch):
                if not all(client.put_many([(key, payload) for key in keys[start : start + batch]])):
                    raise RuntimeError(f"server ({name}) refused a put of {entry_bytes} bytes")
        else:
            for key in keys:
                if not client.put(key, payload):
                    raise RuntimeError(f"server ({name}) refused a put of {entry_bytes} bytes")
        t1 = time.perf_counter()
        for key in keys:
            if client.get_into(key, out) != entry_bytes:
                raise RuntimeError(f"server ({name}) missed an entry it just stored")
        t2 = time.perf_counter()
        if not np.array_equal(out, payload):
            raise RuntimeError(f"server ({name}) returned wrong bytes")
        for key in keys:
            client.delete(key)
        figures[name, "put"], figures[name, "get"] = gb / (t1 - t0), gb / (t2 - t1)

    passes = [memcpy_pass, lambda: server_pass("direct", direct), memcpy_pass,
              lambda: server_pass("direct-batch", direct, batched=True), memcpy_pass,
              lambda: server_pass("staging", staged)]
    for run in passes if r % 2 == 0 else passes[::-1]:
        run()  # a memcpy pass beside each server pass; the ratios use the round's last
    return figures


def _summarise(entry_bytes: int, rounds: list[dict]) -> list[dict]:
    """Median GB/s per (path, op) and the median/min/max ratio to the same round's memcpy."""
    import statistics

    rows = []
    for path in ("memcpy", "memcpy-stream", "direct", "direct-batch", "staging"):
        for op in ("put", "get"):
            gbps = [r[path, op] for r in rounds]
            ratios = [r[path, op] / r["memcpy", op] for r in rounds]
            rows.append({"entry_bytes": entry_bytes, "path": path, "op": op,
                         "gb_per_s": round(statistics.median(gbps), 3),
                         "vs_memcpy": round(statistics.median(ratios), 3),
                         "vs_memcpy_min": round(min(ratios), 3), "vs_memcpy_max": round(max(ratios), 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtier.bench.server``: ``compare_writes`` from the command line."""
    import argparse
    import shutil
    import tempfile

    from kvtier.config import parse_size
    from kvtier.errors import ConfigError
    from kvtier.output import emit_json, print_table

    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.server",
                                     description="server put/get, direct vs staged writes, beside memcpy")
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="comma-separated entry sizes")
    parser.add_argument("--total", default="128MiB", help="bytes per pass (default 128MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--batch", type=int, default=16,
                        help="entries per put_many in the direct-batch pass, as one step's saves (default 16)")
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    arenas = parser.add_argument_group("--arenas: a raw and a lossless arena of the same capacity "
                                       "(kvtier.bench.server_arena)")
    arenas.add_argument("--arenas", action="store_true", help="run the arena comparison instead")
    arenas.add_argument("--kv", choices=("model", "synthetic"), default="model", help="KV source (model)")
    arenas.add_argument("--variant", default="small", help="random test model variant (small)")
    arenas.add_argument("--docs", type=int, default=12, help="documents written (12)")
    arenas.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document (4096)")
    arenas.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (256)")
    arenas.add_argument("--capacity-fraction", type=float, default=0.5,
                        help="each arena's capacity as a fraction of the documents' bytes (0.5)")
    arenas.add_argument("--page", default="16KiB", help="arena page size (16KiB)")
    arenas.add_argument("--throughput-chunks", type=int, default=64, help="chunks per throughput pass (64)")
    args = parser.parse_args(argv)
    try:
        args.page = parse_size(args.page, "--page")
        if args.arenas and (args.docs < 1 or args.chunk_tokens < 1 or args.doc_tokens < args.chunk_tokens
                            or not 0 < args.capacity_fraction <= 1 or args.page % 4096):
            raise ConfigError("--arenas: --docs >= 1, --doc-tokens >= --chunk-tokens >= 1, "
                              "--capacity-fraction in (0, 1], --page a multiple of 4 KiB")
        sizes = [parse_size(s.strip(), "--sizes") for s in args.sizes.split(",") if s.strip()]
        total = parse_size(args.total, "--total")
        if not sizes or min(sizes) <= 0 or args.rounds < 1 or args.batch < 1:
            raise ConfigError("--sizes: give positive sizes; --rounds, --batch: at least 1")
    except ConfigError as exc:
        print(f"kvtier bench server: {exc}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-server-", dir=args.work_dir)
    try:
        if args.arenas:
            from kvtier.bench.server_arena import compare_arenas

            report = compare_arenas(args, workdir)
        else:
            report = compare_writes(sizes, total, args.rounds, workdir, args.batch)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.arenas:
        return _print_arenas(report, args.json)
    if args.json:
        emit_json(report)
    else:
        print_table(["entry", "path", "op", "GB/s (median)", "vs memcpy (median)", "min", "max"],
                    [[f"{r['entry_bytes'] / MiB:g} MiB", r["path"], r["op"], r["gb_per_s"], r["vs_memcpy"],
                      r["vs_memcpy_min"], r["vs_memcpy_max"]] for r in report["results"]])
    return 0


def _print_arenas(report: dict, as_json: bool) -> int:
    """The arena comparison as JSON or two tables; 0 when the capacity target is met, else 1."""
    from kvtier.output import emit_json, print_table

    if as_json:
        emit_json(report)
    else:
        print_table(["codec", "paced", "docs held", "chunks held", "stored MiB", "raw MiB"],
                    [[r["codec"], r["paced"], r["docs_held"], r["chunks_held"],
                      round((r["stored_bytes"] or 0) / MiB, 1), round((r["raw_bytes"] or 0) / MiB, 1)]
                     for r in report["capacity"]],
                    title=f"arenas of {report['capacity_bytes'] / MiB:.0f} MiB, {report['kv_source']}: docs ratio "
                          f"{report['docs_ratio_paced']} paced, {report['docs_ratio_burst']} burst (target 1.25)")
        print_table(["path", "op", "GB/s (median)", "vs memcpy"],
                    [[r["path"], r["op"], r["gb_per_s"], r.get("vs_memcpy", "")] for r in report["throughput"]])
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())

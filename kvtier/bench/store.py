"""kvtier bench store: RAM-tier hits under many clients while a lower tier is slow.

One process, one ``TieredStore``. ``--clients`` threads read a hot set that stays in the RAM
tier (each read timed) and now and then put a new chunk; another thread deletes the chunks
they put; another scrapes ``stats()`` every ``--stats-interval`` s (what ``kvtier serve``'s
``/metrics`` does). Two settings in the same run, in alternating rounds (ABBA...):

- ``alone``: the RAM tier only;
- ``slow``: the RAM tier over a slow lower tier: ``redis`` behind the project's delay proxy
  (``--delay-ms`` per request, the proxy in a child process so its threads do not share this
  interpreter), or ``fs``, a shared directory holding ``--fs-entries`` entries.

With ``--via serve`` the store is a ``kvtier serve`` process (one per round, its own
interpreter), each client thread and the deleter have their own connection (``ServerStore``) and
the scraper fetches the server's ``/metrics`` over HTTP instead of calling ``stats()``.

Reported per setting: RAM-hit p50/p99 (us), puts, deletes, stats() calls (or scrapes) and their
p50/p99 (ms); and the p99 (and p50) ratio slow / alone. Target (issue 25): p99 ratio <= 1.2: nothing
slow runs under the store's lock. Clients pause ``--think-ms`` between operations (an engine
does work between its store calls), so a hit's latency is the store's, not the interpreter's
thread switching.

Imports: ``kvtier.store``, ``kvtier.harness.procs``/``services``, ``delay_proxy`` (the slow tier),
``kvtier.config``, ``kvtier.errors``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from kvtier.buffers import gather_into
from kvtier.config import parse_size
from kvtier.errors import ConfigError, KVTierError

LOWERS = ("redis", "fs")
SETTINGS = ("alone", "slow")
TARGET_P99_RATIO = 1.2


@dataclass
class Phase:
    """What one round of one setting measured (nanoseconds for latencies)."""

    setting: str
    hit_ns: list[int] = field(default_factory=list)
    put_ns: list[int] = field(default_factory=list)
    stats_ns: list[int] = field(default_factory=list)
    misses: int = 0  # hot-set reads not served by the RAM tier (evicted meanwhile: not timed)
    deletes: int = 0
    wrong: int = 0  # reads that returned other bytes than were put (must be none)
    lower_puts: int = 0  # copies the lower tier took (write-through), from its stats at the round's end
    lower_dropped: int = 0  # copies it dropped (a full queue, a failed put)


def percentile(values: list[int], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def summarize(phases: list[Phase]) -> dict:
    """Merge the rounds of each setting; p50/p99 per setting and the slow/alone ratios."""
    out: dict = {"settings": {}}
    for setting in SETTINGS:
        mine = [p for p in phases if p.setting == setting]
        if not mine:
            continue
        hits = [v for p in mine for v in p.hit_ns]
        puts = [v for p in mine for v in p.put_ns]
        stats = [v for p in mine for v in p.stats_ns]

        def us(q, values=hits):
            v = percentile(values, q)
            return None if v is None else round(v / 1e3, 1)

        def ms(q):
            v = percentile(stats, q)
            return None if v is None else round(v / 1e6, 2)

        out["settings"][setting] = {
            "rounds": len(mine), "ram_hits": len(hits), "ram_hit_p50_us": us(50), "ram_hit_p99_us": us(99),
            "ram_hit_max_us": us(100), "puts": len(puts), "put_p99_us": us(99, puts),
            "deletes": sum(p.deletes for p in mine), "stats_calls": len(stats), "stats_p50_ms": ms(50),
            "stats_p99_ms": ms(99), "misses": sum(p.misses for p in mine), "wrong": sum(p.wrong for p in mine),
            "lower_puts": sum(p.lower_puts for p in mine), "lower_dropped": sum(p.lower_dropped for p in mine),
        }
    s = out["settings"]
    if "alone" in s and "slow" in s:
        out["p99_ratio"] = _ratio(s["slow"]["ram_hit_p99_us"], s["alone"]["ram_hit_p99_us"])
        out["p50_ratio"] = _ratio(s["slow"]["ram_hit_p50_us"], s["alone"]["ram_hit_p50_us"])
        out["target_p99_ratio"] = TARGET_P99_RATIO
        out["meets_target"] = out["p99_ratio"] is not None and out["p99_ratio"] <= TARGET_P99_RATIO
    return out


def order(rounds: int) -> list[str]:
    """The settings of ``rounds`` rounds, alternated ABBA so drift hits both alike."""
    seq: list[str] = []
    for r in range(rounds):
        seq += list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
    return seq


def _key(i: int, ns: bytes) -> bytes:
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


# ------------------------------------------------------------------------------------ one round


def run_phase(store, setting: str, args: argparse.Namespace, hot: list[bytes], blob: np.ndarray,
              ns: bytes, clients_stores: list | None = None, scrape=None) -> Phase:
    """``args.clients`` readers/putters, one deleter and one stats scraper for ``args.duration`` s.
    ``clients_stores[c]``: client ``c``'s own store handle (default: ``store`` for all);
    ``scrape``: what the scraper calls (default: ``store.stats``)."""
    phase = Phase(setting)
    scrape = scrape or store.stats
    top = store.tier_names[0]
    deadline = time.monotonic() + args.duration
    think = args.think_ms / 1e3
    put_every = max(1, args.put_every)
    doomed: deque[bytes] = deque(maxlen=10_000)  # chunks the clients put, for the deleter
    guard = threading.Lock()
    stop = threading.Event()

    def client(c: int) -> None:
        mine = clients_stores[c] if clients_stores else store
        rng = np.random.default_rng(c)
        out = np.empty(blob.size, dtype=np.uint8)
        hits, puts, misses, wrong, n = [], [], 0, 0, 0

        def consume(segments) -> None:
            gather_into(segments, out)

        while time.monotonic() < deadline:
            k = hot[int(rng.integers(len(hot)))]
            t0 = time.perf_counter_ns()
            tier = mine.read(k, consume)
            t1 = time.perf_counter_ns()
            if tier != top:  # evicted meanwhile, or served from below: not a RAM hit
                misses += 1
            else:
                hits.append(t1 - t0)
                if out[0] != blob[0] or out[-1] != blob[-1]:
                    wrong += 1
            n += 1
            if n % put_every == 0:
                k2 = _key(n, ns + bytes([c]))
                t0 = time.perf_counter_ns()
                mine.put(k2, blob)
                puts.append(time.perf_counter_ns() - t0)
                doomed.append(k2)
            time.sleep(think)
        with guard:
            phase.hit_ns += hits
            phase.put_ns += puts
            phase.misses += misses
            phase.wrong += wrong

    def deleter() -> None:
        while not stop.is_set():
            try:
                k = doomed.popleft()
            except IndexError:
                stop.wait(think or 0.001)
                continue
            store.delete(k)
            phase.deletes += 1

    def scraper() -> None:
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            scrape()
            phase.stats_ns.append(time.perf_counter_ns() - t0)
            stop.wait(args.stats_interval)

    clients = [threading.Thread(target=client, args=(c,), name=f"bench-client-{c}") for c in range(args.clients)]
    helpers = [threading.Thread(target=deleter, name="bench-deleter"),
               threading.Thread(target=scraper, name="bench-stats")]
    for th in clients + helpers:
        th.start()
    for th in clients:
        th.join()
    stop.set()
    for th in helpers:
        th.join()
    return phase


# ------------------------------------------------------------------------------------ the slow tier


@contextlib.contextmanager
def _delay_proxy(port: int, delay_s: float) -> Iterator[int]:
    """The delay proxy in a child process in front of 127.0.0.1:``port``; yields its port."""
    import subprocess

    from kvtier.harness.procs import spawn

    code = ("import sys; from kvtier.bench.delay_proxy import DelayProxy; "
            "p = DelayProxy(('127.0.0.1', int(sys.argv[1])), float(sys.argv[2])); "
            "print(p.port, flush=True); sys.stdin.read()")
    child = spawn([sys.executable, "-c", code, str(port), str(delay_s)], name="delay-proxy",
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.popen.stdout.readline().strip()
        if not line.isdigit():
            raise KVTierError(f"the delay proxy did not start (it printed {line!r})")
        yield int(line)
    finally:
        child.stop()


@contextlib.contextmanager
def slow_tier(args: argparse.Namespace, work: str) -> Iterator[dict]:
    """The slow lower tier's spec (``--lower``), with what it needs running meanwhile."""
    if args.lower == "redis":
        from kvtier.harness.services import redis_server

        with redis_server(work) as redis, _delay_proxy(redis.port, args.delay_ms / 1e3) as port:
            yield {"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "capacity": "1GiB",
                   "prefix": "bench-store:"}
        return
    path = os.path.join(work, "fs")
    _fill_fs(path, args.fs_entries)
    spec = {"type": "fs", "path": path, "capacity": "64GiB"}
    if args.fs_refresh_s is not None:
        spec["usage_refresh_s"] = args.fs_refresh_s
    yield spec


def _fill_fs(path: str, entries: int) -> None:
    """Put ``entries`` small entries into an fs tier directory (what another engine left)."""
    from kvtier.tiers.fs import FsConfig, FsTier

    tier = FsTier(FsConfig(path=path, capacity=64 << 30), name="fill")
    small = np.zeros(64, dtype=np.uint8)
    try:
        for i in range(entries):
            tier.put(_key(i, b"fill"), small)
    finally:
        tier.close()


# ------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench store``."""
    parser.add_argument("--clients", type=int, default=8, help="reader/putter threads (default 8)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round (default 5)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per setting, alternated ABBA (default 2)")
    parser.add_argument("--lower", choices=LOWERS, default="redis",
                        help="the slow lower tier: redis behind the delay proxy, or a crowded fs directory")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="redis: proxy delay per request (default 50)")
    parser.add_argument("--fs-entries", type=int, default=100_000,
                        help="fs: entries already in the directory (default 100000)")
    parser.add_argument("--fs-refresh-s", type=float, default=None,
                        help="fs: the tier's usage_refresh_s (default: the tier's; 0: one scan when the "
                             "store starts, none during the round)")
    parser.add_argument("--entry-bytes", default="64KiB", help="chunk size (default 64KiB)")
    parser.add_argument("--hot", type=int, default=128, help="hot chunks kept in the RAM tier (default 128)")
    parser.add_argument("--put-every", type=int, default=10, help="a client puts one chunk per N reads (default 10)")
    parser.add_argument("--think-ms", type=float, default=1.0, help="pause between a client's operations (default 1)")
    parser.add_argument("--stats-interval", type=float, default=0.1, help="seconds between stats() calls (default 0.1)")
    parser.add_argument("--writer-nice", type=int, default=0,
                        help="the store's writer_nice: lower-tier writers this many steps nicer (default 0)")
    parser.add_argument("--writer-idle", action="store_true",
                        help="the store's writer_idle: lower-tier writers under SCHED_IDLE (not with --writer-nice)")
    parser.add_argument("--via", choices=("store", "serve"), default="store",
                        help="store: a TieredStore in this process; serve: a kvtier serve process, one "
                             "connection per client, /metrics scraped over HTTP")
    parser.add_argument("--work-dir", default=None, help="directory for redis/fs files (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _check(args: argparse.Namespace) -> int:
    """Validate the options; the entry size in bytes. ConfigError naming the option."""
    for name in ("clients", "rounds", "hot", "put_every"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    for name in ("duration", "stats_interval"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if not 0 <= args.writer_nice <= 19:
        raise ConfigError(f"--writer-nice: must be in [0, 19], got {args.writer_nice}")
    if args.writer_nice and getattr(args, "writer_idle", False):
        raise ConfigError("--writer-idle and --writer-nice: choose one (an idle writer has no niceness)")
    if args.think_ms < 0 or args.delay_ms < 0 or args.fs_entries < 0:
        raise ConfigError("--think-ms, --delay-ms, --fs-entries: must not be negative")
    size = parse_size(args.entry_bytes, "--entry-bytes")
    if size < 1:
        raise ConfigError(f"--entry-bytes: must be positive, got {args.entry_bytes!r}")
    return size


def measure(args: argparse.Namespace, entry: int, work: str) -> dict:
    """Run every round; the summary (see ``summarize``) with the run's parameters."""
    from kvtier.store import TieredStore

    page = 64 << 10
    slots = -(-entry // page) * page
    ram = {"type": "ram", "capacity": slots * (args.hot + 512), "page_size": page,
           "policy": "lru", "pin_memory": False}
    blob = np.random.default_rng(0).integers(0, 256, entry, dtype=np.uint8)
    phases = []
    with slow_tier(args, work) as lower:
        for r, setting in enumerate(order(args.rounds)):
            tiers = [ram] if setting == "alone" else [ram, lower]
            ns = f"{r}:".encode()
            hot = [_key(i, ns + b"hot") for i in range(args.hot)]
            if args.via == "serve":
                phases.append(_serve_round(args, work, r, setting, tiers, hot, blob, ns))
                continue
            with TieredStore.from_config({"tiers": tiers, "write_queue_depth": 64, "writer_nice": args.writer_nice,
                                          "writer_idle": getattr(args, "writer_idle", False)}) as store:
                if len(store.tiers) != len(tiers):
                    raise KVTierError(f"the {args.lower} tier did not start (see the warnings above)")
                for k in hot:
                    store.put(k, blob)
                phase = run_phase(store, setting, args, hot, blob, ns)
                _count_lower(phase, store.stats())
                phases.append(phase)
                store.close(timeout=5.0)  # queued slow copies are dropped, not waited for
    out = summarize(phases)
    out.update({"clients": args.clients, "lower": args.lower, "via": args.via, "entry_bytes": entry,
                "duration_s": args.duration,
                "rounds": args.rounds, "think_ms": args.think_ms, "writer_nice": args.writer_nice,
                "writer_idle": getattr(args, "writer_idle", False),
                "stats_interval_s": args.stats_interval,
                "delay_ms": args.delay_ms if args.lower == "redis" else None,
                "fs_entries": args.fs_entries if args.lower == "fs" else None,
                "fs_refresh_s": args.fs_refresh_s if args.lower == "fs" else None})
    return out


def _count_lower(phase: Phase, stats: dict) -> None:
    """The lower tiers' puts and drops of a round, from a ``stats()`` taken at its end."""
    lower = stats.get("tiers", [])[1:]
    phase.lower_puts = sum(int(t.get("puts", 0)) for t in lower)
    phase.lower_dropped = sum(int(t.get("dropped", 0)) for t in lower)


def _serve_round(args: argparse.Namespace, work: str, r: int, setting: str, tiers: list, hot: list[bytes],
                 blob: np.ndarray, ns: bytes) -> Phase:
    """One round through a ``kvtier serve`` process holding ``tiers``: a connection per client
    and one for the deleter, ``/metrics`` scraped over HTTP."""
    import urllib.request

    from kvtier.bench.server import _connect
    from kvtier.harness.procs import spawn

    where = os.path.join(work, f"serve-{r}")
    os.makedirs(where, exist_ok=True)
    path, log = os.path.join(where, "serve.json"), os.path.join(where, "serve.log")
    sockdir = tempfile.mkdtemp(prefix="kvtier-bs-")  # a unix socket path must be short (108 bytes)
    sock = os.path.join(sockdir, "kvtier.sock")
    with open(path, "w") as f:
        json.dump({"listen": f"unix://{sock}", "metrics": "127.0.0.1:0", "staging": 64 << 20,
                   "store": {"tiers": tiers, "write_queue_depth": 64, "writer_nice": args.writer_nice,
                             "writer_idle": getattr(args, "writer_idle", False)}}, f)
    child = spawn([sys.executable, "-m", "kvtier.cli", "serve", "--config", path, "--log-level", "WARNING"],
                  name="kvtier serve", log=log)
    handles = []
    try:
        handles.append(_connect(child, sock, 60.0))
        if len(handles[0].tier_names) != len(tiers):
            raise KVTierError(f"the {args.lower} tier did not start in kvtier serve (see {log})")
        handles += [_connect(child, sock, 60.0) for _ in range(args.clients)]
        found: list[str] = []
        deadline = time.monotonic() + 30.0
        while not found and time.monotonic() < deadline:  # "ready on ..., metrics http://H:P" may trail the socket
            with open(log) as f:
                found = [w for line in f for w in line.split() if w.startswith("http://")]
            if not found:
                time.sleep(0.05)
        if not found:
            raise KVTierError(f"kvtier serve printed no metrics address (see {log})")
        url = found[-1].rstrip(",") + "/metrics"

        def scrape() -> None:
            with urllib.request.urlopen(url, timeout=10) as reply:
                reply.read()

        for k in hot:
            handles[0].put(k, blob)
        phase = run_phase(handles[0], setting, args, hot, blob, ns, clients_stores=handles[1:], scrape=scrape)
        _count_lower(phase, handles[0].stats())
        return phase
    finally:
        for h in handles:
            h.close()
        child.stop(grace=5.0)
        shutil.rmtree(sockdir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """Measure and print a table or JSON. Exit code 0, 2 on bad options, 1 when the slow tier
    could not be set up."""
    try:
        entry = _check(args)
    except ConfigError as exc:
        print(f"kvtier bench store: {exc}", file=sys.stderr)
        return 2
    try:
        if args.work_dir:
            os.makedirs(args.work_dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix="kvtier-bench-store-", dir=args.work_dir)
    except OSError as exc:
        print(f"kvtier bench store: --work-dir {args.work_dir}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        out = measure(args, entry, work)
    except KVTierError as exc:
        print(f"kvtier bench store: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_report(out)
    return 0


def _print_report(out: dict) -> None:
    slow = f"{out['lower']} " + (f"behind a {out['delay_ms']:g} ms proxy" if out["lower"] == "redis"
                                 else f"with {out['fs_entries']} entries")
    print(f"kvtier bench store: {out['clients']} clients, {out['rounds']} rounds x {out['duration_s']:g} s "
          f"per setting; slow lower tier: {slow}")
    print(f"{'setting':8} {'hits':>8} {'p50 us':>8} {'p99 us':>8} {'max us':>9} {'puts':>6} {'deletes':>8} "
          f"{'stats':>6} {'stats p99 ms':>13} {'misses':>7}")
    for name, s in out["settings"].items():
        print(f"{name:8} {s['ram_hits']:>8} {s['ram_hit_p50_us']!s:>8} {s['ram_hit_p99_us']!s:>8} "
              f"{s['ram_hit_max_us']!s:>9} {s['puts']:>6} {s['deletes']:>8} {s['stats_calls']:>6} "
              f"{s['stats_p99_ms']!s:>13} {s['misses']:>7}")
    if "p99_ratio" in out:
        verdict = "meets" if out["meets_target"] else "misses"
        print(f"RAM-hit p99 slow/alone: {out['p99_ratio']} (p50 {out['p50_ratio']}); "
              f"{verdict} the <= {TARGET_P99_RATIO} target")

"""``kvtier bench copy``: the connector's page copies (``kvtier.fastcopy``) beside ``np.copyto``.

What a load or a save does on a CPU engine: ``--pages`` pages of ``--page`` bytes, each at a
random place of a ``--span`` buffer (cold memory: a load's arena pages and an engine's blocks are
scattered over gigabytes), copied into random places of another. Per round each method copies
its own freshly drawn pairs (so neither finds the other's pages in the cache), the two in turn,
order alternated, on one thread; reported: each
method's median GB/s over the rounds and the streamed copy's ratio to ``np.copyto`` per round
(median, min, max). ``streaming`` says whether this install has the C extension (without it both
methods are numpy's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvtier import fastcopy
from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.output import emit_json, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page", default="128KiB", help="bytes per page (128KiB: a 16-head bf16 block of 128 tokens)")
    parser.add_argument("--pages", type=int, default=80, help="pages per copy (80: a sliding-window re-read)")
    parser.add_argument("--span", default="1GiB", help="size of the source and of the destination buffer (1GiB)")
    parser.add_argument("--rounds", type=int, default=31, help="rounds; medians are reported (31)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _numpy(pairs) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def measure(page: int, pages: int, span: int, rounds: int, seed: int = 0) -> dict:
    """GB/s per method per round (fresh scattered pairs for each copy), and the per-round ratios."""
    if page < 1:
        raise ConfigError(f"--page {page}: need at least 1 byte")
    slots = span // page
    if pages < 1 or slots < pages or rounds < 1:
        raise ConfigError(f"--span {span} holds {slots} pages of {page} bytes: need --pages (1..{slots}) "
                          f"and --rounds >= 1")
    try:
        src = np.ones(span, dtype=np.uint8)  # touched: no page faults in the timed copies
        dst = np.ones(span, dtype=np.uint8)
    except MemoryError:
        raise ConfigError(f"--span {span}: cannot allocate two buffers of that size") from None
    rng = np.random.default_rng(seed)
    methods = {"np.copyto": _numpy, "kvtier.fastcopy": fastcopy.copy_pairs}
    gbps: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(methods)[::-1]
        for name in order:
            s, d = rng.choice(slots, pages, replace=False), rng.choice(slots, pages, replace=False)
            pairs = [(dst[j * page:(j + 1) * page], src[i * page:(i + 1) * page]) for i, j in zip(s, d)]
            start = time.perf_counter()
            methods[name](pairs)
            gbps[name].append(pages * page / (time.perf_counter() - start) / 1e9)
    ratios = [a / b for a, b in zip(gbps["kvtier.fastcopy"], gbps["np.copyto"])]
    return {"page_bytes": page, "pages": pages, "span_bytes": span, "rounds": rounds, "threads": 1,
            "streaming": fastcopy.STREAMING,
            "gbps": {name: round(statistics.median(v), 3) for name, v in gbps.items()},
            "ratio": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                      "max": round(max(ratios), 3)}}


def run(args: argparse.Namespace) -> int:
    report = measure(int(parse_size(args.page, "--page")), args.pages, int(parse_size(args.span, "--span")),
                     args.rounds)
    if args.json:
        emit_json(report)
        return 0
    print_table(["method", "GB/s (median, one core)"], [[k, v] for k, v in report["gbps"].items()],
                title=f"{report['pages']} scattered pages of {report['page_bytes']} bytes, {report['rounds']} rounds"
                      f" (streaming stores: {'yes' if report['streaming'] else 'no, the C extension is not built'})")
    r = report["ratio"]
    print(f"kvtier.fastcopy / np.copyto per round: median {r['median']}, min {r['min']}, max {r['max']}")
    return 0

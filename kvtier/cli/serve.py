"""``kvtier serve --config FILE``: run the per-node KV cache server until SIGTERM/SIGINT.

The config file (YAML or JSON)::

    listen: unix:///run/kvtier/kvtier.sock   # or tcp://0.0.0.0:7300 (then token is required)
    token: ...                               # never logged
    metrics: 127.0.0.1:9400                  # /metrics and /healthz over HTTP (optional)
    staging: 256MiB                          # shared write staging area
    shm_dir: /dev/shm
    store:                                   # a TieredStore config; the first tier is the shared arena
      tiers:
        - {type: ram, capacity: 8GiB}
        - {type: disk, path: /var/cache/kvtier, capacity: 200GiB}
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``serve``."""
    p = sub.add_parser("serve", help="run the per-node KV cache server shared by several engines",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML/JSON file (listen, token, metrics, store)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the server, print one ready line on stderr, serve until a signal arrives."""
    from kvtier.config import load_mapping
    from kvtier.server.server import CacheServer, ServeConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServeConfig.from_mapping(load_mapping(args.config))
    server = CacheServer(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        metrics = f", metrics http://{server.metrics_address}" if server.metrics_address else ""
        print(f"kvtier serve: ready on {server.address}{metrics}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        server.close()
    return 0

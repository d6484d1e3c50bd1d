"""``kvtier serve --config FILE``: run the per-node KV cache server until SIGTERM/SIGINT.

The config file (YAML or JSON)::

    listen: unix:///run/kvtier/kvtier.sock   # default for root; else $XDG_RUNTIME_DIR/kvtier/kvtier.sock
                                             # or tcp://0.0.0.0:7300 (then token is required)
    token: ...                               # never logged
    metrics: 127.0.0.1:9400                  # /metrics and /healthz over HTTP (optional; port 0: any free)
    metrics_max_connections: 8               # metrics requests served at once; more get 503 at once
    metrics_request_timeout_s: 5             # the whole of one metrics request, however slowly it comes
    staging: 256MiB                          # shared write staging area
    shm_dir: /dev/shm
    max_connections: 256                     # open connections at once
    max_unauthenticated: 32                  # connections at once still before hello
    hello_timeout_s: 5                       # a connection must say hello within this
    lease_timeout_s: 30                      # a read lease not released by then is released
    max_leases_per_client: 64
    client_staging_fraction: 0.25            # share of staging one connection may hold
    store:                                   # a TieredStore config; the first tier is the shared arena
      tiers:
        - {type: ram, capacity: 8GiB}
        - {type: disk, path: /var/cache/kvtier, capacity: 200GiB}

Once every listener accepts connections it prints one line on stderr, the ready line:

    kvtier serve: ready on ADDRESS[, metrics http://HOST:PORT]

with the addresses actually bound (a port 0 resolved). A start that cannot happen (listen path
taken by a live server or by a file, unsafe socket directory, no room for the shared memory), or
a config file that is wrong or hostile (over 1 MiB, over 20,000 values with its YAML aliases
expanded, nested over 64 levels), prints one line naming the problem and exits 2; the token is
never part of a message.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``serve``."""
    p = sub.add_parser("serve", help="run the per-node KV cache server shared by several engines",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML/JSON file (listen, token, metrics, store)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="logging level: " + ", ".join(LOG_LEVELS) + " (default INFO)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the server, print the ready line on stderr once every listener accepts connections,
    serve until SIGTERM/SIGINT. Start errors are KVTierErrors (one line, exit 2, via ``main``)."""
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

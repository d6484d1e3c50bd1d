"""``kvtier route``: run the KV-cache-aware router in front of vLLM servers until SIGTERM/SIGINT.

    kvtier route --engine http://a:8000 --engine http://b:8000 \\
        --kv-events tcp://a:5557 --kv-events tcp://b:5557 --tokenizer /models/tok --port 9000

``--kv-events``/``--kv-replay`` pair with ``--engine`` by position, or name it: URL=ENDPOINT.
Config file (YAML/JSON; flags win)::

    engines:
      - {url: http://a:8000, kv_events: tcp://a:5557, kv_replay: tcp://a:5558}
    tokenizer: /models/tok
    prefix_weight: 2.0
    load_weight: 1.0
    tier_weights: {GPU: 1.0, CPU: 0.8, DISK: 0.5, SERVER: 0.4, FS: 0.3, REDIS: 0.3, S3: 0.25}
    shared_media: [REDIS, S3, FS, SERVER]
    speculative_ttl_s: 5
    balance_ratio: 1.5                      # request-share guard over the last balance_window decisions
    balance_slack: 2
    health_interval_s: 1
    # the front door (defaults shown)
    first_byte_timeout_s: 300               # an engine's first response byte, else 504
    stream_idle_timeout_s: 60               # longest gap in a relayed response (either side)
    header_timeout_s: 10                    # a request line and headers, from their first byte
    body_timeout_s: 30                      # a request body, from its headers, else 408
    keepalive_timeout_s: 15                 # an idle client connection
    max_body_bytes: 32MiB                   # else 413
    max_body_bytes_total: 512MiB            # all bodies held at once, else 503
    max_connections: 1024                   # lowered to fit the open-file limit
    max_route_tokens: 262144                # tokens of a prompt keyed for routing

Engine URLs may carry credentials (http://user:pass@host:8000): they go to that engine as Basic
auth (replacing a client's Authorization header) and are never shown.

When it listens it prints ``kvtier route: ready on http://HOST:PORT`` on stderr (the bound port, also
with ``--port 0``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Callable


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``route``."""
    p = sub.add_parser("route", help="route OpenAI requests to the vLLM engine that holds their prefix",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", default=[], metavar="URL", help="an engine's base URL (repeat)")
    p.add_argument("--kv-events", action="append", default=[], metavar="[URL=]ENDPOINT",
                   help="an engine's ZMQ KV event endpoint (repeat; by position or URL=)")
    p.add_argument("--kv-replay", action="append", default=[], metavar="[URL=]ENDPOINT",
                   help="an engine's KV event replay endpoint (repeat; by position or URL=)")
    p.add_argument("--config", help="YAML/JSON config file (flags override it)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--tokenizer", help="tokenizer directory of the served model")
    p.add_argument("--block-size", type=int, help="index block size in tokens (default: from the events)")
    p.add_argument("--prefix-weight", type=float, help="weight of the prefix score (default 2.0)")
    p.add_argument("--load-weight", type=float, help="weight of the load score (default 1.0)")
    p.add_argument("--speculative-ttl", type=float, dest="speculative_ttl_s", help="seconds (default 5)")
    p.add_argument("--balance-ratio", type=float, help="request-share guard, 0 = off (default 1.5)")
    p.add_argument("--retries", type=int, help="other engines to try before the first byte (default 1)")
    p.add_argument("--first-byte-timeout", type=float, dest="first_byte_timeout_s",
                   help="seconds an engine has to send its first response byte, else 504 (default 300)")
    p.add_argument("--stream-idle-timeout", type=float, dest="stream_idle_timeout_s",
                   help="longest gap in a relayed response, either side, before it is cut (default 60)")
    p.add_argument("--max-body-bytes", help="largest request body, else 413 (default 32MiB)")
    p.add_argument("--max-connections", type=int, help="client connections at most (default 1024)")
    p.add_argument("--log-decisions", action="store_true", default=None,
                   help="log one JSON line per decision (engine, each score)")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level (default INFO)")
    p.set_defaults(func=run)


_OVERRIDES = ("host", "port", "tokenizer", "block_size", "prefix_weight", "load_weight",
              "speculative_ttl_s", "balance_ratio", "retries", "log_decisions", "first_byte_timeout_s",
              "stream_idle_timeout_s", "max_body_bytes", "max_connections")


def build_config(args: argparse.Namespace):
    """The ``RouteConfig`` from the file (if any) with the flags laid over it."""
    from kvtier.route.config import load_file, merge_flags

    base = load_file(args.config) if args.config else {}
    return merge_flags(base, args.engine, args.kv_events, args.kv_replay,
                       {name: getattr(args, name) for name in _OVERRIDES})


# what ``kvtier route`` needs beyond kvtier's own dependencies: all of it ships with vLLM
_NEEDS = {"aiohttp", "zmq", "msgspec", "prometheus_client", "yaml", "transformers", "tokenizers"}


def run(args: argparse.Namespace) -> int:
    try:
        import kvtier.route.proxy  # noqa: F401  (fails early, in one line, when a dependency is missing)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _NEEDS:
            raise
        print(f"kvtier route: error: needs the module {exc.name!r}, which is not installed: install vLLM "
              "(it brings aiohttp, pyzmq, msgspec, prometheus_client and transformers)", file=sys.stderr)
        return 2
    config = build_config(args)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvtier.route.tokens import PromptTokenizer

    tokenizer = PromptTokenizer.load(config.tokenizer)
    return asyncio.run(_main(config, tokenizer))


async def _main(config, tokenizer) -> int:
    from kvtier.route.proxy import serve

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_LoopErrors(logging.getLogger("kvtier.route")))
    ready = loop.create_future()
    task = asyncio.create_task(serve(config, tokenizer, ready))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and not ready.cancelled():
        host, port = ready.result()
        print(f"kvtier route: ready on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        await task
    except asyncio.CancelledError:
        pass
    except OSError as exc:
        print(f"kvtier route: error: cannot listen on {config.host}:{config.port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    return 0


class _LoopErrors:
    """The event loop's exception handler: an error (a failed ``accept``, a transport error) is
    one log line without a traceback, and the same message at most once per second, the repeats
    counted in its next line. Past the file-descriptor limit asyncio retries ``accept`` up to its
    backlog in one tick and reports each failure: without this, one burst of clients writes a
    hundred lines.

    Bounded: at most ``max_messages`` distinct messages (each cut to ``MESSAGE_CHARS``) are
    remembered, those not logged for ``interval_s`` are forgotten first; past that (asyncio's
    "Exception in callback <handle>" names objects by address, so messages can all differ), an
    error is counted, not logged, and the count is said at most once per ``interval_s`` (and in
    the next line logged)."""

    MESSAGE_CHARS = 500

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0, max_messages: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self._interval_s = interval_s
        self.max_messages = max_messages
        self._last: dict[str, float] = {}  # message -> when it was last logged
        self._quiet: dict[str, int] = {}  # message -> repeats not logged since
        self._dropped = 0  # errors not logged past the bound (and repeats of forgotten messages)
        self._dropped_said = -interval_s  # when the dropped count was last logged

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", "event loop error"))[:self.MESSAGE_CHARS]
        now = self._clock()
        if message not in self._last and len(self._last) >= self.max_messages:
            self._forget(now)
            if len(self._last) >= self.max_messages:
                self._dropped += 1
                if now - self._dropped_said >= self._interval_s:
                    self._dropped_said = now
                    self._log.error("%d event loop errors not logged (more than %d distinct messages)",
                                    self._dropped, self.max_messages)
                    self._dropped = 0
                return
        if now - self._last.get(message, -self._interval_s) < self._interval_s:
            self._quiet[message] = self._quiet.get(message, 0) + 1
            return
        exc = context.get("exception")
        detail = f": {type(exc).__name__}: {str(exc)[:self.MESSAGE_CHARS]}" if exc is not None else ""
        quiet = self._quiet.pop(message, 0)
        more = f" ({quiet} more since the last line)" if quiet else ""
        if self._dropped:
            more += f" ({self._dropped} other event loop errors not logged)"
            self._dropped = 0
        self._last[message] = now
        self._log.error("%s%s%s", message, detail, more)

    def _forget(self, now: float) -> None:
        """Forget the messages not logged for ``interval_s`` (their repeats join ``_dropped``)."""
        for message, when in list(self._last.items()):
            if now - when >= self._interval_s:
                del self._last[message]
                self._dropped += self._quiet.pop(message, 0)

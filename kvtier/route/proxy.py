"""The OpenAI-compatible HTTP router (aiohttp): picks an engine per request and relays it.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (bodies relayed as they
are; streamed responses passed through chunk by chunk as they arrive), ``GET /v1/models`` (from
a healthy engine, at most 8 MiB of it, else 502), ``GET /health`` (200 with at least one engine
in, else 503; JSON per engine), ``GET /metrics`` (Prometheus text, a registry per router).

Contracts
---------
* Engines are probed with ``GET /health`` every ``health_interval_s``; after ``unhealthy_after``
  failed probes in a row, or at once when a request cannot connect to it, an engine is taken out
  and its index and speculative entries are dropped. After ``healthy_after`` good probes in a row
  it is re-admitted and its index is rebuilt from its event replay.
* A request that fails before the first byte of the engine's response (cannot connect, the
  connection drops, HTTP 502/503/504, or the engine is taken out while the request waits) is
  sent to the next-best engine, up to ``retries`` more times; once bytes have reached the client, a failure ends the client's response (the client
  sees it), never a duplicate.
* Deadlines per upstream request: the engine's first response byte within
  ``first_byte_timeout_s`` (else the client gets a 504 and the upstream request is closed), then
  no gap longer than ``stream_idle_timeout_s`` (else the client's response is cut; so is it when
  the client takes no bytes for as long: a client that stops reading). A client that
  disconnects cancels its upstream request (the engine sees the connection close). Every path
  gives back the request's share of the engine's load (``in_flight`` returns to 0).
* The front door (``serve``): request heads within ``header_timeout_s``, bodies within
  ``body_timeout_s`` (408) and at most ``max_body_bytes`` (413), bodies held at once within
  ``max_body_bytes_total`` (503), idle connections closed after ``keepalive_timeout_s``, at most
  ``max_connections`` connections (``guard.ConnectionGuard``), aiohttp's limits on a request
  line and a header field (8,190 bytes each) and on the number of headers (128). A malformed
  body (not a JSON object, nested too deeply, a prompt of the wrong type or token ids outside
  [0, 2**32)) is a 400 with one line, never a 500. Tokenizing and keying run in worker threads;
  only the first ``max_route_tokens`` tokens of a prompt are keyed (and a text prompt is cut at
  8 characters per such token before tokenizing, a chat's messages at as many characters
  of JSON).
* Headers: hop-by-hop headers (``Connection`` and every header it names, ``Keep-Alive``,
  ``Proxy-Authenticate``, ``Proxy-Authorization``, ``TE``, ``Trailer``, ``Transfer-Encoding``,
  ``Upgrade``; RFC 9110 7.6.1) are dropped in both directions, with ``Host``,
  ``Content-Length`` and ``Content-Encoding`` (this hop recomputes them). An engine URL's
  credentials (``http://user:pass@host``) are sent to that engine as Basic auth, replacing a
  client's ``Authorization``; without them the client's ``Authorization`` is passed on. The
  credentials never appear in ``/health``, metric labels, logs or error messages. An engine's
  redirect (3xx) is relayed to the client as it came, never followed.
* With ``log_decisions``, one JSON line per decision on the ``kvtier.route.decisions`` logger.
* An engine's KV event subscriber that stops with an error is logged and restarted (backing off
  up to 10 s), counted in ``kvtier_route_kv_subscriber_restarts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from multidict import CIMultiDict

from kvtier.route.body import BadRequest, TokenIds, parse_body
from kvtier.route.config import RouteConfig
from kvtier.route.events import EventSubscriber
from kvtier.route.guard import ConnectionGuard
from kvtier.route.index import PrefixIndex, chunk_keys
from kvtier.route.score import Decision, LoadTracker, Scorer, Speculative
from kvtier.route.tokens import PromptTokenizer

log = logging.getLogger("kvtier.route")
decisions_log = logging.getLogger("kvtier.route.decisions")
_RETRY_STATUS = frozenset({502, 503, 504})
#: hop-by-hop headers (RFC 9110 7.6.1; Proxy-Connection is its non-standard twin)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
#: end-to-end headers this hop recomputes (the body is relayed decoded, its length may change)
_RECOMPUTED = frozenset({"host", "content-length", "content-encoding", "expect"})
_FD_RESERVE = 64  # descriptors kept free beside client and upstream connections (+8 per engine)
_BACKLOG = 128  # also how many connections asyncio accepts in one go, before any excess is closed
_TEXT_CHARS_PER_TOKEN = 8  # a text prompt is cut at this many characters per routed token
_MAX_MODELS_BYTES = 8 << 20  # an engine's /v1/models answer (a few KiB in practice)


def relay_headers(headers: Mapping[str, str]) -> CIMultiDict:
    """``headers`` without hop-by-hop ones (those listed above and every header ``Connection``
    names) nor those this hop recomputes; repeated headers are kept."""
    getall = getattr(headers, "getall", None)
    connection = getall("Connection", ()) if getall else [headers.get("Connection", "")]
    named = {token.strip().lower() for value in connection for token in value.split(",")}
    drop = HOP_BY_HOP | _RECOMPUTED | named
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in drop)


class _Refused(Exception):
    """A request the front door answers itself: ``status`` and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ByteBudget:
    """Bytes of request bodies held at once (taken before reading, given back at the end)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


@dataclass
class EngineState:
    """Health bookkeeping of one engine."""

    url: str
    healthy: bool = True
    fails: int = 0
    oks: int = 0
    ejected_at: float | None = None


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_route_requests", "Requests relayed, by engine and outcome",
                                ["engine", "outcome"], registry=r)
        self.retries = Counter("kvtier_route_retries", "Requests sent again to another engine", registry=r)
        self.events = Counter("kvtier_route_kv_events", "KV events applied, by engine and type",
                              ["engine", "type"], registry=r)
        self.ejections = Counter("kvtier_route_ejections", "Engines taken out", ["engine"], registry=r)
        self.in_flight = Gauge("kvtier_route_in_flight", "Requests in flight per engine", ["engine"], registry=r)
        self.healthy = Gauge("kvtier_route_engine_healthy", "1 when the engine is in", ["engine"], registry=r)
        self.index_keys = Gauge("kvtier_route_index_keys", "Content keys in the prefix index", registry=r)
        self.closed = Counter("kvtier_route_connections_closed",
                              "Client connections the front door closed or refused, by reason", ["reason"], registry=r)
        self.connections = Gauge("kvtier_route_client_connections", "Client connections open", registry=r)
        self.restarts = Counter("kvtier_route_kv_subscriber_restarts", "KV event subscribers restarted after an error",
                                ["engine"], registry=r)
        self.prefix = Histogram("kvtier_route_prefix_share", "Share of the prompt's blocks the chosen engine holds",
                                buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)


class Router:
    """One router instance (no module-level state): ``app()`` gives its aiohttp application."""

    def __init__(self, config: RouteConfig, tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or PromptTokenizer(None)
        self.index = PrefixIndex(config.max_index_keys, config.block_size)
        self.load = LoadTracker()
        self.speculative = Speculative(config.speculative_ttl_s, config.max_index_keys)
        self.scorer = Scorer(config, self.index, self.load, self.speculative)
        # engines are named by their URL without credentials; the credentials go in ``_auth``
        self.engines = {e.name: EngineState(e.name) for e in config.engines}
        self._auth = {e.name: e.authorization for e in config.engines}
        self.metrics = _Metrics()
        self.guard: ConnectionGuard | None = None  # set by ``serve``
        self._budget = _ByteBudget(config.max_body_bytes_total)
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer_lock = threading.Lock()  # a tokenizer is not safe to call from two threads
        self.subscribers: dict[str, EventSubscriber] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._out: dict[str, asyncio.Event] = {}
        for url in self.engines:
            self.metrics.healthy.labels(url).set(1)

    # --- lifecycle -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application; starting it starts health checks and event subscribers."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._mark_requests])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-route-keys")
        for spec in self.config.engines:
            if spec.kv_events:
                sub = EventSubscriber(spec.name, spec.kv_events, self.index, spec.kv_replay,
                                      spec.topic, self.config.replay_timeout_s, self._count_events)
                self.subscribers[sub.engine] = sub
                self._tasks.append(asyncio.create_task(self._supervise(sub), name=f"kv-events {sub.engine}"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))

    async def _on_cleanup(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _supervise(self, sub: EventSubscriber) -> None:
        """Run ``sub`` and start it again whenever it stops with an error (logged, counted)."""
        delay = 0.5
        while True:
            started = time.monotonic()
            try:
                await sub.run()
                reason = "its stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (any fault: the index must not go stale silently)
                reason = f"{type(exc).__name__}: {exc}"
            delay = 0.5 if time.monotonic() - started > 30 else delay
            self.metrics.restarts.labels(sub.engine).inc()
            log.error("kv events of %s stopped (%s); restarting in %.1f s", sub.engine, reason, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 10.0)

    @web.middleware
    async def _mark_requests(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Tell the connection guard when a request's handler runs (its head has arrived)."""
        guard = self.guard
        if guard is None:
            return await handler(request)
        guard.request_started(request.transport)
        try:
            return await handler(request)
        finally:
            guard.request_ended(request.transport)

    def count_close(self, reason: str) -> None:
        """A connection the front door closed or refused (the guard's and the body's limits)."""
        self.metrics.closed.labels(reason).inc()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP session to the engines; it exists between the app's startup and cleanup."""
        if self._session is None:
            raise RuntimeError("kvtier route: the router's app has not started (no HTTP session)")
        return self._session

    # --- health ----------------------------------------------------------------------------
    def healthy(self) -> list[str]:
        """Engines in, in configured order."""
        return [u for u, s in self.engines.items() if s.healthy]

    def eject(self, url: str, reason: str) -> None:
        """Take ``url`` out now and drop its index entries (idempotent)."""
        state = self.engines[url]
        state.oks = 0
        if not state.healthy:
            return
        state.healthy = False
        state.ejected_at = time.monotonic()
        self._out_event(url).set()
        dropped = self.index.clear_engine(url)
        self.speculative.clear_engine(url)
        self.scorer.forget(url)
        sub = self.subscribers.get(url)
        if sub is not None:
            sub.paused = True
        self.metrics.ejections.labels(url).inc()
        self.metrics.healthy.labels(url).set(0)
        log.warning("engine %s out (%s); %d index keys dropped", url, reason, dropped)

    def readmit(self, url: str) -> None:
        """Put ``url`` back and rebuild its index from replay."""
        state = self.engines[url]
        if state.healthy:
            return
        state.healthy, state.fails, state.ejected_at = True, 0, None
        self._out.pop(url, None)
        sub = self.subscribers.get(url)
        if sub is not None:
            sub.paused = False
            sub.resync()
        self.metrics.healthy.labels(url).set(1)
        log.warning("engine %s back in", url)

    async def _probe(self, url: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with self.session.get(url + "/health", timeout=timeout, headers=self._auth_headers(url),
                                        allow_redirects=False) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _health_loop(self) -> None:
        cfg = self.config
        while True:
            results = await asyncio.gather(*(self._probe(u) for u in self.engines))
            for url, ok in zip(list(self.engines), results):
                state = self.engines[url]
                if ok:
                    state.fails, state.oks = 0, state.oks + 1
                    if not state.healthy and state.oks >= cfg.healthy_after:
                        self.readmit(url)
                else:
                    state.oks, state.fails = 0, state.fails + 1
                    if state.healthy and state.fails >= cfg.unhealthy_after:
                        self.eject(url, f"{state.fails} failed health checks")
            await asyncio.sleep(cfg.health_interval_s)

    def _count_events(self, engine: str, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            self.metrics.events.labels(engine, kind).inc(n)

    # --- handlers --------------------------------------------------------------------------
    async def _health(self, _request: web.Request) -> web.Response:
        body = {"healthy": self.healthy(), "engines": {u: {"healthy": s.healthy, "in_flight": self.load.in_flight(u)}
                                                        for u, s in self.engines.items()},
                "index_keys": len(self.index), "block_size": self.index.block_size,
                "connections": len(self.guard) if self.guard is not None else None}
        return web.json_response(body, status=200 if body["healthy"] else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics.index_keys.set(len(self.index))
        if self.guard is not None:
            self.metrics.connections.set(len(self.guard))
        for url in self.engines:
            self.metrics.in_flight.labels(url).set(self.load.in_flight(url))
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _request: web.Request) -> web.StreamResponse:
        session = self.session
        for url in self.healthy():
            try:
                async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10),
                                       headers=self._auth_headers(url), allow_redirects=False) as resp:
                    body = await _read_at_most(resp, _MAX_MODELS_BYTES)
                    if body is None:
                        return _error(502, f"engine {url} answered /v1/models with more than "
                                           f"{_MAX_MODELS_BYTES >> 20} MiB")
                    return web.Response(body=body, status=resp.status, content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.eject(url, "no answer to /v1/models")
        return _error(503, "no healthy engine")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/chat/completions", chat=True)

    # --- routing and relaying --------------------------------------------------------------
    def _auth_headers(self, engine: str) -> dict[str, str]:
        """The Authorization header of ``engine``'s URL credentials ({} without them)."""
        auth = self._auth.get(engine)
        return {"Authorization": auth} if auth else {}

    def keys_of(self, body: dict[str, Any], chat: bool) -> tuple[list[bytes], int]:
        """(content keys of the prompt's first full blocks, up to ``max_route_tokens`` tokens;
        the prompt's token count, estimated when a text prompt was cut); ([], 0) when unknown.
        Synchronous and CPU-bound: ``prompt_keys`` runs it in a worker thread."""
        limit = self.config.max_route_tokens
        budget = _TEXT_CHARS_PER_TOKEN * limit
        cut, scale = False, 1.0
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not chat and isinstance(prompt, str) and len(prompt) > budget:
            body, cut, scale = dict(body, prompt=prompt[:budget]), True, len(prompt) / budget
        if chat and isinstance(body.get("messages"), list):
            messages, kept, total = _cut_messages(body["messages"], budget)
            if kept < total:
                body, cut, scale = dict(body, messages=messages), True, total / max(kept, 1)
        try:
            if chat or isinstance(prompt, str):
                with self._tokenizer_lock:
                    ids = self.tokenizer.chat_ids(body) if chat else self.tokenizer.completion_ids(body)
            else:
                ids = self.tokenizer.completion_ids(body)
        except Exception as exc:  # noqa: BLE001  (a template or tokenizer failure must not fail the request)
            log.debug("tokenizing failed: %s", exc)
            return [], 0
        n_tokens = len(ids)
        keys = chunk_keys(ids[:limit], self.index.block_size or self.config.block_size)
        if cut:  # the cut may split the last word: its block may differ from the whole prompt's
            keys = keys[:-1]
            n_tokens = int(n_tokens * scale)
        return keys, n_tokens

    async def prompt_keys(self, body: dict[str, Any], chat: bool) -> tuple[list[bytes], int]:
        """``keys_of`` in a worker thread (tokenizing a long prompt must not stall the loop)."""
        if self._pool is None:
            return self.keys_of(body, chat)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.keys_of, body, chat)

    def route(self, keys: list[bytes], n_tokens: int, exclude: set[str]) -> Decision | None:
        """Score the healthy engines not in ``exclude`` and log the decision."""
        candidates = [u for u in self.healthy() if u not in exclude]
        decision = self.scorer.choose(candidates, keys, n_tokens)
        if decision is not None and self.config.log_decisions:
            decisions_log.info(json.dumps({"engine": decision.engine, "blocks": decision.blocks,
                                           "tokens": n_tokens, "retry": bool(exclude),
                                           "placement": decision.placement,
                                           "scores": [s.as_dict() for s in decision.scores]}))
        return decision

    def _reserve(self, request: web.Request) -> int:
        """Bytes of the body budget this request needs (its Content-Length, else the maximum);
        _Refused with 413 (too large) or 503 (the budget is spent)."""
        cfg = self.config
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            self.count_close("body_too_large")
            raise _Refused(413, f"request body of {length} bytes is over the limit of {cfg.max_body_bytes}")
        need = length if length is not None else cfg.max_body_bytes
        if not self._budget.take(need):
            self.count_close("body_budget")
            raise _Refused(503, "router busy: too many request body bytes held at once; retry later")
        return need

    async def _read_body(self, request: web.Request) -> bytes:
        """The whole body within ``body_timeout_s`` and ``max_body_bytes`` (408 / 413)."""
        cfg = self.config
        buf = bytearray()
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                while True:
                    chunk = await request.content.readany()
                    if not chunk:
                        return bytes(buf)
                    buf += chunk
                    if len(buf) > cfg.max_body_bytes:
                        self.count_close("body_too_large")
                        raise _Refused(413, f"request body is over the limit of {cfg.max_body_bytes} bytes")
        except TimeoutError as exc:
            self.count_close("body_timeout")
            raise _Refused(408, f"request body did not arrive within {cfg.body_timeout_s:g} s") from exc

    async def _relay(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        try:
            reserved = self._reserve(request)
        except _Refused as exc:
            return _error(exc.status, str(exc), close=True)
        try:
            try:
                raw = await self._read_body(request)
            except _Refused as exc:
                return _error(exc.status, str(exc), close=True)
            except (web.RequestPayloadError, aiohttp.ClientError, ConnectionError) as exc:  # a broken body
                return _error(400, f"request body could not be read: {type(exc).__name__}", close=True)
            count = None
            try:
                body = parse_body(raw, chat)
                if isinstance(body.get("prompt"), TokenIds):  # long: checked in slices, the head kept
                    body["prompt"], count = await body["prompt"].read(self.config.max_route_tokens)
            except BadRequest as exc:
                return _error(400, str(exc))
            keys, n_tokens = await self.prompt_keys(body, chat)
            n_tokens = n_tokens if count is None else count
            return await self._dispatch(request, path, raw, keys, n_tokens)
        finally:
            self._budget.give(reserved)

    async def _dispatch(self, request: web.Request, path: str, raw: bytes, keys: list[bytes],
                        n_tokens: int) -> web.StreamResponse:
        headers = relay_headers(request.headers)
        tried: set[str] = set()
        last_error = "no healthy engine"
        for attempt in range(self.config.retries + 1):
            decision = self.route(keys, n_tokens, tried)
            if decision is None:
                break
            if attempt:
                self.metrics.retries.inc()
            engine = decision.engine
            tried.add(engine)
            self.scorer.commit(decision, keys)
            self.metrics.prefix.observe(decision.matched_blocks() / decision.blocks if decision.blocks else 0.0)
            ticket = self.load.start(engine, self.scorer.uncached_tokens(decision, n_tokens))
            engine_headers = CIMultiDict(headers)
            engine_headers.update(self._auth_headers(engine))  # the URL's credentials win
            try:
                outcome, response = await self._forward(request, engine + path, raw, engine_headers, ticket)
            except asyncio.CancelledError:  # the client went away: the upstream request is closed
                self.metrics.requests.labels(engine, "client_gone").inc()
                raise
            finally:
                self.load.finish(ticket)
            self.metrics.requests.labels(engine, outcome).inc()
            if response is not None:
                return response
            last_error = f"engine {engine}: {outcome}"
        return _error(503, f"no engine answered ({last_error})")

    async def _forward(self, request: web.Request, url: str, raw: bytes, headers: CIMultiDict,
                       ticket: Any) -> tuple[str, web.StreamResponse | None]:
        """Send one attempt. (outcome, response); response None means "retry elsewhere".

        Waiting for the first byte ends early when the engine is taken out meanwhile (a hung
        engine's queued requests go elsewhere once health checks give up on it), and at
        ``first_byte_timeout_s`` (a 504, not retried: the engine may still be working on it)."""
        engine = ticket.engine
        deadline = self.config.first_byte_timeout_s
        opening = asyncio.ensure_future(self._open(url, raw, headers))
        taken_out = asyncio.ensure_future(self._out_event(engine).wait())
        try:
            done, _ = await asyncio.wait({opening, taken_out}, timeout=deadline,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: the engine's answer is not needed
            opening.cancel()
            raise
        finally:
            taken_out.cancel()
        if not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
            if not done:
                return "first_byte_timeout", _error(504, f"engine {engine} sent no response within {deadline:g} s")
            return "engine_out_before_first_byte", None
        outcome, upstream, first = opening.result()
        if upstream is None:
            self.eject(engine, outcome)
            return outcome, None
        finished = False
        try:
            if first is None:
                finished = True
                return f"http_{upstream.status}", None
            self.load.first_byte(ticket)
            outcome, response = await self._stream(request, upstream, first, engine)
            finished = outcome == "ok" or outcome.startswith("http_")
            return outcome, response
        finally:
            if finished:
                upstream.release()
            else:  # cut, timed out or cancelled: close the connection so the engine stops
                upstream.close()

    async def _open(self, url: str, raw: bytes, headers: CIMultiDict) -> tuple[str, Any, bytes | None]:
        """POST and read the first bytes: (outcome, response or None, first bytes or None).
        None response: failed before the first byte (outcome says how); first None: a status to
        retry elsewhere (502/503/504)."""
        try:
            upstream = await self.session.post(url, data=raw, headers=headers, allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"connect_error: {type(exc).__name__}", None, None
        try:
            if upstream.status in _RETRY_STATUS:
                return "http_retry", upstream, None
            return "ok", upstream, await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            upstream.close()
            return f"dropped_before_first_byte: {type(exc).__name__}", None, None
        except asyncio.CancelledError:
            upstream.close()
            raise

    async def _stream(self, request: web.Request, upstream: Any, first: bytes,
                      engine: str) -> tuple[str, web.StreamResponse]:
        """Relay the engine's response from its first bytes on, as they arrive; a gap longer
        than ``stream_idle_timeout_s`` from the engine, or a client that takes no bytes for as
        long (it stopped reading), cuts the client's response and closes the upstream one."""
        response = web.StreamResponse(status=upstream.status)
        for name, value in relay_headers(upstream.headers).items():
            response.headers.add(name, value)
        idle = self.config.stream_idle_timeout_s
        chunk = first
        try:
            await response.prepare(request)
            while chunk:
                try:
                    async with asyncio.timeout(idle):
                        await response.write(chunk)
                except TimeoutError:  # the client stopped reading: it must not hold the engine
                    self.count_close("client_write_timeout")
                    _cut(request)
                    return "client_write_timeout", response
                try:
                    async with asyncio.timeout(idle):
                        chunk = await upstream.content.readany()
                except TimeoutError:  # the engine went silent mid-response
                    log.warning("engine %s sent nothing for %g s mid-response: response cut", engine, idle)
                    _cut(request)
                    return "stream_idle_timeout", response
                except aiohttp.ClientError as exc:  # the engine failed mid-response
                    self.eject(engine, f"response cut: {type(exc).__name__}")
                    _cut(request)
                    return "failed_mid_response", response
            await response.write_eof()
        except (ConnectionError, OSError, aiohttp.ClientConnectionResetError):  # writing failed: the client left
            return "client_gone", response
        return ("ok" if upstream.status < 400 else f"http_{upstream.status}"), response

    def _out_event(self, engine: str) -> asyncio.Event:
        """Set while ``engine`` is out (a fresh event after each re-admission)."""
        event = self._out.get(engine)
        if event is None:
            event = self._out[engine] = asyncio.Event()
        return event


async def _read_at_most(resp: Any, limit: int) -> bytes | None:
    """The whole body of an engine's ``resp``, or None once it passes ``limit`` bytes (the rest
    is never read: the connection is closed with the response)."""
    buf = bytearray()
    while chunk := await resp.content.readany():
        buf += chunk
        if len(buf) > limit:
            resp.close()
            return None
    return bytes(buf)


def _cut_messages(messages: list, budget: int) -> tuple[list, int, int]:
    """(the chat ``messages`` cut to about ``budget`` characters of JSON, the characters kept,
    the characters in all): whole messages in order while they fit, then the first one that does
    not with its string content cut to the rest of the budget (one with other content is left
    out), and none after it. Tokenizing is then bounded like a text prompt's."""
    sizes = [len(msgspec.json.encode(m)) for m in messages]
    total = sum(sizes)
    if total <= budget:
        return messages, total, total
    kept: list = []
    used = 0
    for message, size in zip(messages, sizes):
        if used + size > budget:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str) and used < budget:
                kept.append(dict(message, content=content[:budget - used]))
                used = budget
            break
        kept.append(message)
        used += size
    return kept, used, total


def _cut(request: web.Request) -> None:
    """End the client's connection: it sees a cut response, never a silent end."""
    if request.transport is not None:
        request.transport.close()


def _error(status: int, message: str, close: bool = False) -> web.Response:
    response = web.json_response({"error": {"message": message, "type": "router_error", "code": status}},
                                 status=status)
    if close:  # the body was not read: the connection cannot carry another request
        response.force_close()
    return response


class _OneLineServerLog:
    """The logger aiohttp's request handlers get: an error handling a request (a malformed
    request line, a header too long, a broken chunk) is one line without a traceback, at most
    one per second (the rest counted in the next line), so a flood of bad requests cannot flood
    the log."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._last = 0.0
        self._quiet = 0

    def debug(self, *args: Any, **kw: Any) -> None:
        self._log.debug(*args, **kw)

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **_kw: Any) -> None:
        now = time.monotonic()
        if now - self._last < 1.0:
            self._quiet += 1
            return
        detail = ""
        if isinstance(exc_info, BaseException):
            first = str(exc_info).strip().splitlines()
            detail = f": {type(exc_info).__name__}: {' '.join(line.strip() for line in first)[:300]}"
        more = f" ({self._quiet} more since the last line)" if self._quiet else ""
        self._last, self._quiet = now, 0
        self._log.warning("%s%s%s", msg % args if args else msg, detail, more)


def fit_connections(wanted: int, engines: int) -> int:
    """The connection cap that fits the file-descriptor limit: each client connection may need
    an upstream one, plus a reserve, plus one accept burst (``_BACKLOG`` connections accepted
    before the excess among them is closed). Raises the soft limit towards the hard one when it
    can; logs when the cap had to be lowered."""
    try:
        import resource
    except ImportError:  # not POSIX
        return wanted
    reserve = _FD_RESERVE + 8 * engines + _BACKLOG
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * wanted + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
    if soft == resource.RLIM_INFINITY:
        return wanted
    fit = max(1, (soft - reserve) // 2)
    if fit < wanted:
        log.warning("max_connections lowered from %d to %d to fit the open-file limit (%d)", wanted, fit, soft)
    return min(wanted, fit)


async def serve(config: RouteConfig, tokenizer: PromptTokenizer,
                ready: asyncio.Future | asyncio.Event | None = None) -> None:
    """Run a router on ``config.host:config.port`` until cancelled. Once it listens, ``ready``
    is set: a Future gets ``(host, bound port)`` (the port chosen when ``config.port`` is 0)."""
    router = Router(config, tokenizer)
    router.guard = ConnectionGuard(fit_connections(config.max_connections, len(config.engines)),
                                   config.header_timeout_s, router.count_close)
    runner = web.AppRunner(router.app(), access_log=None, handler_cancellation=True,
                           keepalive_timeout=config.keepalive_timeout_s, lingering_time=2.0,
                           shutdown_timeout=10.0, logger=_OneLineServerLog(logging.getLogger("aiohttp.server")))
    await runner.setup()
    server = None
    try:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(router.guard.factory(runner.server), config.host, config.port,
                                          reuse_address=True, backlog=_BACKLOG)
        port = server.sockets[0].getsockname()[1]
        if isinstance(ready, asyncio.Future):
            ready.set_result((config.host, port))
        elif ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()

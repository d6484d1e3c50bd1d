"""The OpenAI-compatible HTTP router (aiohttp): picks an engine per request and relays it.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (bodies relayed as they
are; streamed responses passed through chunk by chunk as they arrive), ``GET /v1/models`` (from
a healthy engine), ``GET /health`` (200 with at least one engine in, else 503; JSON per engine),
``GET /metrics`` (Prometheus text, a registry per router).

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
* With ``log_decisions``, one JSON line per decision on the ``kvtier.route.decisions`` logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.route.config import RouteConfig
from kvtier.route.events import EventSubscriber
from kvtier.route.index import PrefixIndex, chunk_keys
from kvtier.route.score import Decision, LoadTracker, Scorer, Speculative
from kvtier.route.tokens import PromptTokenizer

log = logging.getLogger("kvtier.route")
decisions_log = logging.getLogger("kvtier.route.decisions")
_RETRY_STATUS = frozenset({502, 503, 504})
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                          "content-encoding"})


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
        self.engines = {e.url.rstrip("/"): EngineState(e.url.rstrip("/")) for e in config.engines}
        self.metrics = _Metrics()
        self.subscribers: dict[str, EventSubscriber] = {}
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._out: dict[str, asyncio.Event] = {}
        for url in self.engines:
            self.metrics.healthy.labels(url).set(1)

    # --- lifecycle -------------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application; starting it starts health checks and event subscribers."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
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
        for spec in self.config.engines:
            if spec.kv_events:
                sub = EventSubscriber(spec.url.rstrip("/"), spec.kv_events, self.index, spec.kv_replay,
                                      spec.topic, self.config.replay_timeout_s, self._count_events)
                self.subscribers[sub.engine] = sub
                self._tasks.append(asyncio.create_task(sub.run(), name=f"kv-events {sub.engine}"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))

    async def _on_cleanup(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()

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
            async with self.session.get(url + "/health", timeout=timeout) as resp:
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
                "index_keys": len(self.index), "block_size": self.index.block_size}
        return web.json_response(body, status=200 if body["healthy"] else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.metrics.index_keys.set(len(self.index))
        for url in self.engines:
            self.metrics.in_flight.labels(url).set(self.load.in_flight(url))
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _request: web.Request) -> web.StreamResponse:
        session = self.session
        for url in self.healthy():
            try:
                async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    body = await resp.read()
                    return web.Response(body=body, status=resp.status, content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                self.eject(url, "no answer to /v1/models")
        return _error(503, "no healthy engine")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/chat/completions", chat=True)

    # --- routing and relaying --------------------------------------------------------------
    def prompt_keys(self, body: dict[str, Any], chat: bool) -> tuple[list[bytes], int]:
        """(content keys of the prompt's full blocks, prompt token count); ([], 0) when unknown."""
        try:
            ids = self.tokenizer.chat_ids(body) if chat else self.tokenizer.completion_ids(body)
        except Exception as exc:  # a template or tokenizer failure must not fail the request
            log.debug("tokenizing failed: %s", exc)
            return [], 0
        return chunk_keys(ids, self.index.block_size or self.config.block_size), len(ids)

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

    async def _relay(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            return _error(400, "request body must be a JSON object")
        keys, n_tokens = self.prompt_keys(body, chat)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
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
            try:
                outcome, response = await self._forward(request, engine + path, raw, headers, ticket)
            finally:
                self.load.finish(ticket)
            self.metrics.requests.labels(engine, outcome).inc()
            if response is not None:
                return response
            last_error = f"engine {engine}: {outcome}"
        return _error(503, f"no engine answered ({last_error})")

    async def _forward(self, request: web.Request, url: str, raw: bytes, headers: dict[str, str],
                       ticket: Any) -> tuple[str, web.StreamResponse | None]:
        """Send one attempt. (outcome, response); response None means "retry elsewhere".

        Waiting for the first byte ends early when the engine is taken out meanwhile (a hung
        engine's queued requests go elsewhere once health checks give up on it)."""
        engine = ticket.engine
        opening = asyncio.ensure_future(self._open(url, raw, headers))
        taken_out = asyncio.ensure_future(self._out_event(engine).wait())
        try:
            await asyncio.wait({opening, taken_out}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: the engine's answer is not needed
            opening.cancel()
            raise
        finally:
            taken_out.cancel()
        if not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
            return "engine_out_before_first_byte", None
        outcome, upstream, first = opening.result()
        if upstream is None:
            self.eject(engine, outcome)
            return outcome, None
        try:
            if first is None:
                return f"http_{upstream.status}", None
            self.load.first_byte(ticket)
            return await self._stream(request, upstream, first, engine)
        finally:
            upstream.release()

    async def _open(self, url: str, raw: bytes, headers: dict[str, str]) -> tuple[str, Any, bytes | None]:
        """POST and read the first bytes: (outcome, response or None, first bytes or None).
        None response: failed before the first byte (outcome says how); first None: a status to
        retry elsewhere (502/503/504)."""
        try:
            upstream = await self.session.post(url, data=raw, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"connect_error: {type(exc).__name__}", None, None
        try:
            if upstream.status in _RETRY_STATUS:
                return "http_retry", upstream, None
            return "ok", upstream, await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            upstream.release()
            return f"dropped_before_first_byte: {type(exc).__name__}", None, None
        except asyncio.CancelledError:
            upstream.release()
            raise

    async def _stream(self, request: web.Request, upstream: Any, first: bytes,
                      engine: str) -> tuple[str, web.StreamResponse]:
        """Relay the engine's response from its first bytes on, as they arrive."""
        response = web.StreamResponse(status=upstream.status)
        for name, value in upstream.headers.items():
            if name.lower() not in _HOP_HEADERS:
                response.headers[name] = value
        chunk = first
        try:
            await response.prepare(request)
            while chunk:
                await response.write(chunk)
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the engine failed mid-response
                    self.eject(engine, f"response cut: {type(exc).__name__}")
                    if request.transport is not None:
                        request.transport.close()  # the client sees a cut response, never a silent end
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


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "router_error", "code": status}},
                             status=status)


async def serve(config: RouteConfig, tokenizer: PromptTokenizer, ready: asyncio.Event | None = None) -> None:
    """Run a router on ``config.host:config.port`` until cancelled."""
    router = Router(config, tokenizer)
    runner = web.AppRunner(router.app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

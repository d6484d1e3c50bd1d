"""A stub OpenAI engine of the tests' own (aiohttp, on its own thread and event loop), to put a
real ``kvtier route`` process in front of: it records what reaches it and misbehaves on request.

The client picks the behaviour per request with the ``X-Stub`` header (relayed by the router):
``ok`` (JSON answer, default), ``hang`` (never answers), ``stall`` (a streamed answer whose first
event comes at once and the rest never), ``flood`` (256 MiB streamed), ``hop`` (answers with hop-by-hop headers of its own), ``redirect``
(a 307 to the URL in ``X-Stub-Location``).
A request whose connection the router closes is recorded in ``cancelled``. ``GET /v1/models``
answers a small model list, or ``models_bytes`` bytes of it streamed when that is set (an engine
whose answer never ends in practice).
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from kvtier.harness.services import free_port


class StubEngine:
    """Start with ``start()``, stop with ``stop()``; ``url`` is its base URL."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[dict] = []  # per request: {"path", "headers", "body"}
        self.cancelled: list[str] = []  # X-Stub-Id of requests whose connection went away
        self.models_bytes: int | None = None  # /v1/models: stream this many bytes instead
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> "StubEngine":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.models_bytes is None:
            return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        left = self.models_bytes
        while left > 0:
            await resp.write(b" " * min(left, 1 << 20))
            left -= 1 << 20
        await resp.write_eof()
        return resp

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        mode = request.headers.get("X-Stub", "ok")
        ident = request.headers.get("X-Stub-Id", "")
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": raw[:1000]})
        try:
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "stall":
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"i": 0}\n\n')
                await asyncio.sleep(3600)
            if mode == "flood":  # 256 MiB streamed as fast as the reader takes it
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for _ in range(4096):
                    await resp.write(b"x" * 65536)
                await resp.write_eof()
                return resp
            if mode == "redirect":  # 307 to the URL in X-Stub-Location (a client must not follow it blindly)
                raise web.HTTPTemporaryRedirect(request.headers.get("X-Stub-Location", "/"))
            if mode == "hop":
                return web.json_response({"ok": True}, headers={
                    "Connection": "X-Engine-Hop", "X-Engine-Hop": "1", "Keep-Alive": "timeout=5",
                    "Proxy-Authenticate": "Basic", "Trailer": "X-T", "Upgrade": "h2c", "X-End-To-End": "1"})
            return web.json_response({"ok": True, "bytes": len(raw)})
        except asyncio.CancelledError:
            self.cancelled.append(ident)
            raise


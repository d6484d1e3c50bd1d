"""The HTTP router against fake vLLM servers (aiohttp apps in this process): relaying, streaming
as it arrives, routing by the index, retries before the first byte, ejection and re-admission,
health, models and metrics. No engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from kvtier.harness.services import free_port
from kvtier.route.config import EngineSpec, RouteConfig
from kvtier.route.index import chunk_keys
from kvtier.route.proxy import Router
from kvtier.route.tokens import PromptTokenizer

BS = 4


class FakeEngine:
    """A stand-in vLLM server: ``mode`` is "ok", "drop" (close before answering), "hang" or "503";
    ``healthy`` drives /health. Streams ``chunks`` SSE events ``gap`` s apart."""

    def __init__(self, name: str, chunks: int = 3, gap: float = 0.3) -> None:
        self.name, self.chunks, self.gap = name, chunks, gap
        self.mode = "ok"
        self.healthy = True
        self.requests: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 500)

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": self.name}]})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.mode == "drop":
            request.transport.close()
            await asyncio.sleep(1)
        if self.mode == "hang":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._release.wait(), 30)
        if self.mode == "503":
            return web.Response(status=503, text="busy")
        if not body.get("stream"):
            return web.json_response({"engine": self.name}, headers={"X-Engine": self.name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": self.name})
        await resp.prepare(request)
        for i in range(self.chunks):
            if self.mode == "cut" and i == 2:
                request.transport.close()  # the engine dies mid-response
                return resp
            await resp.write(f"data: {json.dumps({'engine': self.name, 'i': i})}\n\n".encode())
            await asyncio.sleep(self.gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def running(engines, tokenizer=None, **kw):
    """Start fake engines and a router in front of them; yield (router, base URL, session)."""
    for e in engines:
        await e.start()
    kw.setdefault("health_interval_s", 0.2)
    kw.setdefault("health_timeout_s", 0.5)
    cfg = RouteConfig(engines=tuple(EngineSpec(e.url) for e in engines), block_size=BS, **kw)
    router = Router(cfg, tokenizer)
    runner = web.AppRunner(router.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            yield router, f"http://127.0.0.1:{port}", session
    finally:
        await runner.cleanup()
        for e in engines:
            await e.stop()


def _hold(router: Router, engine: FakeEngine, tokens: list[int]) -> None:
    n = len(tokens) // BS
    router.index.apply_stored(engine.url, [(engine.name, i) for i in range(n)], None, tokens[:n * BS], BS, "GPU")


async def _post(session, base, body, path="/v1/completions"):
    async with session.post(base + path, json=body) as resp:
        return resp.status, await resp.json(), resp.headers.get("X-Engine")


def test_routes_to_the_engine_holding_the_prefix_and_relays_headers():
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0) as (router, base, s):
            doc = list(range(64))
            _hold(router, b, doc)
            for _ in range(3):
                status, body, header = await _post(s, base, {"prompt": doc + [1, 2, 3], "max_tokens": 1})
                assert status == 200 and body == {"engine": "b"} and header == "b"
            assert len(b.requests) == 3 and not a.requests
            # no prefix anywhere: load decides, and an idle tie goes to the first engine
            status, body, _ = await _post(s, base, {"prompt": [9999] * 16})
            assert body == {"engine": "a"}

    asyncio.run(scenario())


def test_streaming_is_passed_through_as_it_arrives():
    a = FakeEngine("a", chunks=4, gap=0.3)

    async def scenario():
        async with running([a]) as (_router, base, s):
            t0 = time.monotonic()
            arrivals = []
            async with s.post(base + "/v1/completions", json={"prompt": [1] * 8, "stream": True}) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        arrivals.append(time.monotonic() - t0)
            assert len(arrivals) == 5
            assert arrivals[0] < 0.25 and arrivals[-1] > 1.0  # first event long before the last

    asyncio.run(scenario())


def test_a_client_leaving_mid_stream_is_not_the_engine_failing():
    a = FakeEngine("a", chunks=6, gap=0.1)

    async def scenario():
        async with running([a]) as (router, base, s):
            for _ in range(3):
                async with s.post(base + "/v1/completions", json={"prompt": [1] * 8, "stream": True}) as resp:
                    await resp.content.readline()  # read the first event, then hang up
            await asyncio.sleep(0.8)
            assert router.healthy() == [a.url]
            status, body, _ = await _post(s, base, {"prompt": [1] * 8})
            assert status == 200 and body == {"engine": "a"}
            metrics = await (await s.get(base + "/metrics")).text()
            assert "kvtier_route_ejections_total" not in metrics.replace("# HELP kvtier_route_ejections_total", "") \
                .replace("# TYPE kvtier_route_ejections_total", "")

    asyncio.run(scenario())


def test_engine_dying_mid_stream_cuts_the_client_and_ejects():
    a, b = FakeEngine("a", chunks=20, gap=0.1), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0, health_interval_s=30) as (router, base, s):
            a.mode = "cut"
            async with s.post(base + "/v1/completions", json={"prompt": [1] * 8, "stream": True}) as resp:
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            assert router.healthy() == [b.url]

    asyncio.run(scenario())


def test_failure_before_first_byte_is_retried_on_another_engine_and_ejects():
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0, health_interval_s=30) as (router, base, s):
            doc = list(range(32))
            _hold(router, a, doc)
            a.mode = "drop"
            status, body, _ = await _post(s, base, {"prompt": doc})
            assert status == 200 and body == {"engine": "b"} and len(a.requests) == 1
            assert router.healthy() == [b.url]  # a dropped the connection: out at once
            assert router.index.holders(chunk_keys(doc, BS)[0]) is None  # and its entries dropped
            metrics = await (await s.get(base + "/metrics")).text()
            assert "kvtier_route_retries_total 1.0" in metrics
            assert 'kvtier_route_ejections_total{engine="%s"} 1.0' % a.url in metrics

    asyncio.run(scenario())


def test_request_waiting_on_a_hung_engine_moves_when_the_engine_is_taken_out():
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0) as (router, base, s):
            doc = list(range(32))
            _hold(router, a, doc)
            a.mode, a.healthy = "hang", False
            t0 = time.monotonic()
            status, body, _ = await _post(s, base, {"prompt": doc})
            assert status == 200 and body == {"engine": "b"} and len(a.requests) == 1
            assert time.monotonic() - t0 < 3.0
            assert router.healthy() == [b.url]
            metrics = await (await s.get(base + "/metrics")).text()
            assert 'outcome="engine_out_before_first_byte"' in metrics

    asyncio.run(scenario())


def test_503_is_retried_without_ejecting_and_all_failing_is_a_503():
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0, health_interval_s=30) as (router, base, s):
            a.mode = "503"
            status, body, _ = await _post(s, base, {"prompt": [1] * 8})
            assert status == 200 and body == {"engine": "b"}
            assert router.healthy() == [a.url, b.url]
            b.mode = "503"
            async with s.post(base + "/v1/completions", json={"prompt": [2] * 8}) as resp:
                assert resp.status == 503 and "no engine answered" in (await resp.json())["error"]["message"]
            async with s.post(base + "/v1/completions", data=b"not json") as resp:
                assert resp.status == 400

    asyncio.run(scenario())


def test_unanswering_engine_is_taken_out_within_seconds_and_readmitted_when_healthy():
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], balance_ratio=0) as (router, base, s):
            doc = list(range(32))
            _hold(router, a, doc)
            a.healthy = False
            t0 = time.monotonic()
            while router.healthy() != [b.url]:
                assert time.monotonic() - t0 < 3.0, "not ejected within 3 s"
                await asyncio.sleep(0.05)
            assert router.index.holders(chunk_keys(doc, BS)[0]) is None
            health = await s.get(base + "/health")
            assert health.status == 200 and (await health.json())["healthy"] == [b.url]
            status, body, _ = await _post(s, base, {"prompt": doc})
            assert body == {"engine": "b"}
            a.healthy = True
            t0 = time.monotonic()
            while router.healthy() != [a.url, b.url]:
                assert time.monotonic() - t0 < 3.0, "not re-admitted within 3 s"
                await asyncio.sleep(0.05)
            b.healthy = False
            a.healthy = False
            t0 = time.monotonic()
            while router.healthy():
                assert time.monotonic() - t0 < 3.0
                await asyncio.sleep(0.05)
            assert (await s.get(base + "/health")).status == 503

    asyncio.run(scenario())


def test_models_metrics_and_decision_log(caplog):
    a, b = FakeEngine("a"), FakeEngine("b")

    async def scenario():
        async with running([a, b], log_decisions=True) as (_router, base, s):
            models = await (await s.get(base + "/v1/models")).json()
            assert models["data"][0]["id"] == "m"
            await _post(s, base, {"prompt": list(range(16))})
            text = await (await s.get(base + "/metrics")).text()
            assert "kvtier_route_requests_total" in text and "kvtier_route_index_keys" in text

    with caplog.at_level(logging.INFO, logger="kvtier.route.decisions"):
        asyncio.run(scenario())
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvtier.route.decisions"]
    assert lines and lines[0]["blocks"] == 4 and {s["engine"] for s in lines[0]["scores"]} == {a.url, b.url}


def _word_tokenizer(tmp_path, chat_template=None):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(200)}
    vocab["[UNK]"] = 200
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(tmp_path)
    return PromptTokenizer.load(str(tmp_path))


def test_text_prompts_and_chat_messages_are_keyed_like_token_ids(tmp_path):
    tok = _word_tokenizer(tmp_path / "plain")
    text = " ".join(f"w{i}" for i in range(10))
    assert tok.completion_ids({"prompt": text}) == list(range(10))
    assert tok.completion_ids({"prompt": [text]}) == list(range(10))
    assert tok.completion_ids({"prompt": [5, 6]}) == [5, 6]
    assert tok.chat_ids({"messages": [{"role": "user", "content": text}]}) == list(range(10))
    templated = _word_tokenizer(tmp_path / "chat", "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w2")
    assert templated.chat_ids({"messages": [{"role": "user", "content": "w7 w8"}]}) == [1, 7, 8, 2]

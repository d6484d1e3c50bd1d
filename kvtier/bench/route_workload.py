"""``kvtier bench route``'s workload and its driver: the WordLevel tokenizer, the Zipf-chosen
documents behind a system prompt (fresh words per run), and the streaming clients that send them
and time each request's first chunk (TTFT).

Imports: ``route_engines`` (the served model name); aiohttp, tokenizers and transformers inside
the functions that need them (the route extra).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.route_engines import MODEL_NAME


@dataclass(frozen=True)
class Request:
    """One request: the document it reads (``doc``, 0 the hottest) and its whole prompt."""

    doc: int
    prompt: str


def make_tokenizer(out: Path, vocab_size: int = 32000) -> Path:
    """A WordLevel tokenizer of words w0..w(N-2) plus [UNK], in a directory of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["[UNK]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(out)
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(data))
    return out


def make_workload(docs: int, doc_tokens: int, system_tokens: int, requests: int, zipf: float,
                  seed: int, content: int = 0) -> list[Request]:
    """R requests: shared system prompt + a Zipf-chosen document (doc 0 hottest) + a question.

    ``seed`` fixes the sequence of document choices; ``content`` the words: workloads with the
    same seed and different ``content`` choose the same documents in the same order, with the
    same sizes, but share no system prompt, document or question text (so nothing one left in
    a cache that cannot be reset, kvtier's tiers, is a hit for the other)."""
    choose = random.Random(seed)
    rng = random.Random(f"{seed}/{content}")
    words = lambda n: " ".join(f"w{rng.randrange(10, 31000)}" for _ in range(n))  # noqa: E731
    system = words(system_tokens)
    texts = [words(doc_tokens) for _ in range(docs)]
    weights = [1.0 / (k + 1) ** zipf for k in range(docs)]
    out = []
    for _ in range(requests):
        d = choose.choices(range(docs), weights)[0]
        out.append(Request(d, f"{system} {texts[d]} {words(16)}"))
    return out


def kvtier_ram_bytes(share: float, bytes_per_token: int, docs: int, doc_tokens: int, system_tokens: int) -> int:
    """``share`` x the KV of the system prompt and the ``docs`` documents, never below 1 MiB (the
    smallest RAM tier the benchmark starts)."""
    return max(1 << 20, int(share * bytes_per_token * (system_tokens + docs * doc_tokens)))


@dataclass
class Result:
    """One request's outcome: ``ok``, its TTFT (first streamed chunk), the completion tokens the
    server counted, and on failure a short ``error`` (an HTTP status, an exception's name, "stream cut")."""

    ok: bool
    ttft_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


async def _one(session, base: str, req: Request, max_tokens: int) -> Result:
    """Stream ``req`` from ``base``'s ``/v1/completions`` (greedy, ``max_tokens`` tokens, EOS ignored)."""
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, done = None, 0, False
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Result(False, error=f"HTTP {resp.status}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if ttft is None:
                    ttft = time.perf_counter() - t0
                usage = json.loads(data).get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        return Result(False, error=type(exc).__name__)
    if not done or ttft is None:
        return Result(False, error="stream cut")
    return Result(True, ttft, tokens)


async def drive(targets: list[str], requests: list[Request], concurrency: int, max_tokens: int,
                pick=None, on_done=None) -> tuple[list[Result], float]:
    """Send ``requests`` with ``concurrency`` clients; ``pick(req) -> base URL`` (default the
    first target). Returns (results in request order, wall seconds)."""
    import aiohttp

    results: list[Result | None] = [None] * len(requests)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(requests)):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)

    async def client(session) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            base = pick(requests[i]) if pick else targets[0]
            results[i] = await _one(session, base, requests[i], max_tokens)
            if on_done is not None:
                await on_done(sum(r is not None for r in results))

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return [r for r in results if r is not None], time.perf_counter() - t0

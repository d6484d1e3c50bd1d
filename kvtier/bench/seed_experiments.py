"""The measurements of ``kvtier bench seed``, one function per experiment of the document's section 7.

Each function drives engines that are already running (``kvtier.bench.seed_engines``) and
returns raw per-setting measurements (lists of request answers); ``kvtier.bench.seed`` turns
them into rows beside the document's figures. Contracts common to all of them:

* Settings are visited in a rotating order, pass by pass, so drifting load from elsewhere on a
  shared machine falls on every setting alike; each engine's turn starts after ``settle_s`` of
  quiet (vLLM's worker busy-polls for about a second after its last step).
* "Evicted from vLLM's pool" is done with vLLM's own ``reset_prefix_cache`` (the connector's
  store keeps its entries): the request that follows finds nothing in vLLM's pool, as after the
  document's eviction by other documents, without minutes of filler prefills.
* ``tick`` is called once per request sent (a progress bar).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kvtier.fileio import drop_page_cache
from kvtier.bench.seed_engines import SeedEngine

Tick = Callable[[int], None]
Engines = dict[str, SeedEngine]


def random_docs(count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` documents of ``tokens`` random token ids, the same for a given seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 31000, tokens).tolist() for _ in range(count)]


def _rotate(names: list[str], k: int) -> list[str]:
    k %= max(1, len(names))
    return names[k:] + names[:k]


# --------------------------------------------------------------------------------------------
# zipf


@dataclass(frozen=True)
class ZipfWorkload:
    """60 documents, a warm pass over all of them (shuffled), then requests drawn from Zipf s."""

    docs: list[list[int]]
    warm_order: list[int]
    requests: list[int]


def zipf_workload(num_docs: int, tokens: int, num_requests: int, s: float = 1.0, seed: int = 60) -> ZipfWorkload:
    """Popularity rank k has probability proportional to 1/k^s; ranks map to documents through a
    random permutation, so popularity is unrelated to the warm pass's order."""
    rng = np.random.default_rng(seed)
    docs = random_docs(num_docs, tokens, seed + 1)
    weights = 1.0 / np.arange(1, num_docs + 1) ** s
    ranks = rng.choice(num_docs, size=num_requests, p=weights / weights.sum())
    perm = rng.permutation(num_docs)
    return ZipfWorkload(docs, rng.permutation(num_docs).tolist(), [int(perm[r]) for r in ranks])


def run_zipf(engines: Engines, names: list[str], work: ZipfWorkload, settle_s: float, tick: Tick) -> dict[str, dict]:
    """Per setting: vLLM's pool dropped, the warm pass, then the Zipf requests (the measured pass).

    Returns ``{name: {"warm": [answers], "requests": [answers]}}``.
    """
    out = {name: {"warm": [], "requests": []} for name in names}
    for name in names:
        engines[name].reset()
    for k, (label, order) in enumerate((("warm", work.warm_order), ("requests", work.requests))):
        for name in _rotate(names, k):
            for j, doc in enumerate(order):
                out[name][label].append({**engines[name].prompt(work.docs[doc], settle_s if j == 0 else 0.0), "doc": doc})
                tick(1)
    return out


# --------------------------------------------------------------------------------------------
# length


def run_length(engines: Engines, recompute: str, load: str, docs: dict[int, list[int]], reps: int,
               settle_s: float, tick: Tick) -> dict[int, dict]:
    """Per input length: the first read on the kvtier engine (stores), then ``reps`` rounds of
    recompute (vLLM alone, its pool dropped), vLLM's own prefix hit (the same prompt again) and a
    load from the store (kvtier engine, its pool dropped).

    Returns ``{length: {"store": [...], "recompute": [...], "engine_hit": [...], "load": [...]}}``.
    """
    out = {n: {"store": [], "recompute": [], "engine_hit": [], "load": []} for n in docs}
    first = True
    for n, tokens in docs.items():
        engines[load].reset()
        out[n]["store"].append(engines[load].prompt(tokens, settle_s if first else 0.0))
        first = False
        tick(1)
    for r in range(reps):
        for name in _rotate([recompute, load], r):
            for j, (n, tokens) in enumerate(docs.items()):
                engine = engines[name]
                engine.reset()
                answer = engine.prompt(tokens, settle_s if j == 0 else 0.0)
                if name == recompute:
                    out[n]["recompute"].append(answer)
                    out[n]["engine_hit"].append(engine.prompt(tokens))
                    tick(1)
                else:
                    out[n]["load"].append(answer)
                tick(1)
    return out


# --------------------------------------------------------------------------------------------
# disk


def warm_page_cache(directory: Path) -> int:
    """Read every file under ``directory`` once, so its pages are cached; the bytes read."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    while chunk := f.read(1 << 22):
                        total += len(chunk)
            except OSError:
                continue
    return total


def run_disk(engine: SeedEngine, disk_dir: Path, docs: list[list[int]], rounds: int,
             settle_s: float, tick: Tick) -> dict[str, list]:
    """A disk-only tier (nothing above it to promote into): a first pass stores the documents;
    then, ``rounds`` times per document, a cold re-read (every tier file dropped from the page
    cache first) and a warm re-read (every tier file read into the page cache first), vLLM's pool
    dropped before each.

    Returns ``{"store": [...], "cold": [...], "warm": [...]}``.
    """
    out: dict[str, list] = {"store": [], "cold": [], "warm": []}
    engine.reset()
    for j, tokens in enumerate(docs):
        out["store"].append(engine.prompt(tokens, settle_s if j == 0 else 0.0))
        tick(1)
    for r in range(rounds):
        for tokens in docs:
            for state in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
                (drop_page_cache if state == "cold" else warm_page_cache)(disk_dir)
                engine.reset()
                out[state].append(engine.prompt(tokens, settle_s))
                tick(1)
    return out


# --------------------------------------------------------------------------------------------
# chunk


def chunk_workload(reps: int, prefix_tokens: int, tail_tokens: int, seed: int = 2000) -> list[tuple[list[int], list[int]]]:
    """``reps`` pairs of prompts sharing a prefix: (prefix + tail A, prefix + tail B)."""
    out = []
    for i in range(reps):
        rng = np.random.default_rng(seed + i)
        prefix = rng.integers(100, 31000, prefix_tokens).tolist()
        tail_a = rng.integers(100, 31000, tail_tokens).tolist()
        tail_b = rng.integers(100, 31000, tail_tokens).tolist()
        out.append((prefix + tail_a, prefix + tail_b))
    return out


def run_chunk(engines: Engines, baseline: str | None, names: list[str], pairs: list[tuple[list[int], list[int]]],
              settle_s: float, tick: Tick) -> dict[str, dict]:
    """Per kvtier engine (one chunk size each): prompt A (stores the prefix), vLLM's pool dropped,
    prompt B (its prefix loaded from the store, the rest recomputed). On the ``baseline`` engine
    (vLLM alone; None: none in this group): vLLM's pool dropped, prompt A (a full recompute),
    prompt B (the prefix hit in vLLM's own pool, the document's situation).

    Returns ``{name: {"first": [...], "reuse": [...]}}``.
    """
    everyone = ([baseline] if baseline else []) + list(names)
    out = {name: {"first": [], "reuse": []} for name in everyone}
    for r, (a, b) in enumerate(pairs):
        for name in _rotate(everyone, r):
            engine = engines[name]
            engine.reset()
            out[name]["first"].append(engine.prompt(a, settle_s))
            if name != baseline:
                engine.reset()
            out[name]["reuse"].append(engine.prompt(b))
            tick(2)
    return out


# --------------------------------------------------------------------------------------------
# concurrency


def run_concurrency(engines: Engines, names: list[str], docs: list[list[int]], levels: list[int],
                    max_tokens: int, settle_s: float, tick: Tick) -> dict[str, dict]:
    """A first pass one at a time (kvtier stores every document), then per concurrency level,
    vLLM's pool dropped, every document again in a closed loop of that many requests in flight,
    ``max_tokens`` output tokens each.

    Returns ``{name: {level: batch answer}}`` (see ``seed_engine._batch``).
    """
    out: dict[str, dict] = {name: {} for name in names}
    for name in names:
        engines[name].reset()
        engines[name].batch(docs, 1, 1, settle_s)
        tick(len(docs))
    for k, level in enumerate(levels):
        for name in _rotate(names, k):
            engines[name].reset()
            out[name][level] = engines[name].batch(docs, level, max_tokens, settle_s)
            tick(len(docs))
    return out

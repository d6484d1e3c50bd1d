"""``python -m kvtier.bench.server --arenas``: a raw and a ``lossless`` server arena of the same
capacity, side by side in one run (issue 27: the coded arena's capacity and its cost).

KV: real K/V of the random test model (``kvtier.bench.codec.model_docs``: transformers on
``--doc-tokens`` random ids per document, bf16, cut into ``--chunk-tokens`` chunks as the
connector stores them), or ``--kv synthetic`` (bf16-rounded normal values; say so when quoting).

Capacity: one ``kvtier serve`` per arena (its own process, LRU, ``element_dtype`` bfloat16),
both of ``--capacity-fraction`` x the working set's bytes in pages of ``--page``. Every
document is written in order through a direct-write client, each chunk with its parent (a
prefix chain); after each document the client ``flush``es, which also waits for the arena's
coder (documents arriving at an engine's pace: one 4,096-token document of the small model is
~0.7 s of prefill on this machine, the coder codes it in ~20 ms). Reported: the documents
whose every chunk the arena still holds (``lookup``) and the chunks held, and their ratio
(target >= 1.25). The same with ``--burst``-style writes (no flush between documents: the coder
falls behind a writer at memcpy speed, and raw pages take the room) is reported beside it.

Throughput: one ``kvtier serve`` per arena with room for every chunk; per round, a memcpy pass
of the same chunks, a put pass (direct writes: the same raw copy for both arenas), the coder's
drain after it (the server's background work, timed by the client's ``flush``), and a
``get_into`` pass (the raw arena: a copy out of the mapping; the coded one: a decode of the
leased pages into the caller's buffer, checksum verified). Medians over ``--rounds`` rounds, and
each path's ratio to the memcpy pass of the same round.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time

import numpy as np

from kvtier.bench.server import ServerTarget

MiB = 1024 * 1024
CODECS = ("none", "lossless")


def documents(kv: str, variant: str, docs: int, tokens: int, chunk_tokens: int) -> tuple[list[list[np.ndarray]], str]:
    """(documents as lists of uint8 chunks, a description of the source)."""
    if kv == "model":
        from kvtier.bench.codec import model_docs

        chunks = model_docs(variant, docs, tokens, chunk_tokens)
        source = f"random Qwen2 '{variant}' via transformers, {docs} x {tokens} tokens"
    else:
        from kvtier.bench.codec import synthetic_kv

        per_doc = tokens // chunk_tokens
        flat = synthetic_kv(docs * per_doc, 1 << 19)
        chunks = [flat[d * per_doc:(d + 1) * per_doc] for d in range(docs)]
        source = "synthetic (bf16-rounded normal values)"
    return [[np.ascontiguousarray(c).view(np.uint8).ravel() for c in doc] for doc in chunks], source


def _keys(docs: list[list[np.ndarray]]) -> list[list[bytes]]:
    """A prefix chain of 32-byte keys per document (distinct across documents)."""
    out = []
    for d, doc in enumerate(docs):
        prev, keys = b"", []
        for i in range(len(doc)):
            prev = hashlib.sha256(prev + f"{d}:{i}".encode()).digest()
            keys.append(prev)
        out.append(keys)
    return out


def _server(workdir: str, capacity: int, page: int, codec: str) -> ServerTarget:
    """A ``kvtier serve`` subprocess with one LRU RAM arena coded with ``codec`` (bf16 KV), and a
    direct-write client (``.client``)."""
    return ServerTarget(workdir, capacity, page_size=page, timeout=60.0, codec=codec, element_dtype="bfloat16")


def capacity(docs: list[list[np.ndarray]], cap: int, page: int, codec: str, paced: bool, workdir: str) -> dict:
    """Write every document into a fresh arena of ``cap`` bytes; what it holds afterwards."""
    keys = _keys(docs)
    server = _server(os.path.join(workdir, f"cap-{codec}-{'paced' if paced else 'burst'}"), cap, page, codec)
    try:
        c = server.client
        for doc, chain in zip(docs, keys):
            for i, (chunk, key) in enumerate(zip(doc, chain)):
                if not c.put(key, chunk, parent=chain[i - 1] if i else None, chunk_index=i):
                    raise RuntimeError(f"arena ({codec}) refused a chunk")
            if paced:
                c.flush(60)
        c.flush(60)
        held_docs = sum(c.lookup(chain) == len(chain) for chain in keys)
        held_chunks = sum(c.lookup([k]) for chain in keys for k in chain)
        wrong = 0
        out = np.empty(max(ch.nbytes for doc in docs for ch in doc), dtype=np.uint8)
        for doc, chain in zip(docs, keys):  # what it holds reads back bit-exactly
            for chunk, key in zip(doc, chain):
                n = c.get_into(key, out)
                wrong += n is not None and not np.array_equal(out[:n], chunk)
        if wrong:
            raise RuntimeError(f"arena ({codec}) returned wrong bytes for {wrong} chunks")
        state = server.client.stats()["tiers"][0]
    finally:
        server.close()
    codec_state = state.get("codec", {})
    return {"codec": codec, "paced": paced, "docs_held": held_docs, "chunks_held": held_chunks,
            "evictions": state.get("stats", {}).get("evictions", state.get("evictions")),
            "raw_bytes": codec_state.get("raw_bytes"), "stored_bytes": codec_state.get("stored_bytes"),
            "entries_coded": codec_state.get("entries_coded")}


def throughput(chunks: list[np.ndarray], page: int, rounds: int, workdir: str) -> list[dict]:
    """put / coder drain / get GB/s of each arena beside memcpy (see the module docstring)."""
    total = sum(c.nbytes for c in chunks)
    foot = sum(-(-c.nbytes // page) * page for c in chunks)
    keys = [hashlib.sha256(f"t{i}".encode()).digest() for i in range(len(chunks))]
    out = np.empty(max(c.nbytes for c in chunks), dtype=np.uint8)
    slots = [np.ones(c.nbytes, dtype=np.uint8) for c in chunks]
    servers = {codec: _server(os.path.join(workdir, f"tp-{codec}"), foot + 64 * MiB, page, codec) for codec in CODECS}
    per_round = []
    try:
        for r in range(rounds):
            fig: dict[tuple[str, str], float] = {}
            t0 = time.perf_counter()
            for slot, c in zip(slots, chunks):
                np.copyto(slot, c)
            t1 = time.perf_counter()
            for slot in slots:
                np.copyto(out[: slot.size], slot)
            t2 = time.perf_counter()
            fig["memcpy", "put"], fig["memcpy", "get"] = total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9
            for codec in (CODECS if r % 2 == 0 else CODECS[::-1]):
                c = servers[codec].client
                t0 = time.perf_counter()
                for key, chunk in zip(keys, chunks):
                    if not c.put(key, chunk):
                        raise RuntimeError(f"arena ({codec}) refused a put")
                t1 = time.perf_counter()
                c.flush(60)
                t2 = time.perf_counter()
                for key, chunk in zip(keys, chunks):
                    if c.get_into(key, out) != chunk.nbytes:
                        raise RuntimeError(f"arena ({codec}) missed an entry it just stored")
                t3 = time.perf_counter()
                if not np.array_equal(out[: chunks[-1].nbytes], chunks[-1]):
                    raise RuntimeError(f"arena ({codec}) returned wrong bytes")
                for key in keys:
                    c.delete(key)
                fig[codec, "put"] = total / (t1 - t0) / 1e9
                fig[codec, "coder_drain"] = total / max(t2 - t1, 1e-9) / 1e9
                fig[codec, "get"] = total / (t3 - t2) / 1e9
            per_round.append(fig)
    finally:
        for server in servers.values():
            server.close()
    rows = []
    for path in ("memcpy", *CODECS):
        for op in ("put", "coder_drain", "get"):
            if (path, op) not in per_round[0]:
                continue
            gbps = [f[path, op] for f in per_round]
            row = {"path": path, "op": op, "gb_per_s": round(statistics.median(gbps), 3)}
            if op != "coder_drain":
                row["vs_memcpy"] = round(statistics.median(f[path, op] / f["memcpy", op] for f in per_round), 3)
            rows.append(row)
    return rows


def compare_arenas(args, workdir: str) -> dict:
    """The whole comparison (capacity, paced and burst; throughput) as one JSON-able report."""
    docs, source = documents(args.kv, args.variant, args.docs, args.doc_tokens, args.chunk_tokens)
    working = sum(c.nbytes for doc in docs for c in doc)
    cap = int(working * args.capacity_fraction) // args.page * args.page
    runs = [capacity(docs, cap, args.page, codec, paced, workdir) for paced in (True, False) for codec in CODECS]
    by = {(r["codec"], r["paced"]): r for r in runs}
    paced_ratio = by["lossless", True]["docs_held"] / max(1, by["none", True]["docs_held"])
    burst_ratio = by["lossless", False]["docs_held"] / max(1, by["none", False]["docs_held"])
    chunks = [c for doc in docs for c in doc][: max(1, args.throughput_chunks)]
    return {"kv_source": source, "docs": len(docs), "chunks_per_doc": len(docs[0]), "chunk_bytes": docs[0][0].nbytes,
            "working_set_bytes": working, "capacity_bytes": cap, "page_size": args.page,
            "capacity": runs, "docs_ratio_paced": round(paced_ratio, 3), "docs_ratio_burst": round(burst_ratio, 3),
            "chunks_ratio_paced": round(by["lossless", True]["chunks_held"] / max(1, by["none", True]["chunks_held"]), 3),
            "target_docs_ratio": 1.25, "met": paced_ratio >= 1.25,
            "throughput": throughput(chunks, args.page, args.rounds, workdir), "rounds": args.rounds}

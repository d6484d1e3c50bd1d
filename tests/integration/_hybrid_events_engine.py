"""One real vLLM CPU engine with kvtier and vLLM's ZMQ KV event publisher on a hybrid model (used by
``test_hybrid_events.py``).

``python tests/integration/_hybrid_events_engine.py MODEL_DIR OUT.json``: sends one 2,000-token
document, then reads every batch the engine published from its replay endpoint (vLLM's ROUTER
socket, as ``kvtier route`` catches up: no batch is lost to a late subscriber), and writes what
the test checks: the engine's own group fields (from its GPU events), kvtier's events per group
(chunk index, whether the hashes are the engine's), and ``kvtier route``'s index built from the
stream (all of it, and kvtier's events alone).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

if __name__ in ("__main__", "__mp_main__"):
    from kvtier.harness.procs import die_with_parent

    die_with_parent()

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process

TOKENS = 2000
BLOCK = 128
REPLAY_TIMEOUT_MS = 30_000


def _replay(ctx, endpoint: str) -> list[bytes]:
    """Payloads of every batch published so far, from the replay endpoint (frames
    ``(b"", topic, seq, payload)``, then an end marker with seq -1)."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    try:
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            if int.from_bytes(frames[2], "big", signed=True) == -1:
                return payloads
            payloads.append(frames[3])
        raise RuntimeError("the replay endpoint did not answer")
    finally:
        sock.close()


def _chunk_of(doc: list[int], tokens: list[int], start_block: int = 0) -> int:
    """The block index at which ``tokens`` starts in ``doc`` (-1: nowhere)."""
    for b in range(start_block, len(doc) // BLOCK + 1):
        if doc[b * BLOCK:b * BLOCK + len(tokens)] == tokens:
            return b
    return -1


def _index_run(events: list, doc: list[int]) -> dict:
    from kvtier.route.events import apply_events
    from kvtier.route.index import PrefixIndex, chunk_keys
    from kvtier.route.score import prefix_matches

    index = PrefixIndex(block_size=BLOCK)
    apply_events(index, "e", events)
    (_, run), = prefix_matches(chunk_keys(doc, BLOCK), ["e"], index, None, lambda m: 1.0, frozenset()).values()
    return {"run": run, "orphans": index.orphans, "ignored": index.ignored}


def main(model: str, out_path: str) -> int:
    import numpy as np
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    from kvtier.route.events import decode_batch

    sockets = tempfile.mkdtemp(prefix="kvev")
    tiers = [{"type": "ram", "capacity": "64MiB"}]
    llm = LLM(model=model, skip_tokenizer_init=True, gpu_memory_utilization=0.3, num_gpu_blocks_override=96,
              max_model_len=2176, enable_prefix_caching=True, seed=0,
              kv_transfer_config={"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                                  "kv_role": "kv_both", "kv_connector_extra_config": {"tiers": tiers}},
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=f"ipc://{sockets}/pub", replay_endpoint=f"ipc://{sockets}/replay"))
    doc = np.random.default_rng(5).integers(100, 31000, TOKENS).tolist()
    llm.generate([TokensPrompt(prompt_token_ids=doc)], SamplingParams(max_tokens=1, temperature=0.0))
    ctx = zmq.Context()
    try:
        # the publisher thread may still hold the last step's batch: read until the replay shows
        # kvtier's own (non-GPU) events, or the replay stops growing
        payloads: list[bytes] = []
        for _ in range(20):
            again = _replay(ctx, f"ipc://{sockets}/replay")
            events = [e for payload in again for e in decode_batch(payload)]
            if len(again) == len(payloads) and any(ev.get("medium") not in (None, "GPU") for _, ev in events):
                break
            payloads = again
            time.sleep(0.5)
    finally:
        ctx.term()
    events = [e for payload in payloads for e in decode_batch(payload)]

    gpu_hash: dict[int, object] = {}  # block index -> the engine's hash (its full-attention group)
    groups: dict[int, list] = {}
    for kind, ev in events:
        if kind != "BlockStored" or ev.get("medium") not in (None, "GPU"):
            continue
        groups[ev["group_idx"]] = [ev.get("kv_cache_spec_kind"), ev.get("kv_cache_spec_sliding_window")]
        hashes, tokens = ev["block_hashes"], ev["token_ids"]
        first = _chunk_of(doc, tokens) + len(tokens) // BLOCK - len(hashes)  # hashes name the trailing blocks
        for i, h in enumerate(hashes):
            gpu_hash.setdefault(first + i, h)
    kvtier: dict[int, list] = {}
    kvtier_kinds: dict[int, list] = {}
    for kind, ev in events:
        if kind != "BlockStored" or ev.get("medium") in (None, "GPU"):
            continue
        g = ev["group_idx"]
        kvtier_kinds[g] = [ev.get("kv_cache_spec_kind"), ev.get("kv_cache_spec_sliding_window")]
        b = _chunk_of(doc, ev["token_ids"])
        same = ev["block_hashes"] == [gpu_hash.get(b + i) for i in range(len(ev["block_hashes"]))]
        kvtier.setdefault(g, []).append((b * BLOCK // len(ev["token_ids"]), same))
    mine = [(k, ev) for k, ev in events if ev.get("medium") not in (None, "GPU")]
    out = {"groups": groups, "kvtier": kvtier, "kvtier_kinds": kvtier_kinds,
           "kvtier_index": _index_run(mine, doc), "engine_index": _index_run(events, doc),
           "events": len(events), "batches": len(payloads)}
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""Background saves (``transfer_mode: async``) on a real vLLM CPU engine and the small random model.

Two engine processes (module fixture), each running this file as a script with the engine core
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the script can look at vLLM's scheduler
(its free blocks, its requests) and observe the connector's calls:

- A, without a connector, is the reference: each document cold, then re-read with vLLM's own
  prefix cache (the cached computation the connector's hits must reproduce exactly);
- B runs the connector in async mode with a RAM tier, its store wrapped in a fault-injection
  gate (writes can be held: a stuck store) and 24 staging slots. It saves a document in the
  background and re-reads it from kvtier; runs two prompts at once in a pool too small for both
  to grow (vLLM preempts one right after it saved a chunk, and reuses that chunk's block in the
  next forward pass) while the store's writes are held, then re-reads both from kvtier; holds
  the store's writes while two documents are saved (the second finds too few slots left: its
  later chunks are dropped and counted, the step never waits); and then serves a batch of
  twelve more requests.

``python -m tests.integration.test_async_saves_engine SPEC.json OUT.json`` (from the repository
root) runs one engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.integration.test_connector import LOADABLE, _connector, _docs, _engine_env, logprobs_close, same_prediction

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]  # the repository: the script runs as a module from it
# B's staging slots: one 2,000-token prefill saves 15 chunks in one step, the pair's 20
SLOTS = 24
CHUNKS = LOADABLE // 128  # chunks a 2,000-token document saves
MAX_TOKENS = 16
# The pair: two prompts of 11 blocks (128 tokens each) in a pool of 22 usable blocks, prefilled
# in one step and decoded in lockstep. In the step where both fill their 11th block, each saves
# that block's chunk; in the next, the first needs a 12th block, vLLM preempts the second and
# hands the first a block the second just saved from, written by that very forward pass.
PAIR_TOKENS = 1400
PAIR_LOADABLE = (PAIR_TOKENS - 1) // 128 * 128


class GatedStore:
    """Fault injection around the worker's real store: while ``gate`` is clear, ``write`` waits
    (a stuck store); everything else is the real store's."""

    def __init__(self, store):
        self._store = store
        self.gate = threading.Event()
        self.gate.set()

    memcpy_writes = False  # a store whose writes can wait (as a cache server's): the background writer serves it

    def write(self, *args, **kwargs) -> bool:
        if not self.gate.wait(300):
            raise TimeoutError("the scenario never opened the gate")
        return self._store.write(*args, **kwargs)

    def write_many(self, items) -> list[bool]:
        """Each item through ``write`` (the gate holds a batch as it holds one write)."""
        return [self.write(i.key, i.nbytes, i.fill, i.parent, i.chunk_index) for i in items]

    def __getattr__(self, name):
        return getattr(self._store, name)


class Observer:
    """Records, in the engine process, what the connector answered vLLM and what it counted:
    ``request_finished`` answers, requests reported as finished sending, chunks planned for
    saving, and the worker's stats summed over the run."""

    def __init__(self, llm):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvtier.integrations.vllm.metrics import KVTierConnectorStats

        self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        connector = self.scheduler.connector
        self.worker = get_kv_transfer_group().worker if connector is not None else None
        self.held: list[bool] = []  # request_finished's first value, per finished request
        self.sending: list[str] = []  # requests reported as finished sending
        self.planned = 0  # chunks the scheduler planned to save
        self.preemptions = 0  # requests vLLM preempted (their blocks freed without request_finished)
        self.last_saved: set[int] = set()  # blocks the worker's latest wait_for_save saved from
        self.freed_after_save = 0  # blocks a preemption freed right after a save read them
        self.digests: dict[bytes, set[str]] = {}  # stored key -> digests of its pages when saved
        self.stats = KVTierConnectorStats()
        if connector is not None:
            self._wrap(connector, get_kv_transfer_group())

    def _wrap(self, sched_conn, worker_conn) -> None:
        finished, get_finished = sched_conn.request_finished, worker_conn.get_finished
        finished_all = sched_conn.request_finished_all_groups  # what vLLM calls on a SupportsHMA connector
        wait_for_save, take_stats = self.worker.wait_for_save, self.worker.take_stats

        def request_finished(request, block_ids):
            out = finished(request, block_ids)
            self.held.append(bool(out[0]))
            return out

        def request_finished_all_groups(request, block_ids):
            out = finished_all(request, block_ids)
            self.held.append(bool(out[0]))
            return out

        def get_finished_seen(ids):
            sending, recving = get_finished(ids)
            self.sending.extend(sending or ())
            return sending, recving

        def wait_for_save_seen(meta):
            self.planned += len(meta.saves)
            self.last_saved = {b for save in meta.saves for b in save.block_ids}
            for save in meta.saves:  # the pages as they are in this step
                key = self.worker.share.key(save.key)
                self.digests.setdefault(key, set()).add(_digest_pages(self.worker._layout, save.block_ids))
            return wait_for_save(meta)

        def take_stats_seen():
            stats = take_stats()
            if stats is not None:
                self.stats.aggregate(stats)
            return stats

        preempt = self.scheduler._preempt_request

        def preempt_seen(request, *args, **kwargs):
            self.preemptions += 1
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
            self.freed_after_save += len(self.last_saved & set(blocks))
            return preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = preempt_seen
        sched_conn.request_finished = request_finished
        sched_conn.request_finished_all_groups = request_finished_all_groups
        worker_conn.get_finished = get_finished_seen
        self.worker.wait_for_save = wait_for_save_seen
        self.worker.take_stats = take_stats_seen

    def compare_stored(self) -> dict:
        """How many saved chunks the store holds, and how many of those hold bytes other than
        the pages had in a step that saved them."""
        compared = mismatched = 0
        for key, digests in self.digests.items():
            got: list[str] = []
            if self.worker.store.read(key, lambda segs: got.append(_digest_segments(segs))) is None:
                continue  # dropped or refused: not stored
            compared += 1
            mismatched += got[0] not in digests
        return {"compared": compared, "mismatched": mismatched}

    def report(self) -> dict:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"stored": self.compare_stored(),
                "free_blocks": pool.get_num_free_blocks(), "total_blocks": pool.num_gpu_blocks,
                "requests_left": len(self.scheduler.requests), "held": self.held, "sending": self.sending,
                "planned": self.planned, "counters": self.stats.data["counters"]}


def _digest_pages(layout, block_ids: list[int]) -> str:
    """sha256 of a chunk's entry bytes as the engine's pages hold them now."""
    import hashlib

    import numpy as np

    data = np.empty(layout.chunk_bytes, dtype=np.uint8)
    layout.save(block_ids, [data])
    return hashlib.sha256(data).hexdigest()


def _digest_segments(segments) -> str:
    import hashlib

    h = hashlib.sha256()
    for seg in segments:
        h.update(memoryview(seg).cast("B"))
    return h.hexdigest()


def _open_gated(cfg):
    """The worker's store, wrapped in a ``GatedStore`` (installed as ``KVTierWorker._open_store``)."""
    from kvtier.store import TieredStore

    return GatedStore(TieredStore.from_config(cfg.store))


def _settle(llm, observer: Observer, tag: int) -> None:
    """Wait for the background saves, then run one short request: its step carries the store's
    events to the scheduler's mirror and the writer's counts to the stats."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if observer.worker is not None and not observer.worker.drain_saves(300):
        raise RuntimeError("background saves did not drain")
    llm.generate([TokensPrompt(prompt_token_ids=[11 + tag] * 24)], SamplingParams(max_tokens=1), use_tqdm=False)


def _batch(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_steps(llm, spec: dict, observer: Observer) -> dict:
    """Carry out the spec's steps; {tag: result}."""
    from vllm import SamplingParams

    from kvtier.bench.engine_run import _one

    docs, results = spec["docs"], {}
    store = observer.worker.store if observer.worker is not None else None
    for n, step in enumerate(spec["steps"]):
        if "send" in step:
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5)
            results[step["tag"]] = _one(llm, docs[step["send"]], sampling)
        elif "batch" in step:
            before = observer.preemptions, observer.freed_after_save
            outputs = _batch(llm, [docs[i] for i in step["batch"]], MAX_TOKENS)
            results[step["tag"]] = {"outputs": outputs, "preemptions": observer.preemptions - before[0],
                                    "freed_after_save": observer.freed_after_save - before[1]}
        elif "many" in step:
            prompts = [[(31 * i + 7 * j) % 30000 + 100 for j in range(300)] for i in range(step["many"])]
            results[step["tag"]] = {"outputs": _batch(llm, prompts, 4)}
        elif "hold_writes" in step:
            store.gate.clear()
        elif "release_writes" in step:
            store.gate.set()
        elif "settle" in step:
            _settle(llm, observer, n)
        elif "snapshot" in step:  # the counts so far (after a settle: every save accounted for)
            results[step["snapshot"]] = {"planned": observer.planned, "counters": dict(observer.stats.data["counters"])}
        elif "reset_prefix_cache" in step:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
    return results


def main(spec_path: str, out_path: str) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from vllm import LLM

    from kvtier.integrations.vllm import worker as worker_module

    with open(spec_path) as f:
        spec = json.load(f)
    worker_module.SAVE_BACKLOG_CHUNKS = SLOTS
    worker_module.KVTierWorker._open_store = staticmethod(_open_gated)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              num_gpu_blocks_override=spec["pool_blocks"], max_model_len=spec["max_model_len"],
              kv_transfer_config=spec.get("kv_transfer_config"), enable_prefix_caching=True,
              disable_log_stats=False, seed=0, enforce_eager=True)  # no torch.compile: see scenario.py
    observer = Observer(llm)
    results = run_steps(llm, spec, observer)
    with open(out_path, "w") as f:
        json.dump({"results": results, "report": observer.report()}, f)
    return 0


# ------------------------------------------------------------------------------------- tests


def _run(tmp: Path, name: str, spec: dict) -> tuple[int, dict, str]:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "tests.integration.test_async_saves_engine", str(spec_path),
                               str(out_path)], env=_engine_env(), stdout=log, stderr=subprocess.STDOUT, timeout=900,
                              cwd=ROOT)
    text = log_path.read_text(errors="replace")
    return proc.returncode, (json.loads(out_path.read_text()) if proc.returncode == 0 else {}), text


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvtier.bench.models import make_random_model

    tmp = tmp_path_factory.mktemp("async_saves")
    docs = _docs(6)
    docs += [docs[1][:PAIR_TOKENS], docs[2][:PAIR_TOKENS]]  # 6 and 7: the pair
    base = {"model": str(make_random_model("small")), "docs": docs, "pool_blocks": 23, "max_model_len": 2560}
    steps_a = [step for i in (0, 6, 7) for step in ({"send": i, "tag": f"cold{i}"}, {"send": i, "tag": f"local{i}"})]
    steps_a += [{"send": 4, "tag": "cold4"}, {"send": 5, "tag": "cold5"}]
    rc, a, log = _run(tmp, "a", {**base, "steps": steps_a})
    assert rc == 0, log[-3000:]
    steps_b = [{"send": 0, "tag": "cold0"}, {"settle": True}, {"reset_prefix_cache": True},
               {"send": 0, "tag": "kv0"},
               {"hold_writes": True}, {"batch": [6, 7], "tag": "pair"}, {"release_writes": True},
               {"settle": True}, {"reset_prefix_cache": True},
               {"send": 6, "tag": "kv6"}, {"send": 7, "tag": "kv7"},
               {"hold_writes": True}, {"send": 4, "tag": "cold4"}, {"send": 5, "tag": "cold5"},
               {"release_writes": True}, {"settle": True}, {"snapshot": "held"},
               {"many": 12, "tag": "many"}, {"settle": True}]
    tiers = [{"type": "ram", "capacity": "64MiB"}]
    rc, b, log = _run(tmp, "b", {**base, "kv_transfer_config": _connector(tiers, transfer_mode="async"),
                                 "steps": steps_b})
    assert rc == 0, log[-3000:]
    return a, b


def _first(result: dict) -> dict:
    """A result with its first generated token only (a random model's near-uniform predictions
    let later tokens drift apart on any difference in the last bit)."""
    return {**result, "token_ids": result["token_ids"][:1]}


def test_async_saves_make_rereads_hit_with_the_tokens_of_vllms_own_prefix_hit(engines):
    """Saved in the background, re-read from kvtier: the whole loadable prefix hits, and the
    greedy tokens are those of vLLM's own prefix-cache hit on the same document (engine A, no
    connector), token for token."""
    a, b = engines
    kv0 = b["results"]["kv0"]
    assert kv0["hit_tokens"] == LOADABLE
    assert kv0["token_ids"] == a["results"]["local0"]["token_ids"] and len(kv0["token_ids"]) == MAX_TOKENS
    assert b["results"]["cold0"]["token_ids"] == a["results"]["cold0"]["token_ids"]


def test_chunks_saved_around_a_preemption_are_the_documents_kv(engines):
    """Two prompts that fill the pool (see PAIR_TOKENS): vLLM preempts one in the step after it
    saved a chunk and reuses that chunk's block at once. The store's writes are held until both
    requests have finished (their blocks freed, some reused), so a save that read the engine's
    pages after its step would store other KV. Every chunk is read within the step that saves
    it: both prompts re-read from kvtier predict as vLLM's own prefix hit does (with a
    tolerance: their KV was computed in another batch than engine A's, not bit-identical)."""
    a, b = engines
    assert b["results"]["pair"]["preemptions"] >= 1
    assert b["results"]["pair"]["freed_after_save"] >= 1  # a block freed in the step after its save
    stored = b["report"]["stored"]  # every stored chunk holds its pages' bytes of the saving step
    assert 0 < stored["compared"] <= b["report"]["counters"]["saved_chunks"] and stored["mismatched"] == 0
    for i in (6, 7):
        kv, ref = b["results"][f"kv{i}"], a["results"][f"local{i}"]
        assert kv["hit_tokens"] == PAIR_LOADABLE, i
        assert same_prediction(_first(ref), _first(kv)) and logprobs_close(ref, kv, tol=0.02), (i, kv, ref)


def test_saves_that_cannot_keep_up_are_dropped_and_counted_without_stalling(engines):
    """With the store's writes held, document 4's 15 chunks take 15 of the 24 slots, document
    5's first 9 chunks the rest, and its 6 later chunks are dropped and counted; both requests
    still run (tokens as without a connector). Every chunk planned is accounted for:
    saved, refused by the store, or dropped from the backlog."""
    a, b = engines
    for i in (4, 5):
        assert b["results"][f"cold{i}"]["token_ids"] == a["results"][f"cold{i}"]["token_ids"], i
    held = b["results"]["held"]
    assert held["counters"]["save_backlog_dropped"] == 2 * CHUNKS - SLOTS
    for counts in (held, b["report"]):  # after the held writes, and at the end
        counters = counts["counters"]
        saved, refused = counters.get("saved_chunks", 0), counters.get("save_dropped", 0)
        assert saved + refused + counters.get("save_backlog_dropped", 0) == counts["planned"]
        assert refused == 0


def test_no_request_holds_blocks_and_none_leak(engines):
    """``request_finished`` never asks vLLM to keep blocks (every save read its pages within
    its step), no request is reported as sending, and after twelve more requests every block
    is free again and vLLM keeps no request."""
    _, b = engines
    report = b["report"]
    assert len(b["results"]["many"]["outputs"]) == 12 and all(len(o) == 4 for o in b["results"]["many"]["outputs"])
    assert report["held"] and not any(report["held"])
    assert report["sending"] == []
    assert report["requests_left"] == 0
    assert report["free_blocks"] == report["total_blocks"] - 1  # vLLM's null block is never free


if __name__ == "__main__":
    # this script and vLLM's engine processes die with their parent (see scenario.py)
    from kvtier.harness.procs import die_with_parent

    die_with_parent()
    sys.exit(main(*sys.argv[1:]))

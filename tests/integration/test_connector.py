"""KVTierConnector end to end on a real vLLM CPU engine and the small random Qwen2 model.

Three engine processes run in sequence over one disk directory (module fixture):

- A stores four documents (RAM tier for two of them, every chunk written through to disk), then
  re-reads one with vLLM's own prefix cache and two from kvtier;
- B is a new engine over the same disk directory: it hits what A stored (keys are
  process-independent), with the same computation as A's own prefix-cache hit;
- C runs over a copy of the directory in which every entry was corrupted (flipped byte,
  truncated file) or deleted: it recomputes, gives the same predictions, and does not crash.

A cold prefill is not bit-identical to any cached path (DESIGN.md), so predictions are compared
with a tolerance for near-ties; the same cached computation is compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent
TOKENS = 2000
CHUNK = 128
LOADABLE = (TOKENS - 1) // CHUNK * CHUNK  # 1920: whole chunks, prompt minus one token
CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def _docs(n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(100, 31000, TOKENS).tolist() for _ in range(n)]


def _engine_env() -> dict:
    from kvtier.harness.cpus import engine_cpu_env

    return {**os.environ, **engine_cpu_env()}


def run_scenario(tmp: Path, name: str, spec: dict) -> tuple[int, dict, str]:
    """Run one engine scenario in a subprocess; (exit code, results, log text)."""
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(HERE / "scenario.py"), str(spec_path), str(out_path)],
                              env=_engine_env(), stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = log_path.read_text(errors="replace")
    results = json.loads(out_path.read_text()) if proc.returncode == 0 else {}
    return proc.returncode, results, text


def _connector(tiers: list[dict], **extra) -> dict:
    return {**CONNECTOR, "kv_connector_extra_config": {"tiers": tiers, **extra}}


def _entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _corrupt(root: Path) -> dict[str, list[Path]]:
    """Flip a payload byte in a third of the entries, truncate a third, delete a third."""
    done: dict[str, list[Path]] = {"flipped": [], "truncated": [], "deleted": []}
    for i, path in enumerate(_entry_files(root)):
        if i % 3 == 0:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
            done["flipped"].append(path)
        elif i % 3 == 1:
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
            done["truncated"].append(path)
        else:
            path.unlink()
            done["deleted"].append(path)
    return done


def same_prediction(ref: dict, got: dict, tol: float = 0.02) -> bool:
    """Equal greedy token, or a near-tie in the reference where a tiny difference may flip it."""
    if ref["token_ids"] == got["token_ids"]:
        return True
    top = sorted(ref["logprobs"].values(), reverse=True)
    return len(top) > 1 and top[0] - top[1] < tol


def logprobs_close(ref: dict, got: dict, tol: float) -> bool:
    common = set(ref["logprobs"]) & set(got["logprobs"])
    return bool(common) and all(abs(ref["logprobs"][t] - got["logprobs"][t]) <= tol for t in common)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from kvtier.bench.models import make_random_model

    tmp = tmp_path_factory.mktemp("connector")
    model = str(make_random_model("small"))
    docs = _docs(4) + _docs(22)[4:]  # 4 documents to store, then fresh ones for the memory check
    disk = tmp / "disk"
    tiers = [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(disk), "capacity": "1GiB"}]
    base = {"model": model, "docs": docs, "pool_blocks": 24, "max_model_len": 2560}
    steps_a = [{"send": i, "tag": f"cold{i}"} for i in range(4)]
    steps_a += [{"send": 3, "tag": "local3"}, {"send": 0, "tag": "kv0"}, {"send": 1, "tag": "kv1"}]
    rc_a, a, log_a = run_scenario(tmp, "a", {**base, "kv_transfer_config": _connector(tiers), "steps": steps_a})
    assert rc_a == 0, log_a[-3000:]
    files_after_a = len(_entry_files(disk))

    corrupted_dir = tmp / "corrupted"
    shutil.copytree(disk, corrupted_dir)
    damage = _corrupt(corrupted_dir)

    steps_b = [{"send": 3, "tag": "kv3"}, {"send": 2, "tag": "kv2"}, {"rss": "start"}]
    steps_b += [{"send": i, "tag": f"new{i}"} for i in range(4, 10)] + [{"rss": "mid"}]
    steps_b += [{"send": i, "tag": f"new{i}"} for i in range(10, 22)] + [{"rss": "end"}]
    rc_b, b, log_b = run_scenario(tmp, "b", {**base, "kv_transfer_config": _connector(tiers), "steps": steps_b})
    assert rc_b == 0, log_b[-3000:]

    tiers_c = [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(corrupted_dir), "capacity": "1GiB"}]
    steps_c = [{"send": i, "tag": f"c{i}"} for i in range(4)]
    rc_c, c, log_c = run_scenario(tmp, "c", {**base, "kv_transfer_config": _connector(tiers_c), "steps": steps_c})
    return {"a": a["results"], "b": b, "c": (rc_c, c, log_c), "damage": damage, "files_after_a": files_after_a}


def test_cold_pass_stores_and_rereads_hit(engines):
    a = engines["a"]
    for i in range(4):
        assert a[f"cold{i}"]["hit_tokens"] == 0
    assert a["local3"]["local_hit_tokens"] == LOADABLE  # vLLM's own prefix cache, same length
    for i in (0, 1):
        assert a[f"kv{i}"]["hit_tokens"] == LOADABLE  # the external hits are exactly what was stored
        assert same_prediction(a[f"cold{i}"], a[f"kv{i}"])
        assert logprobs_close(a[f"cold{i}"], a[f"kv{i}"], tol=0.02)
    assert engines["files_after_a"] == 4 * (LOADABLE // CHUNK)  # every chunk written through to disk


def test_second_engine_hits_first_engines_disk_entries(engines):
    a, b = engines["a"], engines["b"]["results"]
    assert b["kv3"]["hit_tokens"] == LOADABLE
    assert b["kv2"]["hit_tokens"] == LOADABLE
    # Loaded KV is the bytes A computed: the same computation as A's own prefix-cache hit.
    assert b["kv3"]["token_ids"] == a["local3"]["token_ids"]
    assert logprobs_close(a["local3"], b["kv3"], tol=1e-5)
    assert same_prediction(a["cold2"], b["kv2"])


def test_ram_tier_keeps_engine_memory_bounded(engines):
    rss = engines["b"]["rss"]
    # 18 new documents (140 MiB of KV, 12 of them, 94 MiB, after "mid") pass through a 16 MiB RAM
    # tier: the engine's memory grows by at most the tier's capacity plus a margin, and not with
    # the number of documents (keeping half of what passes after "mid" would already fail).
    assert rss["end"] - rss["start"] < (16 << 20) + (96 << 20)
    assert rss["end"] - rss["mid"] < 48 << 20


def test_corrupt_and_missing_entries_are_recomputed(engines):
    rc, c, log = engines["c"]
    assert rc == 0, log[-3000:]
    a = engines["a"]
    for i in range(4):
        assert same_prediction(a[f"cold{i}"], c["results"][f"c{i}"])
        assert logprobs_close(a[f"cold{i}"], c["results"][f"c{i}"], tol=0.02)
    # Every damaged entry that was read was detected and removed, never served.
    damage = engines["damage"]
    assert "corrupt" in log
    read_damaged = [p for p in damage["flipped"] + damage["truncated"] if not p.exists()]
    assert read_damaged, "no damaged entry was read"


def test_bad_extra_config_fails_engine_start_with_the_key(tmp_path):
    from kvtier.bench.models import make_random_model

    spec = {"model": str(make_random_model("small")), "docs": _docs(1), "pool_blocks": 24, "max_model_len": 2560,
            "kv_transfer_config": _connector([{"type": "ram", "capacity": "64MiB"}], tierz=[]), "steps": []}
    rc, _, log = run_scenario(tmp_path, "bad", spec)
    assert rc != 0
    assert "unknown key 'tierz'" in log and "valid keys" in log


def test_generated_tokens_are_saved_for_the_next_turn(tmp_path):
    """Turn 2 of a conversation re-reads turn 1's prompt and its answer. kvtier saved the chunks
    the answer completed too: with vLLM's own prefix cache emptied, turn 2 loads them all and
    predicts what plain vLLM predicts from its own prefix-cache hit on the same blocks (another
    engine, no connector; a turn-2 reference in the kvtier engine would save those chunks itself)."""
    from kvtier.bench.models import make_random_model

    docs = _docs(2)
    first = docs[0][:1000]
    base = {"model": str(make_random_model("small")), "docs": [first, docs[1]], "pool_blocks": 24,
            "max_model_len": 2560}
    turn1 = {"send": 0, "tag": "turn1", "max_tokens": 300}
    rc, ref, log = run_scenario(tmp_path, "plain", {**base, "steps": [turn1, {"follow": "turn1", "then": 1, "tag": "local"}]})
    assert rc == 0, log[-3000:]
    steps = [turn1, {"reset_prefix_cache": True}, {"follow": "turn1", "then": 1, "tag": "kv"}]
    tiers = [{"type": "ram", "capacity": "64MiB"}]
    rc, out, log = run_scenario(tmp_path, "turns", {**base, "kv_transfer_config": _connector(tiers), "steps": steps})
    assert rc == 0, log[-3000:]
    local, kv = ref["results"]["local"], out["results"]["kv"]
    assert out["results"]["turn1"]["token_ids"] == ref["results"]["turn1"]["token_ids"]
    computed = len(first) + 300 - 1  # the last generated token has no KV yet
    assert computed // CHUNK > len(first) // CHUNK  # the answer completes chunks of its own
    assert local["local_hit_tokens"] == computed // CHUNK * CHUNK
    assert kv["local_hit_tokens"] == 0 and kv["hit_tokens"] == computed // CHUNK * CHUNK
    assert kv["token_ids"] == local["token_ids"]


def test_a_request_can_ask_that_nothing_of_it_be_stored(tmp_path):
    """``kv_transfer_params: {"kvtier.skip_save": true}``: nothing of that request is stored
    (a later read of it recomputes), while its own hits still load; any other value is ignored
    with one warning (the request is stored)."""
    from kvtier.bench.models import make_random_model

    docs = [d[:1000] for d in _docs(3)]
    disk = tmp_path / "disk"
    tiers = [{"type": "ram", "capacity": "16MiB"}, {"type": "disk", "path": str(disk), "capacity": "1GiB"}]
    skip = {"kvtier.skip_save": True}
    steps = [{"send": 0, "tag": "skipped", "kv_transfer_params": skip},
             {"send": 1, "tag": "bad", "kv_transfer_params": {"kvtier.skip_save": "yes"}},
             {"send": 2, "tag": "stored", "kv_transfer_params": {"other.connector": 1}},
             {"reset_prefix_cache": True},
             {"send": 0, "tag": "again0"}, {"send": 1, "tag": "again1"},
             {"send": 2, "tag": "again2", "kv_transfer_params": skip}]
    spec = {"model": str(make_random_model("small")), "docs": docs, "pool_blocks": 24, "max_model_len": 2560,
            "kv_transfer_config": _connector(tiers), "steps": steps}
    rc, out, log = run_scenario(tmp_path, "skip", spec)
    assert rc == 0, log[-3000:]
    res = out["results"]
    stored = (len(docs[0]) - 1) // CHUNK * CHUNK
    assert res["again0"]["hit_tokens"] == 0 and res["again0"]["local_hit_tokens"] == 0  # never stored: recomputed
    assert res["again1"]["hit_tokens"] == stored  # a bad value: stored as usual
    assert res["again2"]["hit_tokens"] == stored  # a request that skips saving still loads its hit
    assert res["again2"]["token_ids"] == res["stored"]["token_ids"]
    assert log.count("kvtier.skip_save") == 1 and "valid: true or false" in log


def test_every_forward_pass_runs_inside_the_step_the_store_is_told_of(tmp_path):
    """The lower tiers' writers hold their copies while the engine's step runs
    (``writer_step_wait_s``): the store must be told of the step before the forward pass, also
    when the step has no synchronous loads (vLLM 0.32 then calls ``start_load_kv`` after the
    forward). A first pass in several prefill steps, then a re-read that loads: each forward
    lies between an ``engine_step(True)`` and the next ``engine_step(False)``."""
    from kvtier.bench.models import make_random_model

    docs = [d[:1200] for d in _docs(2)]
    tiers = [{"type": "ram", "capacity": "64MiB"}, {"type": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}]
    steps = [{"send": 0, "tag": "first"}, {"send": 1, "tag": "second", "max_tokens": 4},
             {"reset_prefix_cache": True}, {"send": 0, "tag": "again"}]
    spec = {"model": str(make_random_model("small")), "docs": docs, "pool_blocks": 40, "max_model_len": 2560,
            "kv_transfer_config": _connector(tiers), "steps": steps, "trace_steps": True,
            "engine_args": {"max_num_batched_tokens": 512, "enforce_eager": True}}
    rc, out, log = run_scenario(tmp_path, "steps", spec)
    assert rc == 0, log[-3000:]
    assert out["results"]["again"]["hit_tokens"] == (len(docs[0]) - 1) // CHUNK * CHUNK
    trace = out["step_trace"]
    assert trace.count("forward") >= 3 + 3 + 3 + 1  # three prefill steps a document, three decodes, the re-read
    running, outside = False, []
    for i, event in enumerate(trace):
        if event == "forward" and not running:
            outside.append(i)
        running = {"start": True, "end": False}.get(event, running)
    assert not outside, f"forward passes outside a step at {outside[:5]} of {len(trace)}: {trace[:12]}"
    assert trace.count("start") == trace.count("end") and trace[-1] == "end"

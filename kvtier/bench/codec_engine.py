"""The KV of a real vLLM engine, dumped through the store, for ``kvtier bench codec --kv engine``.

Per model family the connector serves (``FAMILIES``: ``small`` dense GQA, ``swa`` sliding window,
``mla`` latent attention, ``hybrid`` gated delta net + attention; random weights, made locally by
``kvtier.bench.models``), a vLLM CPU engine with kvtier's connector runs one random prompt in a
child process (``python -m kvtier.bench.codec_engine SPEC.json``) over RAM and an ``fs`` tier
(``codec: none``) in a temp dir; its writes land on the fs tier, and the entries read back from
it (headers parsed, checksums verified) are the KV to code: the bytes the connector stores, in
its layout, with each entry's dtype (recurrent state included, where the family has it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

if __name__ in ("__main__", "__mp_main__"):
    from kvtier.harness.procs import die_with_parent

    die_with_parent()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker in this process

# family -> (model maker argument, pool blocks, max_model_len, engine args). ``hybrid``: the
# Qwen3-Next-like model (vLLM raises its attention block to the state page: 256 tokens).
FAMILIES = {
    "small": ("qwen2:small", 320, 4352, {}),
    "swa": ("gemma3-swa", 320, 4352, {}),
    "mla": ("deepseek-mla", 320, 4352, {}),
    "hybrid": ("qwen3next-gdn", 320, 4352, {}),
}
SETTLE_S = 60.0  # the longest wait for the tier writes to land after the prompt
CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def model_dir(family: str) -> str:
    """The local random model of ``family`` (made once)."""
    from kvtier.bench.models import make_family_model, make_random_model

    source = FAMILIES[family][0]
    if source.startswith("qwen2:"):
        return str(make_random_model(source.split(":", 1)[1]))
    return str(make_family_model(source))


def engine_entries(family: str, tokens: int, timeout_s: float = 900.0) -> dict:
    """Run ``family``'s engine on one prompt of ``tokens`` random ids (seed 1) with kvtier over
    an fs tier in a temp dir, and read every stored entry back: {"model", "entries": [(dtype,
    shape, payload as a numpy uint8 array)], "engine_s"}. RuntimeError (one line, the log's
    tail) when the engine fails or stores nothing."""
    from kvtier import entry

    if family not in FAMILIES:
        from kvtier.errors import ConfigError

        raise ConfigError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    _, pool, max_len, engine_args = FAMILIES[family]
    if tokens + 64 > max_len:
        from kvtier.errors import ConfigError

        raise ConfigError(f"--tokens {tokens} is too long for the {family} engine (at most {max_len - 64})")
    model = model_dir(family)
    ids = np.random.default_rng(1).integers(100, 31000, tokens).tolist()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-codec-engine-") as tmp:
        fs = os.path.join(tmp, "fs")
        tiers = [{"type": "ram", "capacity": "256MiB"}, {"type": "fs", "path": fs, "capacity": "4GiB"}]
        spec = {"model": model, "prompt": ids, "pool_blocks": pool, "max_model_len": max_len,
                "engine_args": engine_args, "fs": fs,
                "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": {"tiers": tiers}}}
        spec_path, log_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "engine.log")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        from kvtier.harness.cpus import engine_cpu_env

        env = {**engine_cpu_env(), **os.environ}  # a binding given in the environment wins
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "kvtier.bench.codec_engine", spec_path], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        took = time.perf_counter() - start
        if proc.returncode != 0:
            with open(log_path, errors="replace") as f:
                tail = [x for x in f.read().splitlines() if x.strip()][-1:] or ["(no output)"]
            raise RuntimeError(f"the {family} engine failed (exit {proc.returncode}): {tail[0][:300]}")
        entries = []
        for root, _, files in os.walk(fs):
            for name in sorted(files):
                if name.startswith("."):
                    continue
                with open(os.path.join(root, name), "rb") as f:
                    blob = f.read()
                try:
                    header, payload = entry.decode(blob)
                except Exception:  # not an entry (the tier's own bookkeeping)
                    continue
                entries.append((header.dtype, tuple(header.shape), np.frombuffer(bytes(payload), np.uint8)))
    if not entries:
        raise RuntimeError(f"the {family} engine stored no entry on the fs tier")
    return {"model": model, "entries": entries, "engine_s": round(took, 1)}


def _files(path: str) -> int:
    return sum(1 for _, _, files in os.walk(path) for name in files if not name.startswith("."))


def main(spec_path: str) -> int:
    """The child: one engine, one prompt (a single token generated), then wait until the fs
    tier's file count stops growing (writes are in the background), and exit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.bench.engine_run import make_llm

    with open(spec_path) as f:
        spec = json.load(f)
    llm = make_llm(spec)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], SamplingParams(max_tokens=1, temperature=0.0),
                 use_tqdm=False)
    deadline, last, still = time.monotonic() + SETTLE_S, -1, 0
    while time.monotonic() < deadline and still < 4:
        time.sleep(0.5)
        now = _files(spec["fs"])
        still = still + 1 if now == last and now > 0 else 0
        last = now
    print(f"kvtier codec engine: {last} entries on the fs tier", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

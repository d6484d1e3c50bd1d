"""One vLLM engine with the kvtier connector: read a document twice, print timings and tokens.

Usage: python _engine.py SPEC_JSON   (a subprocess of test_cross_engine; the engine is spawned,
so the __main__ guard is needed). SPEC: model, kv_extra (kv_connector_extra_config), doc (token
ids), warm (token ids of an unrelated prompt run first so start-up costs are not timed), tp
(tensor-parallel size, default 1; the caller sets VLLM_CPU_OMP_THREADS_BIND to match), and
optionally pool_blocks (the engine's KV pool in blocks, default 70) and max_model_len (default 4096).
Prints one line ``RESULT {"first": {"s", "tokens", "hit_tokens"}, "again": {...}}``: ``first`` is the
engine's first read of ``doc`` (a kvtier hit when another engine stored it), ``again`` the second
read (a hit in vLLM's own prefix cache). With ``docs`` (a list of token-id lists) instead of
``doc``, the same engine reads each document twice in turn (one engine start serving several
scenarios) and the line is ``RESULT {"docs": [{"first": ..., "again": ...}, ...]}``.
"""

import json
import os
import sys
import time

if __name__ in ("__main__", "__mp_main__"):
    # this script and vLLM's engine processes (spawned: they re-import it as __mp_main__) die
    # with their parent, so a killed test run leaves no engine behind
    from kvtier.harness.procs import die_with_parent

    die_with_parent()

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: see scenario.py


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(sys.argv[1])
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=spec["kv_extra"])
    from kvtier.bench.engine_run import _counter

    tp = spec.get("tp", 1)
    parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              num_gpu_blocks_override=spec.get("pool_blocks", 70), max_model_len=spec.get("max_model_len", 4096), enforce_eager=True, dtype="bfloat16",
              kv_transfer_config=transfer, disable_log_stats=False, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=4, detokenize=False)

    def run(tokens):
        ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return {"s": time.perf_counter() - t0, "tokens": list(out[0].outputs[0].token_ids),
                "hit_tokens": int(_counter(llm, "vllm:external_prefix_cache_hits") - ext0)}

    run(spec["warm"])
    if "docs" in spec:
        result = {"docs": [{"first": run(doc), "again": run(doc)} for doc in spec["docs"]]}
    else:
        result = {"first": run(spec["doc"]), "again": run(spec["doc"])}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

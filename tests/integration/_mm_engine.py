"""One vLLM engine with the kvtier connector over a multimodal model: one text, two images.

Usage: python _mm_engine.py MODEL_DIR (a subprocess of test_multimodal; the engine is spawned, so
the __main__ guard is needed). vLLM's own prefix cache is off, so every hit is kvtier's. Prints
one line ``RESULT {tag: {"hit_tokens", "prompt_tokens"}}`` for the sends, in order: image A cold,
A again, B with the same text, B again, A a third time.
"""

import json
import os
import sys


def main() -> None:
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    from kvtier.bench.engine_run import _counter

    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"tiers": [{"type": "ram", "capacity": "64MiB"}], "chunk_tokens": 128}}
    llm = LLM(model=sys.argv[1], gpu_memory_utilization=0.3, num_gpu_blocks_override=32, max_model_len=1024,
              enforce_eager=True, dtype="bfloat16", kv_transfer_config=transfer, enable_prefix_caching=False,
              disable_log_stats=False, limit_mm_per_prompt={"image": 1}, seed=0)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)) for _ in range(2)]
    text = " ".join(f"w{i % 900}" for i in range(400))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = {}
    for tag, image in (("a_cold", 0), ("a_again", 0), ("b_same_text", 1), ("b_again", 1), ("a_third", 0)):
        before = _counter(llm, "vllm:external_prefix_cache_hits")
        res = llm.generate([{"prompt": text, "multi_modal_data": {"image": images[image]}}], params, use_tqdm=False)
        out[tag] = {"hit_tokens": int(_counter(llm, "vllm:external_prefix_cache_hits") - before),
                    "prompt_tokens": len(res[0].prompt_token_ids)}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: see scenario.py
    main()

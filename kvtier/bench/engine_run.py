"""One setting of the offload experiment, in its own process: start vLLM, replay the passes.

Run as ``python -m kvtier.bench.engine_run SPEC.json OUT.json``. Each setting gets a fresh
process so the engine's memory and its CPU thread binding are the same for every setting (the
caller sets ``VLLM_CPU_OMP_THREADS_BIND`` and ``OMP_NUM_THREADS`` identically for all of them).

The spec (JSON): model, docs (list of token-id lists), pool_blocks, passes (names -> order of
document indices), kv_transfer_config (or null), engine_hit_docs (how many documents to send
twice in a row to time vLLM's own prefix-cache hit), max_model_len, logprobs.
The result (JSON): for each pass, per document: TTFT in ms, external hit tokens, local hit
tokens, prompt tokens, the first generated token and its top log-probabilities.
"""

from __future__ import annotations

import json
import sys
import time


def _counter(llm, name: str) -> float:
    """Current value of a vLLM Prometheus counter (0 when absent)."""
    total = 0.0
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            total += metric.value
    return total


def _one(llm, tokens: list[int], sampling) -> dict:
    """Send one prompt, wait for its first token; TTFT and hit tokens of that request."""
    from vllm.inputs import TokensPrompt

    ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
    loc0 = _counter(llm, "vllm:prefix_cache_hits")
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sampling, use_tqdm=False)[0]
    ttft_ms = (time.perf_counter() - t0) * 1000
    completion = out.outputs[0]
    logprobs = {}
    if completion.logprobs:
        logprobs = {str(tok): lp.logprob for tok, lp in completion.logprobs[0].items()}
    return {
        "ttft_ms": ttft_ms,
        "hit_tokens": int(_counter(llm, "vllm:external_prefix_cache_hits") - ext0),
        "local_hit_tokens": int(_counter(llm, "vllm:prefix_cache_hits") - loc0),
        "query_tokens": len(tokens),
        "token_ids": list(completion.token_ids),
        "logprobs": logprobs,
    }


def run(spec: dict) -> dict:
    """Run the passes of ``spec`` on one engine; see the module docstring."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5),
        num_gpu_blocks_override=spec["pool_blocks"],
        max_model_len=spec["max_model_len"],
        kv_transfer_config=spec.get("kv_transfer_config"),
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=spec.get("logprobs", 5))
    docs = spec["docs"]
    _one(llm, spec["warmup"], sampling)  # first request pays one-off costs
    result = {"passes": {}, "engine_hit": []}
    for name, order in spec["passes"].items():
        result["passes"][name] = [dict(_one(llm, docs[i], sampling), doc=i) for i in order]
    for i in range(spec.get("engine_hit_docs", 0)):
        extra = spec["hit_docs"][i]
        first = _one(llm, extra, sampling)
        again = _one(llm, extra, sampling)  # the pool holds one document: a local prefix hit
        result["engine_hit"].append({"first": first, "again": again})
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Scripted steps on one real vLLM engine for the asynchronous-transfer tests.

``python tests/integration/_async_engine.py SPEC.json OUT.json``. The spec is ``scenario.py``'s
(model, pool_blocks, max_model_len, kv_transfer_config, docs, steps) with two more kinds of step:

- ``{"batch": [DOC, ...], "max_tokens": [N, ...], "tag": NAME}``: every document at once in one
  ``generate`` call (they queue, load and decode together in a small pool); records each
  prompt's tokens and first-token log-probabilities, and the batch's external hit tokens;
- ``{"abort": DOC, "steps": K, "tag": NAME}``: adds DOC through the engine, steps it K times
  (long enough for its lookup and the start of its load), aborts it, and steps until the
  engine has nothing left; records how many outputs it produced.

``{"send": DOC, "tag": NAME}`` and ``{"reset_prefix_cache": true}`` are as in ``scenario.py``.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ in ("__main__", "__mp_main__"):
    # this script and vLLM's engine processes die with their parent (see scenario.py)
    from kvtier.harness.procs import die_with_parent

    die_with_parent()

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: see scenario.py


def _first_logprobs(completion) -> dict[str, float]:
    if not completion.logprobs:
        return {}
    return {str(tok): lp.logprob for tok, lp in completion.logprobs[0].items()}


def _batch(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.bench.engine_run import _counter

    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=5) for n in max_tokens]
    ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return {"hit_tokens": int(_counter(llm, "vllm:external_prefix_cache_hits") - ext0),
            "outputs": [{"token_ids": list(o.outputs[0].token_ids), "logprobs": _first_logprobs(o.outputs[0])}
                        for o in outs]}


def _abort(llm, prompt: list[int], steps: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    engine.add_request("kvtier-abort", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=8))
    outputs = 0
    for _ in range(steps):
        outputs += len(engine.step())
    engine.abort_request(["kvtier-abort"])
    while engine.has_unfinished_requests():
        outputs += len(engine.step())
    return {"outputs": outputs}


def main(spec_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams

    from kvtier.bench.engine_run import _one

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              num_gpu_blocks_override=spec["pool_blocks"], max_model_len=spec.get("max_model_len", 4096),
              kv_transfer_config=spec.get("kv_transfer_config"), enable_prefix_caching=True,
              disable_log_stats=False, seed=0, enforce_eager=True)  # no torch.compile: see scenario.py
    docs = spec["docs"]
    out: dict = {"results": {}}
    for step in spec["steps"]:
        if "send" in step:
            sampling = SamplingParams(max_tokens=step.get("max_tokens", 1), temperature=0.0, logprobs=5)
            out["results"][step["tag"]] = _one(llm, docs[step["send"]], sampling)
        elif "batch" in step:
            out["results"][step["tag"]] = _batch(llm, [docs[i] for i in step["batch"]], step["max_tokens"])
        elif "abort" in step:
            out["results"][step["tag"]] = _abort(llm, docs[step["abort"]], step["steps"])
        elif "reset_prefix_cache" in step:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

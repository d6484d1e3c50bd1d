"""Run a small model through vLLM with a given load format; print the greedy tokens as JSON and,
with one rank, a digest of the weights as loaded.

Usage: python _vllm_greedy.py MODEL_DIR LOAD_FORMAT [EXTRA_CONFIG_JSON [TP]]
A subprocess of the vLLM test (the engine is spawned, so it needs the __main__ guard).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: see scenario.py


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, load_format = sys.argv[1], sys.argv[2]
    extra = {"model_loader_extra_config": json.loads(sys.argv[3])} if len(sys.argv) > 3 and sys.argv[3] else {}
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if tp > 1:
        extra.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    llm = LLM(model=model, load_format=load_format, **extra, skip_tokenizer_init=True, gpu_memory_utilization=0.3, num_gpu_blocks_override=16,
              max_model_len=512, enforce_eager=True, dtype="bfloat16")
    prompts = [TokensPrompt(prompt_token_ids=[(i * 37 + j * 11) % 30000 + 5 for j in range(24)]) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, detokenize=False))
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    if tp == 1:  # the weights as loaded: what a loader must reproduce bit for bit
        print("DIGEST " + json.dumps(llm.apply_model(_digest)), flush=True)


def _digest(model) -> str:
    """SHA-256 over every parameter's name and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(param.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()

"""Run a scripted scenario on one real vLLM engine in this process (used by the tests).

``python tests/integration/scenario.py SPEC.json OUT.json``. The spec names the model, the pool
size, the kv_transfer_config, the documents and the steps: ``{"send": DOC, "tag": NAME}`` sends a
document and records its result under NAME (``"max_tokens": N`` generates N tokens instead of the
spec's default; ``"kv_transfer_params": {...}`` goes with the request); ``{"follow": NAME, "then": DOC, "tag": NAME2}`` sends the next turn of a
conversation: NAME's prompt, the tokens it generated, then the first 64 tokens of DOC;
``{"reset_prefix_cache": true}`` empties vLLM's own prefix cache; ``{"rss": NAME}`` records the
summed RSS of this process tree (the engine runs in this process; vLLM's own processes count
when it has any). With ``"trace_steps": true`` the output's ``step_trace`` lists, in order, the
connector's store's ``engine_step`` calls (``start`` / ``end``) and the model's forward passes
(``forward``).
"""

from __future__ import annotations

import json
import os
import sys

import psutil

if __name__ in ("__main__", "__mp_main__"):
    # this script and vLLM's engine processes (spawned: they re-import it as __mp_main__) die
    # with their parent, so a killed test run leaves no engine behind
    from kvtier.harness.procs import die_with_parent

    die_with_parent()

# vLLM's in-process mode (engine core and worker in this process): ~30 s less per engine start than
# its three processes. The other offline engine scripts of the tests do the same; the HTTP-server
# and benchmark tests keep vLLM's processes (connector metadata crossing a process boundary).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# torch.compile: the engines of this script (test_connector's) keep it, the suite's one run of the
# connector beside a compiled model; the other offline engine scripts, the routing tests and the
# benchmark smoke runs pass enforce_eager (its warm-up is 20-90 s per engine start on two cores).


def tree_rss() -> int:
    """Resident bytes of this process and all its descendants."""
    me = psutil.Process(os.getpid())
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def trace_steps(llm) -> list[str]:
    """Record the worker store's ``engine_step`` calls and the model's forward passes, in order,
    into the list returned (the engine and its worker run in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    trace: list[str] = []
    store = get_kv_transfer_group().worker.store
    engine_step = store.engine_step

    def traced(running: bool) -> None:
        trace.append("start" if running else "end")
        engine_step(running)

    store.engine_step = traced
    llm.apply_model(lambda model: model.register_forward_pre_hook(lambda module, args: trace.append("forward")))
    return trace


def main(spec_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams

    from kvtier.bench.engine_run import _one

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=0.3,
              num_gpu_blocks_override=spec["pool_blocks"], max_model_len=spec.get("max_model_len", 4096),
              kv_transfer_config=spec.get("kv_transfer_config"),
              **{"enable_prefix_caching": True, "disable_log_stats": False, "seed": 0, **spec.get("engine_args", {})})
    docs = spec["docs"]
    out: dict = {"results": {}, "rss": {}}
    if spec.get("trace_steps"):
        out["step_trace"] = trace_steps(llm)
    prompts: dict[str, list[int]] = {}
    for step in spec["steps"]:
        extra = {"kv_transfer_params": step["kv_transfer_params"]} if "kv_transfer_params" in step else None
        sampling = SamplingParams(max_tokens=step.get("max_tokens", spec.get("max_tokens", 1)), temperature=0.0,
                                  logprobs=5, extra_args=extra)
        if "send" in step or "follow" in step:
            if "send" in step:
                prompt = docs[step["send"]]
            else:
                prompt = prompts[step["follow"]] + out["results"][step["follow"]]["token_ids"] + docs[step["then"]][:64]
            prompts[step["tag"]] = prompt
            out["results"][step["tag"]] = _one(llm, prompt, sampling)
        elif "reset_prefix_cache" in step:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
        elif "rss" in step:
            out["rss"][step["rss"]] = tree_rss()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

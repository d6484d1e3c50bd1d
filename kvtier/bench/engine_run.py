"""One setting of the offload experiment, in its own process: a vLLM engine driven by the caller.

Run as ``python -m kvtier.bench.engine_run SPEC.json``; the caller drives it one request at a
time over stdin/stdout (``serve``), so several settings' engines can be alive at once and their
requests interleaved: noise from a shared machine then falls on every setting alike. The caller
sets ``VLLM_CPU_OMP_THREADS_BIND`` and ``OMP_NUM_THREADS`` identically for every engine.
Whoever starts it, this process and the engine processes vLLM spawns end when their parent
does, even on SIGKILL (``kvtier.bench.procs.die_with_parent``).

The spec (JSON): model, docs and hit_docs (lists of token-id lists), warmup (token ids),
pool_blocks, max_model_len, kv_transfer_config (or null), logprobs. Each answer: TTFT in ms,
external and local hit tokens, prompt tokens, the generated token and its top log-probabilities.
"""

from __future__ import annotations

import json
import sys
import time

if __name__ in ("__main__", "__mp_main__"):
    # This process, and vLLM's engine-core (and worker) processes, which multiprocessing's spawn
    # start method runs with this module re-imported as __mp_main__, each die with their parent.
    from kvtier.bench.procs import die_with_parent

    die_with_parent()


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


MARKER = "@@kvtier "  # prefix of protocol lines on stdout (vLLM's own logs share the stream)


def serve(spec: dict) -> None:
    """Start the engine, then answer commands from stdin, one JSON object per line.

    ``{"doc": I}`` sends document I, ``{"hit": I}`` the I-th engine-hit probe document, and
    ``{"quit": true}`` ends. Each answer is one stdout line: MARKER + JSON (see ``_one``).
    """
    def handle(llm, cmd: dict, sampling) -> dict:
        tokens = spec["docs"][cmd["doc"]] if "doc" in cmd else spec["hit_docs"][cmd["hit"]]
        return _one(llm, tokens, sampling)

    command_loop(spec, spec.get("logprobs", 5), handle)


def command_loop(spec: dict, logprobs: int, handle) -> None:
    """The engine processes' protocol: build ``spec``'s engine, send its warm-up prompt (one-off
    costs), answer ``{"ready": true}``, then answer each stdin command (one JSON object per
    line) with ``handle(llm, cmd, sampling)`` until ``{"quit": true}`` or EOF. ``sampling``:
    one greedy token with ``logprobs`` log-probabilities."""
    from vllm import SamplingParams

    llm = make_llm(spec)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=logprobs)
    _one(llm, spec["warmup"], sampling)
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        _answer(handle(llm, cmd, sampling))


def make_llm(spec: dict):
    """The benchmark engine of ``spec``: model, pool (``pool_blocks``), ``max_model_len``, an
    optional ``kv_transfer_config``, ``gpu_memory_utilization`` (0.3) and ``enforce_eager``
    (False); prefix caching on, stats on, seed 0, no tokenizer."""
    from vllm import LLM

    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        num_gpu_blocks_override=spec["pool_blocks"],
        max_model_len=spec["max_model_len"],
        kv_transfer_config=spec.get("kv_transfer_config"),
        enable_prefix_caching=True,
        disable_log_stats=False,
        enforce_eager=bool(spec.get("enforce_eager", False)),
        seed=0,
    )


def _answer(obj: dict) -> None:
    sys.stdout.write(MARKER + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        serve(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

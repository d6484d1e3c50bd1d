"""``kvtier bench seed``: every measurement table of the document's section 7, side by side with
the document's figures, on this machine's vLLM (CPU) and a small random model.

Experiments (``--experiment``, repeatable or comma-separated; default: all):

* ``zipf``: 60 documents, a warm pass, then 60 requests drawn from Zipf s=1; mean/p50/p95 TTFT
  and the external hit share for vLLM alone, a RAM tier at the document's 0.5/1.0/1.5/2.0 GB of a
  1.49 GB working set (scaled), RAM 0.2 + disk, and the same RAM sizes with ``policy: lru``.
* ``length``: recompute (vLLM alone) vs load from the RAM tier vs vLLM's own prefix hit, at the
  document's input lengths, on the small and the KV-heavy model.
* ``disk``: re-read from a disk tier with its files dropped from the page cache (cold) and read
  into it (warm), p50 and p95, beside RAM and recompute (from ``length`` at the same length).
* ``chunk``: a 2,000-token shared prefix + 1,000-token tails, the prefix evicted from vLLM's
  pool first, at chunk sizes 128-1,024 (multiples of the CPU block size, 128).
* ``concurrency``: the re-read at 1, 2, 4, 8 requests in flight; TTFT p50/p95, output tokens/s.
* ``breakeven``: p* = miss cost / (miss cost + hit gain) per tier from the runs above.

Sizes are scaled to this machine as ``kvtier demo`` scales them: the working set relative to
vLLM's pool and the RAM tier keeps the document's ratios; the scaling is printed. Every engine
runs in its own process with the same CPU thread binding; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench import seed_report
from kvtier.bench.seed_data import BLOCK, DOC_WORKING_SET_GB, EXPERIMENTS, Run, Scale
from kvtier.errors import ConfigError, KVTierError

if TYPE_CHECKING:
    from kvtier.bench.seed_engines import EngineSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier bench seed``."""
    parser.add_argument("--experiment", action="append", metavar="NAME",
                        help=f"one of {', '.join(EXPERIMENTS)} (repeatable or comma-separated; default: all)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (small model only), under 5 minutes on two cores")
    parser.add_argument("--variants", metavar="LIST",
                        help="models for the length and disk experiments: small, kv-heavy (default: both; --quick: small)")
    parser.add_argument("--json", action="store_true", help="print one JSON document: rows, targets, scale, machine")
    parser.add_argument("--plot", metavar="DIR", help="write one PNG per experiment (seed-NAME.png) into DIR")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown (docs/seed-results.md)")
    parser.add_argument("--max-engines", type=int, default=4, help="engines alive at once (default 4; lower it to save memory)")
    parser.add_argument("--settle-ms", type=float, default=1500,
                        help="quiet time before an engine's turn (vLLM's worker busy-polls ~1 s after a step; 1500)")
    parser.add_argument("--compiled", action="store_true",
                        help="let vLLM torch.compile the model (about a minute more per engine start; default: eager)")
    parser.add_argument("--work-dir", help="where disk tiers and engine logs go (default: a temp dir)")


def parse_experiments(values: list[str] | None) -> tuple[str, ...]:
    """The experiments asked for, in the canonical order; ConfigError naming the valid ones."""
    if not values:
        return EXPERIMENTS
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    for name in names:
        if name not in EXPERIMENTS:
            raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    wanted = set(names)
    if "breakeven" in wanted:  # computed from these runs
        wanted |= {"length", "disk"}
    if "disk" in wanted:  # its RAM and recompute columns come from the length runs
        wanted.add("length")
    return tuple(e for e in EXPERIMENTS if e in wanted)


def run(args: argparse.Namespace) -> int:
    """Run the experiments, print tables (or JSON), write plots and Markdown. 0, or 1 when an
    engine group failed (its error is in the report, the other groups' figures are kept)."""
    experiments = parse_experiments(args.experiment)
    if args.max_engines < 1:
        raise ConfigError("--max-engines must be at least 1")
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
    scale = Scale.quick() if args.quick else Scale()
    if args.variants:
        variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        for v in variants:
            if v not in ("small", "kv-heavy"):
                raise ConfigError(f"unknown model variant {v!r}; valid: small, kv-heavy")
        if "small" not in variants:
            variants = ("small", *variants)  # zipf, chunk and concurrency run on the small model
        scale = replace(scale, variants=variants)
    result = Run(experiments, scale, started=time.time(), load_start=_loadavg())
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-seed-", dir=args.work_dir) as work:
            _measure(result, args, Path(work))
    finally:
        signal.signal(signal.SIGTERM, previous)
    result.seconds = time.time() - result.started
    report = seed_report.build(result, command=_command_line(args))
    if args.plot:
        seed_report.plot_all(report, Path(args.plot))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(seed_report.markdown(report, plot_dir=args.plot, md_path=args.markdown))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        seed_report.print_text(report)
    return 1 if result.errors else 0


def _loadavg() -> tuple[float, ...]:
    """The 1/5/15-minute load averages (empty where the platform has none)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return ()


class Interrupted(KVTierError):
    """SIGTERM or Ctrl-C: the running group stops, later groups are skipped, the report of what
    was measured is still written."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Interrupted("interrupted by SIGTERM")


def _command_line(args: argparse.Namespace) -> str:
    parts = ["kvtier bench seed"]
    if args.experiment:
        parts += [f"--experiment {','.join(args.experiment)}"]
    if args.quick:
        parts.append("--quick")
    if args.variants:
        parts.append(f"--variants {args.variants}")
    if args.compiled:
        parts.append("--compiled")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# planning: which engines, in which groups


@dataclass(frozen=True)
class Role:
    """One engine and what it serves: its spec and the experiment parts that use it."""

    spec: "EngineSpec"
    uses: tuple[str, ...]


def _bytes_per_token(model: str) -> int:
    from kvtier.plan import kv_shape, load_model_config

    return kv_shape(load_model_config(model)).bytes_per_token


def _gb_to_bytes(gb: float, scale: Scale, bpt: int) -> int:
    """The document's RAM size ``gb`` (of its 1.49 GB working set) scaled to our working set."""
    return int(gb / DOC_WORKING_SET_GB * scale.zipf_working_tokens() * bpt)


def _plan_small(experiments: tuple[str, ...], scale: Scale, bpt: int, work: Path, pool: int, max_len: int) -> list[list[Role]]:
    """Engine groups for the small model: the shared group first (vLLM alone, a RAM tier that
    holds everything, a disk-only tier), then the zipf sizes and other chunk sizes."""
    from kvtier.bench.seed_engines import EngineSpec, kvtier_config

    def spec(name: str, tiers: list[dict] | None, chunk: int | None = None) -> EngineSpec:
        return EngineSpec(name, kvtier_config(tiers, chunk) if tiers is not None else None, pool, max_len)

    stored = (scale.zipf_working_tokens() + sum(scale.lengths) + scale.chunk_reps * (scale.chunk_prefix + 2 * scale.chunk_tail)
              + scale.conc_docs * scale.conc_tokens)
    big = int(1.3 * stored * bpt) + (64 << 20)
    shared: list[Role] = []
    uses_vllm = tuple(e for e in ("zipf", "length", "chunk", "concurrency") if e in experiments)
    if uses_vllm:
        shared.append(Role(spec("vllm", None), uses_vllm))
        shared.append(Role(spec("kvtier-ram", [{"type": "ram", "capacity": big}]), uses_vllm))
    if "disk" in experiments:
        disk_cap = 2 * scale.disk_docs * scale.disk_tokens * bpt + (256 << 20)
        shared.append(Role(spec("kvtier-disk", [{"type": "disk", "path": str(work / "small-disk"), "capacity": disk_cap}]),
                           ("disk",)))
    extra: list[Role] = []
    if "zipf" in experiments:
        for gb in scale.zipf_gb:
            if gb * 1.0 >= max(scale.zipf_gb) and gb > DOC_WORKING_SET_GB:
                continue  # holds everything: the shared kvtier-ram engine is that setting
            extra.append(Role(spec(f"zipf-ram-{gb:g}", [{"type": "ram", "capacity": _gb_to_bytes(gb, scale, bpt)}]), ("zipf",)))
        for gb in scale.zipf_lru_gb:
            extra.append(Role(spec(f"zipf-ram-{gb:g}-lru", [{"type": "ram", "policy": "lru",
                                                                "capacity": _gb_to_bytes(gb, scale, bpt)}]), ("zipf",)))
        disk_cap = 4 * scale.zipf_working_tokens() * bpt + (256 << 20)
        extra.append(Role(spec(f"zipf-ram-{scale.zipf_disk_gb:g}+disk",
                               [{"type": "ram", "capacity": _gb_to_bytes(scale.zipf_disk_gb, scale, bpt)},
                                {"type": "disk", "path": str(work / "zipf-disk"), "capacity": disk_cap}]), ("zipf",)))
    if "chunk" in experiments:
        for size in scale.chunk_sizes:
            if size != BLOCK:  # the connector's default chunk is one block: the shared engine
                cap = int(1.3 * scale.chunk_reps * (scale.chunk_prefix + 2 * scale.chunk_tail) * bpt) + (64 << 20)
                extra.append(Role(spec(f"chunk-{size}", [{"type": "ram", "capacity": cap}], size), ("chunk",)))
    groups = [shared] if shared else []
    return groups + [extra[i:i + 4] for i in range(0, len(extra), 4)]


def _plan_heavy(experiments: tuple[str, ...], scale: Scale, bpt: int, work: Path, pool: int, max_len: int) -> list[list[Role]]:
    """The KV-heavy model's group: vLLM alone, a RAM tier, a disk-only tier (length and disk)."""
    from kvtier.bench.seed_engines import EngineSpec, kvtier_config

    roles: list[Role] = []
    if "length" in experiments:
        cap = int(1.2 * sum(scale.lengths) * bpt) + (64 << 20)
        roles.append(Role(EngineSpec("vllm", None, pool, max_len), ("length",)))
        roles.append(Role(EngineSpec("kvtier-ram", kvtier_config([{"type": "ram", "capacity": cap}]), pool, max_len), ("length",)))
    if "disk" in experiments:
        cap = 2 * scale.heavy_disk_docs * scale.disk_tokens * bpt + (256 << 20)
        roles.append(Role(EngineSpec("kvtier-disk", kvtier_config([{"type": "disk", "path": str(work / "heavy-disk"),
                                                                     "capacity": cap}]), pool, max_len), ("disk",)))
    return [roles] if roles else []


# --------------------------------------------------------------------------------------------
# running


def _measure(result: Run, args: argparse.Namespace, work: Path) -> None:
    """Plan the engine groups per model, start each group, run the experiments that use it."""
    from tqdm import tqdm

    from kvtier.bench.models import make_random_model

    scale, experiments = result.scale, result.experiments
    plans = []
    for variant in scale.variants:
        if variant != "small" and not {"length", "disk"} & set(experiments):
            continue
        model = str(make_random_model(variant))
        bpt = _bytes_per_token(model)
        result.bytes_per_token[variant] = bpt
        longest = max([scale.chunk_prefix + scale.chunk_tail, scale.disk_tokens, *scale.lengths,
                       scale.zipf_tokens, scale.conc_tokens])
        pool = scale.pool_tokens(longest) if variant == "small" else -(-(longest + 2 * BLOCK) // BLOCK) * BLOCK
        max_len = -(-(longest + 64) // BLOCK) * BLOCK
        result.pools[variant] = pool
        planner = _plan_small if variant == "small" else _plan_heavy
        groups = planner(experiments, scale, bpt, work, pool, max_len)
        groups = [g[i:i + args.max_engines] for g in groups for i in range(0, len(g), args.max_engines)]
        plans += [(variant, model, g) for g in groups]
    total = sum(_requests(role, scale, variant) for variant, _m, g in plans for role in g)
    quiet = args.json and not sys.stderr.isatty()
    stopped = ""
    with tqdm(total=total, desc="kvtier bench seed", unit="req", file=sys.stderr, disable=quiet) as bar:
        for variant, model, group in plans:
            names = ", ".join(r.spec.name for r in group)
            bar.set_postfix_str(f"{variant}: starting {names}")
            if stopped:
                result.errors.append(f"{variant} [{names}]: skipped ({stopped})")
                continue
            try:
                _run_group(result, variant, model, group, args, work, bar)
            except (KVTierError, KeyboardInterrupt) as exc:  # one group's failure must not discard the others' figures
                if isinstance(exc, (Interrupted, KeyboardInterrupt)):
                    stopped = str(exc) or "interrupted"
                result.errors.append(f"{variant} [{names}]: {(str(exc) or 'interrupted').splitlines()[0]}")
                print(f"error: {variant} [{names}]: {exc}", file=sys.stderr)


def _requests(role: Role, scale: Scale, variant: str) -> int:
    """Requests one engine will be sent (for the progress bar's total)."""
    name, n = role.spec.name, 0
    reps = scale.length_reps if variant == "small" else scale.heavy_length_reps
    docs = scale.disk_docs if variant == "small" else scale.heavy_disk_docs
    if "zipf" in role.uses:
        n += scale.zipf_docs + scale.zipf_requests
    if "length" in role.uses:
        n += len(scale.lengths) * (2 * reps if name == "vllm" else 1 + reps)
    if "disk" in role.uses:
        n += docs * (1 + 2 * scale.disk_rounds)
    if "chunk" in role.uses:
        n += 2 * scale.chunk_reps
    if "concurrency" in role.uses:
        n += scale.conc_docs * (1 + len(scale.conc_levels))
    return n


def _run_group(result: Run, variant: str, model: str, group: list[Role], args: argparse.Namespace, work: Path, bar) -> None:
    """Start the group's engines and run, in order, every experiment some of them serve."""
    from kvtier.bench import seed_experiments as ex
    from kvtier.bench.seed_engines import engines

    scale, settle = result.scale, args.settle_ms / 1000
    raw = result.raw.setdefault(variant, {})

    def tick(n: int) -> None:
        bar.update(n)

    names_for = {e: [r.spec.name for r in group if e in r.uses] for e in EXPERIMENTS}
    with engines([r.spec for r in group], model, work, enforce_eager=not args.compiled) as live:
        if names_for["zipf"]:
            bar.set_postfix_str(f"{variant}: zipf")
            w = ex.zipf_workload(scale.zipf_docs, scale.zipf_tokens, scale.zipf_requests)
            raw.setdefault("zipf", {}).update(ex.run_zipf(live, names_for["zipf"], w, settle, tick))
        if names_for["length"]:
            bar.set_postfix_str(f"{variant}: length")
            docs = {n: d for n, d in zip(scale.lengths, ex.random_docs(len(scale.lengths), max(scale.lengths), 554))}
            docs = {n: d[:n] for n, d in docs.items()}
            reps = scale.length_reps if variant == "small" else scale.heavy_length_reps
            raw["length"] = ex.run_length(live, "vllm", "kvtier-ram", docs, reps, settle, tick)
        if names_for["disk"]:
            bar.set_postfix_str(f"{variant}: disk")
            count = scale.disk_docs if variant == "small" else scale.heavy_disk_docs
            docs = ex.random_docs(count, scale.disk_tokens, 4273)
            disk_dir = work / ("small-disk" if variant == "small" else "heavy-disk")
            raw["disk"] = ex.run_disk(live[names_for["disk"][0]], disk_dir, docs, scale.disk_rounds, settle, tick)
        if names_for["chunk"]:
            bar.set_postfix_str(f"{variant}: chunk")
            pairs = ex.chunk_workload(scale.chunk_reps, scale.chunk_prefix, scale.chunk_tail)
            kv = [n for n in names_for["chunk"] if n != "vllm"]
            base = "vllm" if "vllm" in names_for["chunk"] else None
            raw.setdefault("chunk", {}).update(ex.run_chunk(live, base, kv, pairs, settle, tick))
        if names_for["concurrency"]:
            bar.set_postfix_str(f"{variant}: concurrency")
            docs = ex.random_docs(scale.conc_docs, scale.conc_tokens, 88)
            raw["concurrency"] = ex.run_concurrency(live, names_for["concurrency"], docs, list(scale.conc_levels),
                                                    scale.conc_max_tokens, settle, tick)

"""Weight-loading commands: ``pull`` (node cache), ``shard`` (pre-sharded layout), ``probe``
(read throughput per block size and concurrency) and ``load`` (stream a model, report GB/s)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from kvtier.cli._common import emit_json, print_table
from kvtier.config import format_bytes, parse_size
from kvtier.errors import ConfigError


def _default_cache() -> str:
    """The node cache directory: $KVTIER_CACHE_DIR, else ~/.cache/kvtier/models."""
    return os.environ.get("KVTIER_CACHE_DIR", os.path.expanduser("~/.cache/kvtier/models"))


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``pull``, ``shard``, ``probe`` and ``load``."""
    p = sub.add_parser("pull", help="download a remote model once per node into a local cache",
                       description=_pull.__doc__)
    p.add_argument("uri", help="s3://bucket/prefix/ of a model directory")
    p.add_argument("--cache-dir", default=_default_cache(),
                   help="node cache directory (default: $KVTIER_CACHE_DIR, else ~/.cache/kvtier/models)")
    p.add_argument("--concurrency", type=int, default=16, help="parallel ranged GETs (default 16)")
    p.add_argument("--block-size", default="16MiB", help="bytes per ranged GET (default 16MiB)")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL, else AWS)")
    _max_object_size(p)
    _common(p)
    p.set_defaults(func=_pull)

    p = sub.add_parser("shard", help="write vLLM's pre-sharded layout model-rank-R-part-P.safetensors",
                       description=_shard.__doc__)
    p.add_argument("model", help="model directory, or s3:// URI (pulled into the node cache first)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel world size to cut the model for")
    p.add_argument("--cache-dir", default=_default_cache(), help="node cache for an s3:// model")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--max-part-size", default="5GB", help="largest file per rank (default 5GB)")
    _common(p)
    p.set_defaults(func=_shard)

    p = sub.add_parser("probe", help="read throughput of a file per block size and concurrency (read-only)",
                       description=_probe.__doc__)
    p.add_argument("path", help="an existing file to read (never written)")
    p.add_argument("--block-sizes", default="128KiB,1MiB,16MiB",
                   help="comma-separated read sizes, units as everywhere in kvtier: KB/MB = powers of 1000, "
                        "KiB/MiB = powers of 1024 (default 128KiB,1MiB,16MiB)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated thread counts")
    p.add_argument("--max-bytes", default=None, help="read at most this much per run")
    p.add_argument("--cold", action="store_true", help="O_DIRECT reads (bypass the page cache)")
    _common(p)
    p.set_defaults(func=_probe)

    p = sub.add_parser("load", help="stream every tensor of a model and report throughput",
                       description=_load.__doc__)
    p.add_argument("model", help="model directory, .safetensors file, or s3:// URI")
    p.add_argument("--cache-dir", default=None, help="read s3:// models through this node cache")
    _reader_args(p)
    p.set_defaults(func=_load)


def _max_object_size(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-object-size", default="1TiB",
                   help="refuse objects listed or sized larger than this (default 1TiB)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _reader_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=0, help="parallel reads (0: source default)")
    p.add_argument("--block-size", default="16MiB", help="bytes per read (default 16MiB; KB = 1000, KiB = 1024)")
    p.add_argument("--memory-limit", default="1GiB", help="bytes of tensors read ahead at most (default 1GiB)")
    p.add_argument("--check-values", action="store_true", help="reject NaN/Inf")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL)")
    _max_object_size(p)
    _common(p)


def _reader_config(args):
    from kvtier.config import build
    from kvtier.loader.reader import ReaderConfig

    return build(ReaderConfig, {
        "concurrency": args.concurrency, "block_size": args.block_size,
        "memory_limit": args.memory_limit, "check_values": args.check_values,
        "endpoint_url": args.endpoint_url, "max_object_size": args.max_object_size,
    }, "loader")


@contextlib.contextmanager
def _progress(args, desc: str, total: int | None = None, unit: str = "B"):
    if args.no_progress or not sys.stderr.isatty() and args.json:
        yield None
        return
    from tqdm import tqdm

    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=args.no_progress, **scale) as bar:
        yield bar


def _pull(args) -> int:
    """Download every object under an s3:// prefix into the node-local cache, once per node."""
    from kvtier.loader.cache import pull
    from kvtier.loader.sources.s3 import S3Config

    start = time.perf_counter()
    max_size = parse_size(args.max_object_size, "--max-object-size")
    s3 = S3Config(max_pool_connections=args.concurrency + 4, endpoint_url=args.endpoint_url,
                  max_object_size=max_size)
    with _progress(args, "pull") as bar:  # a tqdm without a total has no truth value: test for None
        result = pull(args.uri, args.cache_dir, args.concurrency, parse_size(args.block_size, "--block-size"),
                      {"config": s3}, on_bytes=bar.update if bar is not None else None,
                      on_total=(lambda n: _set_total(bar, n)) if bar is not None else None,
                      max_object_size=max_size)
    secs = time.perf_counter() - start
    out = {"path": result.path, "downloaded": result.downloaded, "bytes": result.bytes_downloaded,
           "files": result.files, "seconds": secs,
           "gb_per_s": result.bytes_downloaded / secs / 1e9 if secs and result.bytes_downloaded else 0.0}
    if args.json:
        emit_json(out)
    else:
        what = f"downloaded {format_bytes(result.bytes_downloaded)}" if result.downloaded else "already cached"
        print(f"{what}, {result.files} files", file=sys.stderr)
        print(result.path)  # alone on stdout: vllm serve "$(kvtier pull s3://...)" works
    return 0


def _set_total(bar, total: int) -> None:
    """Give a running progress bar its total once the listing is known."""
    bar.total = total
    bar.refresh()


def _shard(args) -> int:
    """Cut a model for tensor parallelism into vLLM's pre-sharded layout, each rank's parameters
    in model-rank-{rank}-part-{part}.safetensors, so each rank of a later engine reads only its own
    files (--load-format kvtier, or vLLM's sharded_state). vLLM itself decides the cut: an engine
    with tensor_parallel_size=TP is started (on this host's GPUs, or its CPUs) and each rank saves
    its parameters. The config and tokenizer files are copied along, so --out is a model directory.
    Every safetensors header is validated first: a malformed checkpoint fails in one line, before
    any pull or engine start."""
    from kvtier.integrations.vllm.shard import PHASES, ShardJob, check_checkpoint, shard
    from kvtier.loader.cache import resolve
    from kvtier.loader.sources import scheme_of

    if scheme_of(args.model) != "file":
        check_checkpoint(args.model)  # every header of the remote model, before pulling it
    model = resolve(args.model, args.cache_dir)  # an s3:// model: pulled once per node
    job = ShardJob(model, args.out, args.tp, parse_size(args.max_part_size, "max-part-size"))
    job.check()
    with _progress(args, "shard", len(PHASES), unit="step") as bar:
        def on_phase(name: str) -> None:
            if bar is not None:
                if name != PHASES[0]:
                    bar.update(1)
                bar.set_postfix_str(name)
        manifest = shard(job, on_phase)
        if bar is not None:
            bar.update(len(PHASES) - bar.n)
    if args.json:
        emit_json(manifest)
    else:
        print("\n".join(os.path.join(args.out, n) for n in manifest["files"]))
    return 0


def _sizes(text: str, what: str, align: int = 1) -> list[int]:
    """Positive byte sizes from ``A,B,...`` (``parse_size`` units), each a multiple of ``align``."""
    out = []
    for item in text.split(","):
        size = parse_size(item.strip(), what)
        if size <= 0:
            raise ConfigError(f"{what}: sizes must be positive, got {item.strip()!r} (e.g. 128KiB,1MiB,16MiB)")
        if size % align:
            raise ConfigError(f"{what}: {item.strip()!r} is {size:,} bytes, not a multiple of {align:,} "
                              "(O_DIRECT reads); use KiB/MiB sizes")
        out.append(size)
    return out


def _counts(text: str, what: str) -> list[int]:
    """Positive integers from ``A,B,...``."""
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{what}: expected comma-separated integers >= 1 (e.g. 1,4,16), got {text!r}")
    return values


def _probe(args) -> int:
    """Measure read throughput of an existing file for each block size x concurrency (read-only)."""
    from kvtier.loader.probe import probe

    blocks = _sizes(args.block_sizes, "--block-sizes", 4096 if args.cold else 1)
    concs = _counts(args.concurrency, "--concurrency")
    max_bytes = parse_size(args.max_bytes, "--max-bytes") if args.max_bytes else None
    results = [probe(args.path, b, c, max_bytes, args.cold) for b in blocks for c in concs]
    rows = [{"block_size": r.block_size, "concurrency": r.concurrency, "gb_per_s": r.gb_per_s} for r in results]
    if args.json:
        emit_json({"results": rows})
    else:
        print_table(["block size", "concurrency", "GB/s"],
                    [[format_bytes(r["block_size"]), r["concurrency"], r["gb_per_s"]] for r in rows],
                    title=f"probe {args.path} ({'O_DIRECT' if args.cold else 'page cache'})")
    return 0


def _load(args) -> int:
    """Stream every tensor of a model (through the node cache for s3:// when --cache-dir is set)."""
    from kvtier.loader.cache import resolve
    from kvtier.loader.reader import StreamReader, model_files

    import torch  # noqa: F401  (imported before the clock starts)

    config = _reader_config(args)
    uri = resolve(args.model, args.cache_dir)
    files = model_files(uri, config.endpoint_url)
    start = time.perf_counter()
    count = 0
    with StreamReader(files, config) as reader:
        total = reader.total_bytes()
        with _progress(args, "load", total) as bar:
            for _name, _tensor in reader.stream(on_bytes=bar.update if bar is not None else None):
                count += 1
    secs = time.perf_counter() - start
    out = {"files": len(files), "tensors": count, "bytes": total, "seconds": secs,
           "gb_per_s": total / secs / 1e9 if secs else 0.0}
    if args.json:
        emit_json(out)
    else:
        print(f"{count} tensors, {format_bytes(total)} in {secs:.2f} s: {out['gb_per_s']:.2f} GB/s")
    return 0

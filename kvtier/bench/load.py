"""``kvtier bench load``: weight-loading throughput of kvtier beside safetensors, dd and Run:ai."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the load benchmark."""
    parser.add_argument("target", nargs="?", default=None,
                        help="safetensors file or s3:// URI (default: generate one)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (being written)."""
    print("kvtier bench load: not implemented yet")
    return 1

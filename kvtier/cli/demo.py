"""``kvtier demo``: the document's KV-offload experiment on a real vLLM engine (the main job)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo``."""
    from kvtier.bench import offload

    parser = sub.add_parser(
        "demo",
        help="reproduce the document's KV-offload experiment with vLLM (TTFT tables, capacity curve)",
        description=offload.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    offload.add_arguments(parser)
    parser.set_defaults(func=offload.run)

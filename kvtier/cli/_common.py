"""Helpers shared by command modules: JSON output, tables, notes, and the one-line message for
a missing optional dependency."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence


def emit_json(obj: Any) -> None:
    """Print ``obj`` as JSON on stdout (one document)."""
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def note(text: str) -> None:
    """One line on stderr that qualifies the output (stdout stays machine-readable)."""
    print(f"note: {text}", file=sys.stderr)


# top-level module -> what installs it (the extra's name, or the instruction for vLLM)
OPTIONAL_MODULES = {
    "redis": "pip install 'kvtier[redis]'",
    "hiredis": "pip install 'kvtier[redis]'",
    "boto3": "pip install 'kvtier[s3]'",
    "botocore": "pip install 'kvtier[s3]'",
    "prometheus_client": "pip install 'kvtier[server]'",
    "torch": "pip install 'kvtier[loader]' (or use the torch of your vLLM install)",
    "safetensors": "pip install 'kvtier[loader]'",
    "matplotlib": "pip install 'kvtier[plot]'",
    "runai_model_streamer": "pip install 'kvtier[bench]'",
    "vllm": "install vLLM >= 0.32 for your hardware (kvtier's extras never install it)",
    "transformers": "install vLLM >= 0.32 for your hardware (it brings transformers)",
}


def missing_dependency(exc: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional module that is not installed, naming what installs
    it; None when the missing module is not one of kvtier's optional dependencies."""
    root = (exc.name or "").split(".")[0]
    if root not in OPTIONAL_MODULES:
        return None
    return f"this command needs the optional module {root!r}, which is not installed: {OPTIONAL_MODULES[root]}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """Print a plain Markdown table (readable in a terminal, pasteable into a README)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)

"""Plain-text output shared by the ``kvtier`` commands and the benchmarks: one JSON document on
stdout, Markdown tables, notes on stderr (stdout stays machine-readable).

Imports: the standard library only (the ground floor), so a benchmark prints without importing
the CLI above it.
"""

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


__all__ = ["emit_json", "note", "print_table"]

"""``kvtier kv-size | breakeven | fleet-load | simulate``: planning calculators and the policy simulator."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the planning subcommands (filled in below as they land)."""

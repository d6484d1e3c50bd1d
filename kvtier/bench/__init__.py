"""Benchmark programs: each measures kvtier and the named baseline side by side in one run."""

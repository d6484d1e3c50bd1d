"""kvtier: the storage layer for LLM serving (tiered KV cache and streaming weight loading).

The layout and the import direction (``cli`` -> ``bench`` -> ``route``, ``integrations`` ->
``server`` -> ``store`` -> ``tiers``, ``policies``, ``loader``, ``plan`` -> the ground floor:
``keys``, ``entry``, ``config``, ``errors``, ``registry``, ``buffers``, ``fileio``, ``s3client``,
``output``) are in the README's "Layout" section; ``tests/test_layout.py`` checks the direction.

``__version__`` is the one version source: ``pyproject.toml`` reads it at build time
(``[tool.setuptools.dynamic]``) and ``kvtier --version`` prints it.
"""

__version__ = "0.1.0"

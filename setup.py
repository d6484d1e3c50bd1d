"""The one compiled part of kvtier, optional: ``kvtier._ntcopy`` (streaming copies of KV pages,
see its source). Everything else is in pyproject.toml. Where no C compiler is found the build
goes on without it and ``kvtier.fastcopy`` copies with numpy; ``KVTIER_NO_EXTENSIONS=1`` leaves
it out on purpose (a pure-Python wheel for any Python, as the Dockerfile builds)."""

import os

from setuptools import Extension, setup

extensions = [] if os.environ.get("KVTIER_NO_EXTENSIONS") == "1" else [
    Extension("kvtier._ntcopy", ["kvtier/_ntcopy.c"], optional=True, extra_compile_args=["-O2"]),
]
setup(ext_modules=extensions)
